"""The convolution as a PyTorch op (``ops/library.py``), for ``torch.compile``.

``torch.ops.conv_patch.conv`` takes the whole call (input, weight, bias,
residual, geometry, epilogue) and runs it through the one dispatch entry
(``dispatch.conv_with`` with a ``dispatch.CallSite``): planned per signature,
a kernel only where it beats PyTorch as called, like a wrapper's call. Its
fake implementation only computes the output's shape, dtype and memory
format, so Dynamo traces a patched model without graph breaks and Inductor
treats the call as one opaque kernel. Under tracing the wrappers call this op
instead of falling back (``wrappers.PatchedConvMixin.cp_call``).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from conv_patch.ops import conv2d as conv_op
from conv_patch.ops import library
from conv_patch.runtime import dispatch
from conv_patch.call import Call
from conv_patch.specs import ConvSpec, needs_grad


def _spec(x, weight, bias, transposed, stride, pad_begin, pad_end, dilation, output_padding) -> ConvSpec:
    c_in, c_out = (weight.shape[0], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[0])
    return ConvSpec(bool(transposed), int(c_in), int(c_out), tuple(weight.shape[2:]), tuple(stride),
                    tuple(dilation), tuple(pad_begin), tuple(pad_end), tuple(output_padding), 1, "zeros",
                    bias is not None)


@library.op("conv(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, bool transposed, int[] stride, "
            "int[] pad_begin, int[] pad_end, int[] dilation, int[] output_padding, float beta, str activation, "
            "float out_scale) -> Tensor")
def conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         transposed: bool, stride: List[int], pad_begin: List[int], pad_end: List[int], dilation: List[int],
         output_padding: List[int], beta: float, activation: str, out_scale: float) -> torch.Tensor:
    spec = _spec(x, weight, bias, transposed, stride, pad_begin, pad_end, dilation, output_padding)
    # The one dispatch entry, with a call site for the plans and the pack:
    # planned, weighed against PyTorch and replayed like a wrapper's call.
    site = dispatch.call_site(spec, weight, bias)
    y = dispatch.conv_with(site, weight, bias, Call(x, residual, beta, activation, out_scale,
                                                    output_padding=tuple(output_padding) if transposed else None,
                                                    fallback_args=(weight, bias)))
    # An op's output must not alias its inputs (the compiled graph may free them).
    return y.clone() if y is x or y is residual else y


@library.fake(conv)
def _(x, weight, bias, residual, transposed, stride, pad_begin, pad_end, dilation, output_padding,
      beta, activation, out_scale):
    spec = _spec(x, weight, bias, transposed, stride, pad_begin, pad_end, dilation, output_padding)
    shape = conv_op.output_shape(spec, tuple(x.shape), output_padding)
    # The real op's strides: PyTorch's format (run_kernel allocates a 3-D
    # call's output batched, then squeezes it, as PyTorch does).
    fmt = conv_op.output_memory_format(x, weight)
    y = torch.empty((1,) + shape if len(shape) == 3 else shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    return y.squeeze(0) if len(shape) == 3 else y


def takes(module, x, residual=None) -> bool:
    """Whether a traced call of patched conv ``module`` on ``x`` is the
    ops' (else Dynamo traces the module's own computation): no autograd
    (the ops have no backward), no autocast (the op would compute in the
    input's dtype, not autocast's), no ComfyUI weight casting or patching
    (the original forward builds the weight per call)."""
    return (not needs_grad(x, module.weight, module.bias, residual) and not torch.is_autocast_enabled(x.device.type)
            and not module.cp_comfy_active())


def call(module, c: Call) -> torch.Tensor:
    """The op for a wrapper's call (what its forward runs under tracing)."""
    spec = module.spec
    op = list(c.output_padding) if c.output_padding is not None else list(spec.output_padding)
    return conv(c.x, module.weight, module.bias, c.residual, spec.transposed, list(spec.stride),
                list(spec.pad_begin), list(spec.pad_end), list(spec.dilation), op,
                float(c.beta), c.activation, float(c.out_scale))


def _upsample_spec(weight, bias) -> ConvSpec:
    return ConvSpec(False, int(weight.shape[1]), int(weight.shape[0]), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1),
                    (0, 0), 1, "zeros", bias is not None)


def _upsample_format(x) -> torch.memory_format:
    return torch.channels_last if conv_op.nhwc(x) else torch.contiguous_format


@library.op("upsample_conv(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, str activation) -> Tensor")
def upsample_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  residual: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    """``act(conv3x3(F.interpolate(x, scale_factor=2)) + residual)`` as a
    recipe's folded upsample runs it eagerly: the four 2x2 convs of ``x``
    (``dispatch.upsample_conv_with``) where that pays
    (``dispatch.subpixel_pays``), else the conv of the upsampled input, both
    through the one dispatch entry on call sites of this weight."""
    site = dispatch.call_site(_upsample_spec(weight, bias), weight, bias)
    y = None
    if dispatch.subpixel_pays(x, weight):
        y = dispatch.upsample_conv_with(site, weight, bias, x, residual, activation)
    if y is None:
        up = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        y = dispatch.conv_with(site, weight, bias, Call(up, residual, activation=activation,
                                                        fallback_args=(weight, bias)))
    # One layout whichever way it ran (the fake's).
    y = y.contiguous(memory_format=_upsample_format(x))
    return y.clone() if y is residual else y


@library.fake(upsample_conv)
def _(x, weight, bias, residual, activation):
    n, _, h, w = x.shape
    return torch.empty((n, weight.shape[0], 2 * h, 2 * w), dtype=x.dtype, device=x.device,
                       memory_format=_upsample_format(x))


def upsample_call(module, x, residual=None, activation="none") -> torch.Tensor:
    """The folded-upsample op for patched 3x3 conv ``module`` (what a
    recipe's upsample step runs under tracing)."""
    return upsample_conv(x, module.weight, module.bias, residual, activation)
