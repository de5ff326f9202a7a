"""Exact GroupNorm statistics over a tensor held as bands.

Each band contributes its (count, mean, M2) per (sample, group); bands are
merged with Chan's parallel update in float64. Only deviations from means
are ever squared, so the merged variance is exact for any data: a raw
sum / sum-of-squares would cancel the variance away where the mean is large
against the spread (a mean of 1e4 with unit spread loses every digit of the
variance in fp32 and most in fp64). The merge is the same function in one
process and across ranks (the ranks all-gather the per-band moments and
merge them in band order), so both see identical statistics.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from conv_patch.activations import activation_code
from conv_patch.specs import HALF_DTYPES, KERNEL_DTYPES


# Elements of a band converted at a time for its moments (32-64 MiB).
MOMENT_CHUNK = 8 << 20


def channel_moments(x: torch.Tensor):
    """(count, mean, M2) per (sample, channel) of ``x`` [N, C, h, W], float64.

    A few whole rows at a time (contiguous in NCHW and NHWC alike, so each
    chunk reads its own bytes only), converted to float32 for half-precision
    bands (which it holds exactly; PyTorch's own reduction would return a
    half-precision mean, 0.5 off at 100 in bf16) and to float64 for fp32
    bands (in fp32 the mean of values near 1e4 is off by ~1e-4 of a unit
    spread, which the normalised output would carry); PyTorch's Welford
    reduction per chunk, the chunks merged with Chan's update."""
    n, c, h, w = x.shape
    wide = torch.float32 if x.dtype in HALF_DTYPES else torch.float64
    rows = max(1, MOMENT_CHUNK // max(1, n * c * w))
    total = None
    for r0 in range(0, h, rows):
        part = x[:, :, r0:r0 + rows].to(wide)
        var, mean = torch.var_mean(part, dim=(2, 3), correction=0)
        cnt = float(part.shape[2] * w)
        mean = mean.double()
        piece = torch.stack([torch.full_like(mean, cnt), mean, var.double() * cnt])
        total = piece if total is None else merge([total, piece])
    return tuple(total)


def band_moments(x: torch.Tensor, groups: int, use_kernels: bool = False) -> torch.Tensor:
    """[3, N, G] float64 (count, mean, M2) of band ``x`` [N, C, h, W] per
    (sample, group): per-channel moments (``channel_moments``), then the
    group's channels merged (the same closed form as Chan's update).
    ``use_kernels``: a dense half-precision band on a device where the
    GroupNorm kernels run takes their statistics pass instead (one launch;
    the chunks above are a dozen PyTorch ops each, thousands of launches
    for a band of a 8192^2 layer), the same fp32 moments the un-banded
    GroupNorm kernel computes, merged here in float64."""
    n, c, h, w = x.shape
    cg = c // groups
    if x.numel() == 0:
        return torch.zeros(3, n, groups, dtype=torch.float64, device=x.device)
    if use_kernels:
        got = kernel_moments(x, groups)
        if got is not None:
            return got
    count, mean, m2 = channel_moments(x)
    count, mean, m2 = (t.view(n, groups, cg) for t in (count, mean, m2))
    gmean = mean.mean(dim=2)
    gm2 = m2.sum(dim=2) + (h * w) * ((mean - gmean.unsqueeze(2)) ** 2).sum(dim=2)
    return torch.stack([count.sum(dim=2), gmean, gm2])


def kernel_moments(x: torch.Tensor, groups: int) -> Optional[torch.Tensor]:
    """``band_moments`` from the GroupNorm kernels' statistics pass (its
    per-split fp32 partials Chan-merged in float64), or None where it does
    not run (not half precision, not dense NCHW/NHWC, no kernels here)."""
    here = group_norm_kernels(x, HALF_DTYPES)
    if here is None:
        return None
    k, nhwc, (_, stats_block, programs) = here
    n = x.shape[0]
    _, part, (psn, pss, psc) = k.launch_group_norm_partials(x, groups, nhwc, stats_block, programs)
    splits = part.numel() // (n * groups * 3)
    # [N, splits, G, (count, mean, M2)] at the strides the launcher laid them out at.
    p = part.as_strided((n, splits, groups, 3), (psn, pss, psc, 1)).double()
    cnt, mean, m2 = p.unbind(-1)
    tot = cnt.sum(dim=1)
    mu = (cnt * mean).sum(dim=1) / tot.clamp_min(1)
    return torch.stack([tot, mu, (m2 + cnt * (mean - mu.unsqueeze(1)) ** 2).sum(dim=1)])


def group_norm_kernels(x: torch.Tensor, dtypes) -> Optional[tuple]:
    """(the kernels module, whether ``x`` is NHWC, the GroupNorm launch
    sizes) where the GroupNorm kernels take band ``x`` (dense NCHW or NHWC,
    one of ``dtypes``, a device with kernels), else None."""
    nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    if x.dtype not in dtypes or not (nhwc or x.is_contiguous()):
        return None
    from conv_patch.ops.loader import kernels
    from conv_patch.ops.group_norm import launch_sizes
    from conv_patch.target import target_for
    target = target_for(x.device)
    if not target.kernels:
        return None
    return kernels(), nhwc, launch_sizes(target)


def merge(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The [3, N, G] moments of the union of bands whose moments are
    ``parts`` (Chan's pairwise update, left to right: the same order on
    every process)."""
    total = parts[0].clone()
    for p in parts[1:]:
        na, ma, m2a = total
        nb, mb, m2b = p
        n = na + nb
        delta = mb - ma
        frac = torch.where(n > 0, nb / n.clamp_min(1), torch.zeros_like(n))
        total = torch.stack([n, ma + delta * frac, m2a + m2b + delta * delta * na * frac])
    return total


class Affine:
    """A GroupNorm with the whole image's statistics, per (sample, channel):
    ``scale`` = rstd * weight, ``mean`` (+ ``mean_lo``), ``bias`` ([N, C]
    fp32 each) and
    ``ss`` ([N, C, 2]: scale and ``bias - mean * scale``, the form the
    GroupNorm kernels' apply pass reads)."""

    def __init__(self, scale, mean, bias):
        self.scale, self.bias = scale.float(), bias.float()
        # The mean as fp32 high and low parts: near 1e4 one fp32 is 1e-3 off
        # the mean, while x - high is exact for x near the mean (Sterbenz).
        self.mean = mean.float()
        self.mean_lo = (mean - self.mean.double()).float()
        self.ss = torch.stack([scale, bias - mean * scale], dim=-1).float().contiguous()


def scale_shift(moments: torch.Tensor, norm, channels: int) -> Affine:
    """The ``Affine`` of ``norm`` (its weight, bias and eps) with the
    statistics ``moments`` ([3, N, G])."""
    count, mean, m2 = moments
    rstd = torch.rsqrt(m2 / count.clamp_min(1) + norm.eps)
    cg = channels // norm.num_groups
    rstd = rstd.repeat_interleave(cg, dim=1)
    mean = mean.repeat_interleave(cg, dim=1)
    scale = rstd if norm.weight is None else rstd * norm.weight.detach().double()
    bias = torch.zeros_like(mean) if norm.bias is None else norm.bias.detach().double().expand_as(mean)
    return Affine(scale, mean, bias)


def normalise(x: torch.Tensor, aff: Affine, activation: str, use_kernels: bool,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``act((x - mean) * scale + bias)`` for a band (or band plus halo)
    ``x`` with the whole image's statistics: the GroupNorm kernels' apply
    pass where they run (``use_kernels``, a dense NCHW/NHWC band: one FMA
    per element, as in the unbanded kernels), else PyTorch ops in fp32 that
    subtract the mean first (a folded ``x * scale + shift`` cancels where the
    mean is large against the spread). Output in ``x``'s dtype and layout."""
    here = group_norm_kernels(x, KERNEL_DTYPES) if use_kernels else None
    if here is not None:
        k, nhwc, sizes = here
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=fmt)
        k.launch_group_norm_apply(x, out, aff.ss.to(x.device), activation_code(activation), nhwc, sizes[0])
        return out
    mean, lo, scale, bias = (t.to(x.device)[:, :, None, None] for t in (aff.mean, aff.mean_lo, aff.scale, aff.bias))
    y = torch.addcmul(bias, (x.float() - mean).sub_(lo), scale)
    if activation == "silu":
        y = F.silu(y, inplace=True)
    elif activation != "none":
        raise ValueError(f"normalise: activation {activation!r} is not one a VAE GroupNorm is followed by")
    y = y.to(x.dtype)
    return y if out is None else out.copy_(y)
