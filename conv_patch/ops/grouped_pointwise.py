"""A grouped 1x1 convolution as a torch-facing op: ``grouped_pointwise(conv,
x)`` is ``conv(x)`` for an ``nn.Conv2d`` of kernel 1 and groups > 1 on a
channels-last input, in one launch of conv-patch's kernel
(kernels/grouped_pointwise.py); ``problem(conv, x)`` says why a call is not
the kernel's (``conv_problem(conv)``: why no call of the module is), and
the caller then runs the module. ``apply`` leaves grouped
convs as they are; a recipe calls this where it knows the block's forward
(recipes/dcae.py)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from conv_patch.ops.loader import kernels
from conv_patch.specs import KERNEL_DTYPES, needs_grad
from conv_patch.target import dot_precision, target_for


def conv_problem(conv: nn.Module) -> Optional[str]:
    """Why the kernel takes no call of ``conv``, or None."""
    if type(conv) is not nn.Conv2d:
        return f"{type(conv).__name__} is not an nn.Conv2d"
    if conv.groups < 2 or conv.kernel_size != (1, 1) or conv.stride != (1, 1) or conv.dilation != (1, 1) \
            or conv.padding not in ((0, 0), "valid") or conv.padding_mode != "zeros":
        return "not a grouped 1x1 conv of stride 1 without padding"
    w, b = conv.__dict__["_parameters"].get("weight"), conv.__dict__["_parameters"].get("bias")
    if w is None or w.shape != (conv.out_channels, conv.in_channels // conv.groups, 1, 1) or not w.is_contiguous():
        return "the weight is not the conv's own dense parameter"
    return None


def problem(conv: nn.Module, x) -> Optional[str]:
    """Why the kernel does not take ``conv(x)``, or None where it does."""
    why = conv_problem(conv)
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
    if needs_grad(x, w, b):
        return "autograd"
    return None


def grouped_pointwise(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` (channels-last) where ``problem(conv, x)`` is None."""
    n, c, h, w_ = x.shape
    c_out = conv.out_channels
    out = torch.empty((n, c_out, h, w_), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    target = target_for(x.device)
    bias = conv.bias
    kernels().launch_grouped_pointwise(
        x.permute(0, 2, 3, 1).view(n * h * w_, c), conv.weight.detach().view(c_out, -1),
        None if bias is None else bias.detach(), out.permute(0, 2, 3, 1).view(n * h * w_, c_out), conv.groups,
        precision=dot_precision(x.dtype, target), upcast=target.interpreter)
    return out
