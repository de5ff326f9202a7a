"""The 2-D convolution ops a route runs: the launch of a kernel route
(``run_kernel``: the output allocated, the NHWC staging copy where the TMA
kernel needs it), the cuDNN route (``cudnn_conv2d``: ``F.conv2d`` without its
bias, then the fused epilogue as one pass), and the shapes and layouts they
share. The dispatch core's plans call these once per signature and replay
what they launched; the functional API calls them directly."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.activations import activation_code, per_channel
from conv_patch.ops.epilogue import check_residual, epilogue
from conv_patch.ops.loader import kernels
from conv_patch.routing.registry import Route, launcher_of
from conv_patch.specs import ConvSpec, nhwc_pitch, suggests_channels_last
from conv_patch.target import Target, dot_precision


def output_shape(spec: ConvSpec, shape: tuple, output_padding=None) -> tuple:
    oh, ow = spec.output_hw(shape[-2], shape[-1], output_padding)
    return tuple(shape[:-3]) + (spec.out_channels, oh, ow)


def output_memory_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """The memory format of PyTorch's conv2d / conv_transpose2d output for
    ``x`` and ``weight`` (as the caller holds it: a transposed conv's
    [C_in, C_out, KH, KW]): channels_last where the input or the weight
    suggests it (cuDNN's ``cudnn_conv_suggest_memory_format``, mkldnn's and
    the CPU's own rule alike; float64, which the kernels never take, aside).
    A 3-D input is batched as PyTorch batches it, by ``unsqueeze(0)``."""
    shape, stride = tuple(x.shape), x.stride()
    if len(shape) == 3:
        shape, stride = (1,) + shape, (shape[0] * stride[0],) + stride
    if suggests_channels_last(shape, stride) or suggests_channels_last(tuple(weight.shape), weight.stride()):
        return torch.channels_last
    return torch.contiguous_format


def kernel_bias(bias: Optional[torch.Tensor], activation, channels: int, device) -> Optional[torch.Tensor]:
    """What a kernel route reads as its bias: the bias, or under PReLU the
    (bias, slope) buffer it reads both from (``ChannelSlopes.params``)."""
    return activation.params(bias, channels, device) if per_channel(activation) else bias


def run_kernel(route: Route, config: dict, target: Target, spec: ConvSpec, x: torch.Tensor,
               w: torch.Tensor, bias: Optional[torch.Tensor], *, residual=None, beta=1.0,
               activation: str = "none", out_scale=1.0, output_padding=None,
               out: Optional[torch.Tensor] = None, force_int64: bool = False,
               memory_format: Optional[torch.memory_format] = None) -> torch.Tensor:
    """Launch kernel route ``route`` with tile ``config``. ``w`` is the
    [C_out, C_in, KH, KW] view the route's launcher reads, in the layout it
    reads (``runtime.pack.route_weight``: the TMA kernel's dense co,kh,kw,ci
    pack); ``bias`` what ``kernel_bias`` gives. ``memory_format``: the output's where ``out`` is not given
    (PyTorch's, ``output_memory_format`` of the input and the caller's own
    weight; by default of ``w``)."""
    k = kernels()
    if out is None and memory_format is None:
        memory_format = output_memory_format(x, w)
    unbatched = x.dim() == 3
    if unbatched:
        x = x.unsqueeze(0)
        residual = residual.unsqueeze(0) if residual is not None else None
    shape = output_shape(spec, tuple(x.shape), output_padding)
    if out is None:
        out = k.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format)
    elif unbatched:
        out = out.unsqueeze(0)
    if route is Route.CONV2D_TMA and not nhwc_pitch(x) and not k.reads_nchw_in_place(
            x, w.shape, spec.pad_begin, spec.stride, config, out, residual):
        # The NHWC staging copy (see kernels/conv2d_tma.py); ``out`` was
        # allocated above in the caller's layout and stays in it. An NHWC
        # channel slice is boxed in place.
        x = to_nhwc(x)
    launcher_of(route)(x, w, bias, out, residual, stride=spec.stride, padding=spec.pad_begin,
                       dilation=spec.dilation, beta=beta, activation=activation_code(activation, per_channel=True),
                       out_scale=out_scale, config=config, precision=dot_precision(x.dtype, target),
                       upcast=target.interpreter, force_int64=force_int64)
    return out.squeeze(0) if unbatched else out


def cudnn_conv2d(spec: ConvSpec, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *,
                 residual=None, beta=1.0, activation: str = "none", out_scale=1.0,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The CUDNN route: ``F.conv2d`` computes the convolution without its
    bias, and ``epilogue`` adds bias, residual, activation and scale in one
    pass (PyTorch's own bias add is a pass of its own, unvectorised on a
    channels_last output)."""
    if spec.pad_begin != spec.pad_end:
        (t, l), (b, r) = spec.pad_begin, spec.pad_end
        x, padding = F.pad(x, (l, r, t, b)), 0
    else:
        padding = spec.pad_begin
    y = F.conv2d(x, weight, None, spec.stride, padding, spec.dilation)
    check_residual(residual, y.shape)
    if bias is None and residual is None and activation == "none" and out_scale == 1.0:
        return y if out is None else out.copy_(y)
    return epilogue(y, bias, residual, beta, activation, out_scale, out=y if out is None else out)


def to_nhwc(x: torch.Tensor) -> torch.Tensor:
    """A dense channels_last copy of a contiguous NCHW ``x`` (Triton kernel;
    see kernels/layout.py for why not PyTorch's own)."""
    k = kernels()
    if x.is_contiguous(memory_format=torch.channels_last):
        return x
    out = k.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    return k.launch_nchw_to_nhwc(x.contiguous(), out)


def nhwc(x: torch.Tensor) -> bool:
    """Dense channels_last and not also contiguous (an NHWC activation)."""
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
