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

_KERNELS = []


def kernels():
    if not _KERNELS:
        from conv_patch.kernels import api
        _KERNELS.append(api)
    return _KERNELS[0]


def kernel_errors() -> tuple:
    """Compile failures and resource limits (e.g. more shared memory than
    this GPU has)."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - Triton always has them today
        return ()
    return (CompilationError, OutOfResources)
