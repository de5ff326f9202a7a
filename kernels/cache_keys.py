"""Every kernel's Triton cache key computed once, helpers before callers.

Triton keys its on-disk cache by, among other things, a hash of each
kernel's source and of the ``@triton.jit`` helpers it calls, with the
constexpr globals they read. Triton 3.6 merges a helper's globals into its
caller's hash before it has hashed the helper, so a kernel hashed before its
helpers gets another key than one hashed after them (Triton 3.9 hashes the
helper first). Which comes first followed the order of a process's first
launches, and that of the compile threads of a pass compiling ahead: a
later process with the cache warm missed it and compiled again
(docs/performance.md, forty-first session).

``fix(kernel)``, before a launch of ``kernel`` that may compile, hashes the
helpers it calls, each before the functions that call it, then the kernel:
every process gets the keys Triton 3.9 would give, whatever it launches
first. ``fix_loaded()`` does it for every kernel function loaded (on
``apply``'s background thread, ahead of the first call).
"""

from __future__ import annotations

import sys
import threading
import types

from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)

_LOCK = threading.Lock()
_FIXED: set = set()  # id() of the functions hashed here (module-level: they live as long as the process)
_JIT: list = []
PACKAGE = "conv_patch.kernels."


def _jit_class():
    if not _JIT:
        from triton.runtime.jit import JITFunction
        _JIT.append(JITFunction)
    return _JIT[0]


def loaded() -> list:
    """(module, name, function) of every ``@triton.jit`` function defined in
    the kernel modules imported so far, in a fixed order."""
    jit = _jit_class()
    out = []
    for modname, mod in sorted((k, v) for k, v in list(sys.modules.items()) if k.startswith(PACKAGE)):
        for name, obj in sorted(vars(mod).items()):
            if isinstance(obj, jit) and getattr(obj.fn, "__module__", None) == modname:
                out.append((modname, name, obj))
    return out


def called(fn) -> list:
    """The ``@triton.jit`` functions ``fn`` names, directly or as an
    attribute of a module it names (its bytecode's global names: no parse)."""
    jit = _jit_class()
    out = []
    names = fn.fn.__code__.co_names
    for name in names:
        obj = fn.fn.__globals__.get(name)
        if isinstance(obj, jit):
            out.append(obj)
        elif isinstance(obj, types.ModuleType):
            out += [getattr(obj, a) for a in names if isinstance(getattr(obj, a, None), jit)]
    return out


def post_order(fns, done=frozenset()) -> list:
    """``fns`` and the functions they call, each after those it calls; none
    whose id is in ``done`` (nor what only they lead to)."""
    order, seen = [], set(done)

    def visit(fn):
        if id(fn) in seen:
            return
        seen.add(id(fn))
        for dep in called(fn):
            visit(dep)
        order.append(fn)

    for fn in fns:
        visit(fn)
    return order


def _hash(fns) -> None:
    with _LOCK:
        for fn in post_order(fns, _FIXED):
            try:
                fn.cache_key  # noqa: B018 - computed and kept by Triton
            except Exception:  # noqa: BLE001 - that kernel's own launch raises it, where it is handled
                pass
            _FIXED.add(id(fn))


def fix(kernel) -> None:
    """``kernel``'s helpers hashed before it, then it (module docstring);
    once per kernel, and nothing for one that Triton does not compile (the
    interpreter's)."""
    if id(kernel) not in _FIXED and isinstance(kernel, _jit_class()):
        _hash([kernel])


def fix_loaded() -> None:
    """``fix`` for every kernel function loaded."""
    _hash([fn for _, _, fn in loaded()])
