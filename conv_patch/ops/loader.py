"""The Triton kernels, imported on the first launch only.

``kernels()`` is ``conv_patch.kernels.api`` (every launcher): importing it
imports Triton and decorates the kernels, so ``import conv_patch`` does not;
it is held here after the first call, since an import statement on every
launch is host time on the hot path. ``kernel_errors()`` are the errors that
mean "this kernel cannot run on this machine", not "the answer would be
wrong": a call that raises one runs on PyTorch instead (the dispatch core
warns once and remembers it).
"""

from __future__ import annotations

import threading

_KERNELS = []
_BACKGROUND = []


def kernels():
    if not _KERNELS:
        from conv_patch.kernels import api
        _KERNELS.append(api)
    return _KERNELS[0]


def load_in_background() -> None:
    """``kernels()`` imported, Triton's cache key computed (``hash_triton``)
    and the kernels' own (``fix_cache_keys``) on a daemon thread, once per
    process: what a patched model's first call on a GPU would otherwise wait
    for before its first kernel (``apply`` starts it). An import the caller
    makes meanwhile waits for the thread's, as two imports of one module do,
    and a launch meanwhile for the kernels' keys."""
    if _BACKGROUND:
        return
    thread = threading.Thread(target=_load, name="conv-patch-load", daemon=True)
    _BACKGROUND.append(thread)
    thread.start()


def wait_for_background(timeout: float = 60.0) -> None:
    """Wait for ``load_in_background``'s thread where it still runs: a
    thread that asks Triton for a kernel meanwhile would hash Triton's
    library a second time beside it (its key is cached only once
    computed), so the compiling pass waits for the one under way instead."""
    if _BACKGROUND and _BACKGROUND[0].is_alive() and _BACKGROUND[0] is not threading.current_thread():
        _BACKGROUND[0].join(timeout)


def _load() -> None:
    try:
        kernels().hash_triton()
        kernels().fix_cache_keys()
    except Exception:  # noqa: BLE001 - the first launch imports again and raises where it is handled
        pass


def kernel_errors() -> tuple:
    """Compile failures and resource limits (e.g. more shared memory than
    this GPU has)."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - Triton always has them today
        return ()
    return (CompilationError, OutOfResources)
