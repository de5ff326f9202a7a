"""The subpixel weight fold behind the folded upsample.

Nearest x2 upsampling then a 3x3 conv with padding 1: output row 2i+a reads
upsampled rows 2i+a-1 .. 2i+a+1, i.e. source rows {i-1, i, i} (a=0) or
{i, i, i+1} (a=1). So each output parity is a 2x2 conv of the *source*
whose taps are sums of the 3x3 taps: 16 instead of 36 multiply-adds per
source pixel and channel pair, and the 4x upsampled tensor never exists.
Parity 0's 2x2 taps are (t0, t1 + t2) of the 3x3 taps along that axis,
parity 1's (t0 + t1, t2).
"""

from __future__ import annotations

from typing import Optional

import torch

from conv_patch.ops.loader import kernels
from conv_patch.specs import KERNEL_DTYPES
from conv_patch.target import target_for


def _fold_taps(w: torch.Tensor, dim: int) -> torch.Tensor:
    """The 3 taps of ``w`` along ``dim`` folded into 2, for both parities
    (a new leading dimension). Elementwise adds only: no constant tensor
    (no host-to-device copy, which CUDA-graph capture forbids) and no GEMM
    (whose cuBLAS handle may not exist yet when a capture starts)."""
    t0, t1, t2 = w.unbind(dim)
    return torch.stack((torch.stack((t0, t1 + t2), dim), torch.stack((t0 + t1, t2), dim)))


def subpixel_weights(weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[2, 2, C_out, 2, 2, C_in] (parity a, parity b, co, kh, kw, ci), dense:
    ``[a, b].permute(0, 3, 1, 2)`` is the 2x2 weight of output parity (a, b)
    in the kernels' co,kh,kw,ci layout. Taps are summed in (at least) fp32 and
    rounded once to the weight's dtype. Recomputed at every call, like the
    packs (conv_patch/pack.py says why a cached copy could be stale): one
    kernel on a GPU (kernels/weight_prep.py), else PyTorch ops. Under the
    interpreter too: there the kernel took 6 s for a 64x64x3x3 weight on a
    2-core CPU against 21 ms (tests/test_weight_prep.py runs it directly).
    Into ``out`` (dense, the weight's dtype) when given."""
    w = weight.detach()
    target = target_for(w.device)
    if (not torch.compiler.is_compiling() and w.dtype in KERNEL_DTYPES
            and target.kernels and not target.interpreter):
        c_out, c_in = w.shape[:2]
        if out is None:
            out = torch.empty((2, 2, c_out, 2, 2, c_in), dtype=w.dtype, device=w.device)
        return kernels().launch_subpixel_fold(w, out)
    y = _subpixel_weights_torch(weight)
    return y if out is None else out.copy_(y)


def _subpixel_weights_torch(weight: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(weight.dtype, torch.float32)
    rows = _fold_taps(weight.detach().to(acc), 2)  # [a, co, ci, kh, 3]
    w = _fold_taps(rows, 4)  # [b, a, co, ci, kh, kw]
    return w.permute(1, 0, 2, 4, 5, 3).to(weight.dtype).contiguous()


# Output parity (a, b) of the folded upsample: its 2x2 weight in the
# kernels' layout, the F.pad-order padding of the source it reads, and the
# output (or residual) elements it covers. One place for this geometry,
# read by ops.upsample_conv2d and dispatch.upsample_conv alike.
PARITIES = ((0, 0), (0, 1), (1, 0), (1, 1))


def parity_weight(subs: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return subs[a, b].permute(0, 3, 1, 2)


def parity_padding(a: int, b: int) -> tuple:
    return (1 - b, b, 1 - a, a)


def parity_view(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[:, :, a::2, b::2]
