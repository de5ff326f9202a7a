"""RMS norm over channels as a torch-facing op: ``rms_norm`` (the norm of the
Wan-family video VAEs, ``act(F.normalize(x, dim=1) * scale * weight + bias)``,
in one pass of conv-patch's kernel where it takes the call, PyTorch
otherwise) and the rule of which calls the kernel takes
(``rms_norm_target``). ``conv_patch.runtime.dispatch`` plans RMS-norm modules' calls
on top of these; ``conv_patch.functional`` re-exports them."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.ops.loader import kernels
from conv_patch.activations import activation_code, eager_epilogue
from conv_patch.specs import KERNEL_DTYPES, needs_grad
from conv_patch.target import Target, target_for

# (BLOCK_C, BLOCK_S) of the kernel: 32 channels x 128 positions a step on a
# GPU (4096 elements, the GroupNorm apply pass's size); under the
# interpreter, where each program costs Python time, few and large programs.
RMS_LAUNCH = {"gpu": (32, 128), "interpreter": (64, 4096)}
# On a GPU, up to ONE_PASS_MAX_C channels: every channel in one block of
# ONE_PASS[channels contiguous] (elements, warps), the input read once
# (the tiles measured best: docs/performance.md, "RMS norm in one pass").
ONE_PASS_MAX_C = 512
ONE_PASS = {True: (4096, 4), False: (8192, 8)}


def launch_tiles(c: int, channels_contiguous: bool, interpreter: bool) -> tuple:
    """(BLOCK_C, BLOCK_S, num_warps) of the kernel for ``c`` channels."""
    if interpreter:
        return (*RMS_LAUNCH["interpreter"], 4)
    block_c = 1 << max(0, (c - 1).bit_length())
    if block_c <= ONE_PASS_MAX_C:
        elements, warps = ONE_PASS[channels_contiguous]
        return block_c, max(1, elements // block_c), warps
    return (*RMS_LAUNCH["gpu"], 4)


def positions_view(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x`` [N, C, *spatial] as an [N, C, S] view (S the positions, one
    stride), or None where its spatial axes do not merge into one stride
    (they do for contiguous and channels_last / channels_last_3d tensors)."""
    n, c = x.shape[0], x.shape[1]
    try:
        return x.view(n, c, -1) if x.dim() > 3 else x
    except RuntimeError:
        # NHWC / NDHWC: view a permutation with the channels last.
        order = (0, *range(2, x.dim()), 1)
        try:
            return x.permute(order).reshape(n, -1, c).transpose(1, 2) if x.permute(order).is_contiguous() else None
        except RuntimeError:
            return None


def _memory_format(x: torch.Tensor):
    """The memory format ``x`` is dense in, or None."""
    for fmt in (torch.contiguous_format, torch.channels_last if x.dim() == 4 else torch.channels_last_3d
                if x.dim() == 5 else None):
        if fmt is not None and x.is_contiguous(memory_format=fmt):
            return fmt
    return None


def _output_format(x: torch.Tensor):
    """The output's memory format: the one ``x`` is dense in, else (a slice
    of a larger tensor, LTX-Video's clip after a time upsample drops its
    first frames) dense in ``x``'s order of axes, channels last or first."""
    fmt = _memory_format(x)
    if fmt is None:
        last = x.dim() in (4, 5) and x.shape[1] > 1 and x.stride(1) == 1
        fmt = (torch.channels_last if x.dim() == 4 else torch.channels_last_3d) if last else torch.contiguous_format
    return fmt


def rms_norm_target(x: torch.Tensor, weight, bias) -> Optional[Target]:
    """The target whose kernel takes this call, or None."""
    if x.dim() < 3:
        raise ValueError(f"rms_norm: expected [N, C, ...] with spatial axes, got {tuple(x.shape)}")
    if torch.compiler.is_compiling():
        return None  # traced as its eager expression (Inductor fuses it)
    target = target_for(x.device)
    ok = (target.kernels and x.dtype in KERNEL_DTYPES and x.numel() > 0
          and not needs_grad(x, weight, *([bias] if isinstance(bias, torch.Tensor) else []))
          and all(t is None or (isinstance(t, torch.Tensor) and t.device == x.device and t.numel() == x.shape[1])
                  for t in (weight, bias))
          and positions_view(x) is not None)
    return target if ok else None


def torch_rms_norm(x, weight=None, bias=None, scale: float = 1.0, eps: float = 1e-12, activation: str = "none",
                   eps_added: bool = False):
    """The op's eager expression: the normalised value in fp32, then the
    affine and the activation in ``x``'s dtype."""
    shape = (-1,) + (1,) * (x.dim() - 2)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + eps) if eps_added
         else F.normalize(xf, dim=1, eps=eps)).to(x.dtype) * scale
    if weight is not None:
        y = y * weight.reshape(shape).to(x.dtype)
    if bias is not None:
        y = y + bias.reshape(shape).to(x.dtype)
    return eager_epilogue(y, None, 1.0, activation, 1.0)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
             scale: float = 1.0, eps: float = 1e-12, activation: str = "none",
             out: Optional[torch.Tensor] = None, eps_added: bool = False) -> torch.Tensor:
    """``act(F.normalize(x, dim=1, eps=eps) * scale * weight + bias)`` over
    [N, C, *spatial] ``x`` (``weight``/``bias`` C values each, any shape,
    e.g. Wan's [C, 1, 1, 1]); with ``eps_added`` the norm is diffusers'
    ``RMSNorm``'s over the channels, ``x * rsqrt(mean_C(x^2) + eps)``
    (LTX-Video's VAE). fp32 arithmetic, the output in ``x``'s dtype
    and memory format (into ``out`` when given, which may be ``x``). Dense
    contiguous or channels-last inputs run the kernel (on a GPU, or the CPU
    under the interpreter); anything else runs ``torch_rms_norm``."""
    code = activation_code(activation)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride() != x.stride()):
        raise ValueError(f"rms_norm: out must match the input's shape {tuple(x.shape)}, dtype and strides")
    target = rms_norm_target(x, weight, bias)
    if target is None:
        y = torch_rms_norm(x, weight, bias, scale, eps, activation, eps_added)
        return y if out is None else out.copy_(y)
    k = kernels()
    if out is None:
        # Through the kernels' allocator: a recorded plan allocates it afresh
        # (a tensor made otherwise is none the plan can name: no plan).
        out = k.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_output_format(x))
    xv = positions_view(x)
    block_c, block_s, warps = launch_tiles(x.shape[1], xv.stride(1) == 1, target.interpreter)
    flat = [None if t is None else t.reshape(-1) for t in (weight, bias)]
    k.launch_rms_norm(xv, positions_view(out), flat[0], flat[1], scale, eps, code, block_c, block_s, warps,
                      eps_added=eps_added)
    return out
