"""The fused epilogue as a pass of its own, after a convolution the kernels
did not compute (the cuDNN routes, 2-D and 3-D): ``out_scale * act(y + bias
+ beta * residual)`` in one launch of the conv kernels' own epilogue on a
dense NHWC output, PyTorch's ops (``activations.eager_epilogue``) elsewhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from conv_patch.activations import activation_code, eager_epilogue, per_channel
from conv_patch.ops.loader import kernels
from conv_patch.specs import KERNEL_DTYPES, needs_grad
from conv_patch.target import Target, target_for

# Elements per program of the epilogue pass: memory-bound, like the
# GroupNorm apply pass, so the same size; under the interpreter one program.
EPILOGUE_BLOCK = {"gpu": 4096, "interpreter": 1 << 16}


def check_residual(residual: Optional[torch.Tensor], out_shape: tuple) -> None:
    """A residual must have the convolution's output shape (PyTorch's add
    would broadcast it; the kernels read it element for element)."""
    if residual is not None and tuple(residual.shape) != tuple(out_shape):
        raise ValueError(
            f"residual has shape {tuple(residual.shape)}, the convolution's output is {tuple(out_shape)}")


def _epilogue_target(y: torch.Tensor, bias=None, residual=None, out=None) -> Optional[Target]:
    """The target whose epilogue kernel takes a conv output shaped and laid
    out like ``y`` (dense NHWC, 4-D, on a device with kernels; inference),
    or None."""
    if torch.compiler.is_compiling() or y.dim() != 4 or needs_grad(y, bias, residual):
        return None
    target = target_for(y.device)
    if not (target.kernels and y.dtype in KERNEL_DTYPES
            and (y.is_contiguous(memory_format=torch.channels_last) or y.shape[1] == 1)):
        return None
    ok = all(t is None or (t.device == y.device and t.dtype == y.dtype) for t in (bias, residual, out)) and (
        bias is None or (bias.dim() == 1 and bias.is_contiguous()))
    return target if ok else None


def epilogue(y: torch.Tensor, bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
             beta=1.0, activation: str = "none", out_scale=1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out_scale * act(y + bias + beta * residual)`` with ``bias`` per
    channel of [N, C, H, W] ``y``: one pass of the conv kernels' epilogue
    on dense NHWC outputs on a device with kernels, PyTorch ops otherwise.
    Into ``out`` when given (which may be ``y`` or ``residual``). PReLU
    (``activations.ChannelSlopes``) included."""
    code = activation_code(activation, per_channel=True)
    check_residual(residual, y.shape)
    if out is not None and tuple(out.shape) != tuple(y.shape):
        raise ValueError(f"epilogue: out has shape {tuple(out.shape)}, expected {tuple(y.shape)}")
    target = _epilogue_target(y, bias, residual, out)
    if target is None:
        z = y
        if bias is not None:
            # [C, 1, 1]: the channel is dim -3 of a batched and of an unbatched output.
            b = bias.view(-1, 1, 1)
            z = y.add_(b) if out is y else y + b
        z = eager_epilogue(z, residual, beta, activation, out_scale)
        return z if out is None or z is out else out.copy_(z)
    k = kernels()
    if out is None:
        fmt = torch.channels_last if y.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
        out = k.empty(y.shape, dtype=y.dtype, device=y.device, memory_format=fmt)
    block = EPILOGUE_BLOCK["interpreter" if target.interpreter else "gpu"]
    if per_channel(activation):
        bias = activation.params(bias, y.shape[1], y.device)
    return k.launch_epilogue(y, bias, residual, out, beta=beta, activation=code, out_scale=out_scale,
                             block=block)
