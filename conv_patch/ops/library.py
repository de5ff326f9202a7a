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
"""

from __future__ import annotations

from typing import Callable

import torch

NAMESPACE = "conv_patch"
LIB = torch.library.Library(NAMESPACE, "DEF")


# The tag telling Inductor not to capture an op in a CUDA graph (it runs
# between the graph's captured parts); None in a torch without it.
CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


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
            return impl(*args)

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
