"""conv-patch's PyTorch ops (``torch.ops.conv_patch.*``: the conv, the
folded upsample, the GroupNorm pass and the wide-head attention that
compiled graphs call), defined on
one ``torch.library.Library``: a schema, one implementation for every
device (``CompositeExplicitAutograd``) and a fake for tracing (``op``,
``fake``); or a schema whose implementation is made of other ops
(``composite``: ``CompositeImplicitAutograd``), which tracing replaces by
the ops it calls for the shapes it traces (how a compiled graph gets
PyTorch's own convolution where the kernels would not take the call).

Why not ``torch.library.custom_op``: its Python wrapping (an autograd
wrapper, a Dynamo-disabled frame, a redispatch, an alias check of the
outputs) costs about 24 µs a call on a 13-argument op (CPU, torch 2.13: 32.8
µs against 15.6 for the same op defined here, around an 8 µs
``F.conv2d``), paid by every conv of a compiled graph; defined here, a call
goes from the dispatcher to the implementation. What that wrapping checked
the callers keep: the implementations return fresh tensors (never an
input), and the ops are only called where nothing needs a gradient (each
caller's ``needs_grad`` check), so no autograd formula is needed; a call
that would need one raises instead of returning a result autograd cannot
differentiate.

Why the implementations run with CPython's own frame evaluator
(``eager_frames``): a graph compiled with ``fullgraph=True`` keeps Dynamo's
frame-evaluation hook installed for the interpreter while it runs (torch
2.13: its count of compiled frames), and while any such hook is installed
CPython stops inlining Python-to-Python calls. An op's Python (a patched
VAE half run whole is a few thousand calls) then ran about 45% slower than
the same code eagerly (CPU, torch 2.13: 20 000 calls 1.69 against 1.17 ms,
1.17 with the hook set aside). Nothing in an implementation is for Dynamo
to see: the hook is set aside for the call and put back after it.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

NAMESPACE = "conv_patch"
LIB = torch.library.Library(NAMESPACE, "DEF")


# The tag telling Inductor not to capture an op in a CUDA graph (it runs
# between the graph's captured parts); None in a torch without it.
CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


def _frame_api():
    """CPython's PEP 523 accessors and its default frame evaluator, or None
    where they are not there (another interpreter)."""
    try:
        api = ctypes.pythonapi
        get_interp, get, put = (api.PyInterpreterState_Get, api._PyInterpreterState_GetEvalFrameFunc,
                                api._PyInterpreterState_SetEvalFrameFunc)
        default = ctypes.cast(api._PyEval_EvalFrameDefault, ctypes.c_void_p).value
    except (AttributeError, ValueError):
        return None
    get_interp.restype, get_interp.argtypes = ctypes.c_void_p, []
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    put.restype, put.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p]
    return get_interp, get, put, default


_FRAMES = _frame_api()


def eager_frames(fn: Callable, *args):
    """``fn(*args)`` with CPython's default frame evaluator installed for
    the call where another one (Dynamo's) is, then that one put back (the
    module docstring says why)."""
    if _FRAMES is None:
        return fn(*args)
    get_interp, get, put, default = _FRAMES
    interp = get_interp()
    hook = get(interp)
    if hook == default:
        return fn(*args)
    put(interp, default)
    try:
        return fn(*args)
    finally:
        put(interp, hook)


def op(schema: str, tags: tuple = ()) -> Callable:
    """Decorator: the function is the implementation of the op ``schema``
    defines (``"name(Tensor x, ...) -> Tensor"``), with ``tags``; the
    decorated name is bound to the op's overload,
    ``torch.ops.conv_patch.<name>.default``."""
    name = schema.split("(", 1)[0].strip()

    def define(impl: Callable):
        def checked(*args):
            if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                raise RuntimeError(f"{NAMESPACE}::{name} computes no gradient; call it where none is needed "
                                   "(torch.no_grad(), or tensors that do not require grad)")
            return eager_frames(impl, *args)

        LIB.define(schema, tags=tags)
        LIB.impl(name, checked, "CompositeExplicitAutograd")
        return getattr(getattr(torch.ops, NAMESPACE), name).default

    return define


def fake(overload) -> Callable:
    """Decorator: the function is the fake (shape, dtype, layout) of
    ``overload``, one of this library's ops."""
    def register(fn: Callable):
        torch.library.register_fake(overload, fn, lib=LIB)
        return fn

    return register


def composite(schema: str) -> Callable:
    """Decorator: the function is the ``CompositeImplicitAutograd``
    implementation of the op ``schema`` defines: it computes with other
    ops (PyTorch's, or this library's), and while torch.compile traces it
    runs on the traced (fake) tensors, so the graph records the ops it
    chose, not this one. No fake is needed and no gradient check: autograd
    sees the ops it calls."""
    name = schema.split("(", 1)[0].strip()

    def define(impl: Callable):
        LIB.define(schema)
        LIB.impl(name, impl, "CompositeImplicitAutograd")
        return getattr(getattr(torch.ops, NAMESPACE), name).default

    return define
