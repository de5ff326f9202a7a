"""Grouped convolutions as a torch-facing op: ``grouped_conv(conv, x)`` is
``conv(x)`` for an ``nn.Conv2d`` with groups > 1 of one of two forms, on a
channels-last input, in one launch of conv-patch's kernels:

* pointwise: kernel 1, stride 1, no padding (kernels/grouped_pointwise.py;
  cuDNN runs it as a GEMM per group, each behind a slicing kernel);
* depthwise: groups == in == out channels, any stride, numeric padding
  and dilation, at least ``DEPTHWISE_MIN_TAPS`` taps (kernels/depthwise.py:
  below that cuDNN's kernel is as fast).

``problem(conv, x)`` says why a call is not the kernels' (``conv_problem``:
why no call of the module is), and the caller then runs the module.
``apply`` leaves grouped convs as they are; a recipe calls this where it
knows the block's forward (recipes/dcae.py)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from conv_patch.ops.loader import kernels
from conv_patch.specs import KERNEL_DTYPES, ConvSpec, needs_grad
from conv_patch.target import dot_precision, target_for

POINTWISE, DEPTHWISE = "pointwise", "depthwise"
# The depthwise kernel is taken from this many taps: measured launched on an
# H100 against cuDNN's NHWC depthwise kernel, 5x5 1.03-1.09x and 7x7 1.31x,
# 3x3 0.94x (bench/results/grouped_conv-h100-2026-12-06.json).
DEPTHWISE_MIN_TAPS = 25


def form(conv: nn.Module) -> Optional[str]:
    """POINTWISE or DEPTHWISE where ``conv`` is one the kernels compute, else None."""
    if type(conv) is not nn.Conv2d or conv.groups < 2 or conv.padding_mode != "zeros":
        return None
    if conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.dilation == (1, 1) \
            and conv.padding in ((0, 0), "valid"):
        return POINTWISE
    if conv.groups == conv.in_channels == conv.out_channels and isinstance(conv.padding, tuple):
        return DEPTHWISE
    return None


def conv_problem(conv: nn.Module) -> Optional[str]:
    """Why the kernels take no call of ``conv``, or None."""
    return _checked(conv)[1]


def _checked(conv: nn.Module) -> Tuple[Optional[str], Optional[str]]:
    """(``form(conv)``, ``conv_problem(conv)``), the form asked once."""
    if type(conv) is not nn.Conv2d:
        return None, f"{type(conv).__name__} is not an nn.Conv2d"
    kind = form(conv)
    if kind is None:
        return None, "not a grouped 1x1 conv (stride 1, no padding) nor a depthwise conv with numeric padding"
    w = conv.__dict__["_parameters"].get("weight")
    if w is None or w.shape != (conv.out_channels, conv.in_channels // conv.groups, *conv.kernel_size) \
            or not w.is_contiguous():
        return kind, "the weight is not the conv's own dense parameter"
    return kind, None


def problem(conv: nn.Module, x) -> Optional[str]:
    """Why the kernels do not take ``conv(x)``, or None where they do."""
    kind, why = _checked(conv)
    if why is not None:
        return why
    w, b = conv.weight, conv.bias
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != conv.in_channels:
        return "the input is not a 4-D tensor of the conv's channels"
    if x.dtype not in KERNEL_DTYPES or x.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        return f"dtype {x.dtype} (weight {w.dtype})"
    if x.device != w.device or not target_for(x.device).kernels:
        return "no kernels on this device"
    if not x.is_contiguous(memory_format=torch.channels_last):
        return "the input is not channels-last"
    if kind == DEPTHWISE and conv.kernel_size[0] * conv.kernel_size[1] < DEPTHWISE_MIN_TAPS:
        return f"a depthwise conv of fewer than {DEPTHWISE_MIN_TAPS} taps: cuDNN's is as fast"
    if needs_grad(x, w, b):
        return "autograd"
    return None


def grouped_conv(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` (channels-last) where ``problem(conv, x)`` is None."""
    n, c, h, w_ = x.shape
    spec = ConvSpec.from_module(conv)
    oh, ow = spec.output_hw(h, w_)
    c_out = conv.out_channels
    out = torch.empty((n, c_out, max(oh, 0), max(ow, 0)), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    bias = None if conv.bias is None else conv.bias.detach()
    weight = conv.weight.detach()
    k = kernels()
    if form(conv) == POINTWISE:
        target = target_for(x.device)
        k.launch_grouped_pointwise(x.permute(0, 2, 3, 1).view(n * h * w_, c), weight.view(c_out, -1), bias,
                                   out.permute(0, 2, 3, 1).view(n * oh * ow, c_out), conv.groups,
                                   precision=dot_precision(x.dtype, target), upcast=target.interpreter)
    else:
        # (A depthwise conv's padding is numeric, the same on both sides: ``form``.)
        k.launch_depthwise(x, weight, bias, out, stride=spec.stride, padding=spec.pad_begin, dilation=spec.dilation)
    return out
