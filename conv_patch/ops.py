"""Torch-facing layer of the kernels: shapes, output allocation, dtype and
precision policy, the epilogue arguments; plus the eager epilogue the
fallback path uses.

``conv2d`` / ``conv_transpose2d`` are the functional entry points (recipes,
tests, benchmarks). They route through ``select_route`` like the wrappers and
raise ``UnsupportedConv`` (with the router's reason) where the wrappers would
fall back.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from .routing import RouteDecision, select_route
from .specs import CallDesc, ConvSpec, _pair, resolve_padding
from .target import Target, dot_precision, target_for

ACTIVATIONS = {"none": 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4}


class UnsupportedConv(RuntimeError):
    """The kernels cannot run this call; the message is the router's reason."""


def activation_code(activation: str) -> int:
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"activation {activation!r}: expected one of {', '.join(ACTIVATIONS)}") from None


def eager_epilogue(y: torch.Tensor, residual: Optional[torch.Tensor], beta: float,
                   activation: str, out_scale: float) -> torch.Tensor:
    """out_scale * act(y + beta * residual) with PyTorch ops (fallback path)."""
    if residual is not None:
        y = y + residual if beta == 1.0 else torch.add(y, residual, alpha=beta)
    if activation == "relu":
        y = F.relu(y)
    elif activation == "silu":
        y = F.silu(y)
    elif activation == "gelu":
        y = F.gelu(y)
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    if out_scale != 1.0:
        y = y * out_scale
    return y


def check_residual(residual: Optional[torch.Tensor], out_shape: tuple) -> None:
    if residual is not None and tuple(residual.shape) != tuple(out_shape):
        raise ValueError(
            f"residual has shape {tuple(residual.shape)}, the convolution's output is {tuple(out_shape)}")


def output_shape(spec: ConvSpec, shape: tuple, output_padding=None) -> tuple:
    oh, ow = spec.output_hw(shape[-2], shape[-1], output_padding)
    return tuple(shape[:-3]) + (spec.out_channels, oh, ow)


def run_kernel(decision: RouteDecision, target: Target, spec: ConvSpec, x: torch.Tensor,
               w: torch.Tensor, bias: Optional[torch.Tensor], *, residual=None, beta=1.0,
               activation: str = "none", out_scale=1.0, output_padding=None,
               out: Optional[torch.Tensor] = None, force_int64: bool = False) -> torch.Tensor:
    """Launch the routed kernel. ``w`` is the [C_out, C_in, KH, KW] view the
    kernels read (see conv_patch.pack); ``decision`` must be a kernel route."""
    from conv_patch import kernels  # Triton is imported on the first launch only

    unbatched = x.dim() == 3
    if unbatched:
        x = x.unsqueeze(0)
        residual = residual.unsqueeze(0) if residual is not None else None
    shape = output_shape(spec, tuple(x.shape), output_padding)
    if out is None:
        fmt = torch.channels_last if _nhwc(x) else torch.contiguous_format
        out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    elif unbatched:
        out = out.unsqueeze(0)
    launch = kernels.launch_conv_transpose2d if spec.transposed else kernels.launch_conv2d
    launch(x, w, bias, out, residual,
           stride=spec.stride, padding=spec.pad_begin, dilation=spec.dilation,
           beta=beta, activation=activation_code(activation), out_scale=out_scale,
           config=decision.config, precision=dot_precision(x.dtype, target),
           upcast=target.interpreter, force_int64=force_int64)
    return out.squeeze(0) if unbatched else out


def _nhwc(x: torch.Tensor) -> bool:
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _functional(spec: ConvSpec, x, weight, bias, residual, beta, activation, out_scale,
                out, force_int64, config):
    activation_code(activation)
    call = CallDesc.of_call(x, weight, bias, residual)
    target = target_for(x.device)
    decision = select_route(spec, call, target)
    if not decision.is_kernel:
        raise UnsupportedConv(decision.reason)
    if config is not None:
        decision = dataclasses.replace(decision, config=config, tier="given", table="")
    check_residual(residual, output_shape(spec, tuple(x.shape)))
    w = weight.transpose(0, 1) if spec.transposed else weight
    return run_kernel(decision, target, spec, x, w, bias, residual=residual, beta=beta,
                      activation=activation, out_scale=out_scale, out=out,
                      force_int64=force_int64)


def _spec(transposed, weight, bias, stride, padding, dilation, output_padding=0):
    c_out, c_in = (weight.shape[1], weight.shape[0]) if transposed else (weight.shape[0], weight.shape[1])
    k, d = _pair(tuple(weight.shape[2:])), _pair(dilation)
    begin, end = resolve_padding(padding, k, d)
    return ConvSpec(transposed, int(c_in), int(c_out), k, _pair(stride), d, begin, end,
                    _pair(output_padding), 1, "zeros", bias is not None)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, *, residual=None,
           beta=1.0, activation="none", out_scale=1.0, out=None, config=None, force_int64=False):
    """``out_scale * act(F.conv2d(x, weight, bias, ...) + beta * residual)`` in one kernel.

    The weight is read in place through its strides (no pack). ``out`` may be
    a preallocated output of any layout; ``config`` overrides the table's tile
    choice and ``force_int64`` forces 64-bit offsets (both for tests and
    benchmarks)."""
    spec = _spec(False, weight, bias, stride, padding, dilation)
    return _functional(spec, x, weight, bias, residual, beta, activation, out_scale, out,
                       force_int64, config)


def conv_transpose2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, *,
                     residual=None, beta=1.0, activation="none", out_scale=1.0, out=None,
                     config=None, force_int64=False):
    """Fused ``F.conv_transpose2d`` (groups=1); ``weight`` is [C_in, C_out, KH, KW]."""
    spec = _spec(True, weight, bias, stride, padding, dilation, output_padding)
    return _functional(spec, x, weight, bias, residual, beta, activation, out_scale, out,
                       force_int64, config)
