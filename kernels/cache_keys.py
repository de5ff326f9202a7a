"""Every kernel's Triton cache key computed once, helpers before callers.

Triton keys its on-disk cache by, among other things, a hash of each
kernel's source and of the ``@triton.jit`` helpers it calls, with the
constexpr globals they read. Triton 3.6 merges a helper's globals into its
caller's hash before it has hashed the helper, so a kernel hashed before its
helpers gets another key than one hashed after them (Triton 3.9 hashes the
helper first). Which comes first followed the order of a process's first
launches, and that of the compile threads of a pass compiling ahead: a
later process with the cache warm missed it and compiled again (TAEF2 at
512²: 17 kernels, 2.7 s in each of its first two calls;
docs/performance.md, forty-first session).

``fix()`` hashes every kernel and helper of ``conv_patch.kernels`` in one
order, each helper before the functions that call it, before the first
launch: every process gets the keys Triton 3.9 would give, whatever it
launches first.
"""

from __future__ import annotations

import sys
import threading

from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)

_DONE: list = []
_LOCK = threading.Lock()
PACKAGE = "conv_patch.kernels."


def jit_functions() -> list:
    """(module, name, function) of every ``@triton.jit`` function defined in
    the kernel modules (every one imported: ``api`` imports them all), in a
    fixed order."""
    from triton.runtime.jit import JITFunction
    from . import api  # noqa: F401 - every kernel module imported, in every process alike
    out = []
    for modname, mod in sorted((k, v) for k, v in list(sys.modules.items()) if k.startswith(PACKAGE)):
        for name, obj in sorted(vars(mod).items()):
            if isinstance(obj, JITFunction) and getattr(obj.fn, "__module__", None) == modname:
                out.append((modname, name, obj))
    return out


def called(fn) -> list:
    """The ``@triton.jit`` functions ``fn`` names, directly or as an
    attribute of a module it names (its bytecode's global names: no parse)."""
    from triton.runtime.jit import JITFunction
    out = []
    names = fn.fn.__code__.co_names
    for name in names:
        obj = fn.fn.__globals__.get(name)
        if isinstance(obj, JITFunction):
            out.append(obj)
        elif type(obj).__name__ == "module":
            out += [getattr(obj, a) for a in names if isinstance(getattr(obj, a, None), JITFunction)]
    return out


def post_order(fns) -> list:
    """``fns`` and the functions they call, each after those it calls."""
    order, seen = [], set()

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


def fix() -> None:
    """Hash every kernel function, helpers first (module docstring); once
    per process, and nothing under the interpreter (its functions are not
    compiled)."""
    if _DONE:
        return
    with _LOCK:
        if _DONE:
            return
        from .common import INTERPRET
        if not INTERPRET:
            for fn in post_order([f for _, _, f in jit_functions()]):
                try:
                    fn.cache_key  # noqa: B018 - computed and kept by Triton
                except Exception:  # noqa: BLE001 - that kernel's own launch raises it, where it is handled
                    pass
        _DONE.append(True)
