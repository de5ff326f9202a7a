"""GroupNorm (+ activation) for dense NCHW and NHWC activations.

Why: in an eager FLUX-VAE decode on an H200, GroupNorm is 49 of 86 ms
(PyTorch's row-moments kernel alone 45 ms), for a tensor that takes a few
milliseconds to read at 4 TB/s. This is the building block the VAE block
recipes fuse around the convolutions.

Layer 1: ``group_norm_stats_kernel`` (NCHW: per (sample, group) partial
moments, split so that every SM has work even with 32 groups),
``group_norm_stats_nhwc_kernel`` (NHWC: per (sample, channel) partial moments
over pixel chunks, read in whole coalesced rows), ``group_norm_finalize_kernel``
(merges a group's partials into mean and rstd on the device) and
``group_norm_apply_kernel`` (normalise, affine, activation, in the input's
layout). Layer 2: ``launch_group_norm``.

Numerics: fp32 throughout, never a raw sum of squares (a large mean would
cancel the variance away): the NCHW programs accumulate (count, mean, M2)
block by block with Chan's parallel update, the NHWC programs sums shifted by
a sample of their chunk, and the finalize kernel Chan-merges the partials.
"""

import triton
import triton.language as tl

from ._common import activate
from ._launch import INT32_LIMIT, cdiv, next_pow2


@triton.jit
def group_norm_stats_kernel(x_ptr, part_ptr, GROUP_SIZE, CHUNK, SPLITS, BLOCK: tl.constexpr):
    # Dense NCHW: group (n, g) is one contiguous run of Cg*H*W elements
    # starting at ng * GROUP_SIZE; split into SPLITS chunks.
    ng = tl.program_id(0)
    s = tl.program_id(1)
    base = x_ptr + ng.to(tl.int64) * GROUP_SIZE
    start = s * CHUNK
    stop = tl.minimum(start + CHUNK, GROUP_SIZE)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for b0 in range(start, stop, BLOCK):
        idx = b0 + tl.arange(0, BLOCK)
        ok = idx < stop
        x = tl.load(base + idx, mask=ok, other=0.0).to(tl.float32)
        bn = tl.sum(ok.to(tl.float32), axis=0)
        bmean = tl.sum(x, axis=0) / bn
        d = tl.where(ok, x - bmean, 0.0)
        bm2 = tl.sum(d * d, axis=0)
        tot = count + bn
        delta = bmean - mean
        mean = mean + delta * (bn / tot)
        m2 = m2 + bm2 + delta * delta * (count * bn / tot)
        count = tot
    out = part_ptr + (ng * SPLITS + s) * 3
    tl.store(out, count)
    tl.store(out + 1, mean)
    tl.store(out + 2, m2)


@triton.jit
def group_norm_stats_nhwc_kernel(x_ptr, part_ptr, C, HW, CHUNK, SPLITS,
                                 BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # NHWC: a pixel's channels are contiguous, so a program reads whole rows
    # of C channels (coalesced) and keeps per-*channel* moments; walking one
    # group's Cg-channel slivers instead read 8-byte pieces of every 32-byte
    # sector and ran at ~0.2 TB/s on the H200. The loop only adds into
    # [BLOCK_P, BLOCK_C] registers (no cross-thread reduction per step):
    # sums of x - K and (x - K)^2 with K the chunk's first pixel, per
    # channel. With K a sample of the data, K - mean is a few standard
    # deviations at most, so the shifted second moment does not cancel the
    # variance away the way the raw sum of squares does for mean >> std.
    n = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    start = s * CHUNK
    stop = tl.minimum(start + CHUNK, HW)
    row = x_ptr + n * HW * C
    shift = tl.load(row + start * C + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    s1 = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for p0 in range(start, stop, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ok = (p < stop)[:, None] & c_ok[None, :]
        x = tl.load(row + p[:, None] * C + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
        d = tl.where(ok, x - shift[None, :], 0.0)
        s1 += d
        s2 += d * d
    count = (stop - start).to(tl.float32)
    t1 = tl.sum(s1, axis=0)
    mean = shift + t1 / count
    m2 = tl.maximum(tl.sum(s2, axis=0) - t1 * t1 / count, 0.0)
    out = part_ptr + ((n * SPLITS + s) * C + offs_c) * 3
    tl.store(out, tl.zeros((BLOCK_C,), dtype=tl.float32) + count, mask=c_ok)
    tl.store(out + 1, mean, mask=c_ok)
    tl.store(out + 2, m2, mask=c_ok)


@triton.jit
def group_norm_finalize_kernel(part_ptr, mean_ptr, rstd_ptr, G, S, SUB, psn, pss, psc, eps,
                               BLOCK: tl.constexpr):
    # One program per (sample, group): Chan-merges the group's S x SUB
    # partial (count, mean, M2) triples, at part + n*psn + s*pss + (g*SUB+j)*psc,
    # into mean and 1/sqrt(var + eps). On the device, so a GroupNorm is three
    # launches and no host-side torch ops.
    ng = tl.program_id(0)
    n = (ng // G).to(tl.int64)
    g = ng % G
    total = S * SUB
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for b0 in range(0, total, BLOCK):
        i = b0 + tl.arange(0, BLOCK)
        ok = i < total
        s = i // SUB
        j = i - s * SUB
        ptr = part_ptr + n * psn + s * pss + (g * SUB + j) * psc
        c = tl.load(ptr, mask=ok, other=0.0)
        m = tl.load(ptr + 1, mask=ok, other=0.0)
        q = tl.load(ptr + 2, mask=ok, other=0.0)
        bn = tl.sum(c, axis=0)
        bmean = tl.sum(c * m, axis=0) / tl.maximum(bn, 1.0)
        bm2 = tl.sum(q + c * (m - bmean) * (m - bmean), axis=0)
        tot = count + bn
        delta = bmean - mean
        mean = mean + delta * (bn / tl.maximum(tot, 1.0))
        m2 = m2 + bm2 + delta * delta * (count * bn / tl.maximum(tot, 1.0))
        count = tot
    tl.store(mean_ptr + ng, mean)
    tl.store(rstd_ptr + ng, 1.0 / tl.sqrt(m2 / count + eps))


@triton.jit
def group_norm_apply_kernel(x_ptr, y_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, total, C, HW, G, Cg,
                            HAS_AFFINE: tl.constexpr, ACT: tl.constexpr, CHANNELS_INNER: tl.constexpr,
                            IDX64: tl.constexpr, BLOCK: tl.constexpr):
    # Dense input and output of the same layout: one flat walk in memory order.
    # 32-bit index arithmetic where it fits: the per-element divisions are
    # several times dearer in 64 bits.
    if IDX64:
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < total
    if CHANNELS_INNER:
        c = idx % C
    else:
        c = (idx // HW) % C
    n = idx // (C * HW)
    stat = n * G + c // Cg
    x = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + stat, mask=ok, other=0.0)
    rstd = tl.load(rstd_ptr + stat, mask=ok, other=0.0)
    y = (x - mean) * rstd
    if HAS_AFFINE:
        y = y * tl.load(w_ptr + c, mask=ok, other=1.0).to(tl.float32) \
            + tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
    y = activate(y, ACT)
    tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=ok)


def launch_group_norm(x, out, groups, weight, bias, eps, activation, channels_last, block, stats_block,
                      target_programs):
    """``x``/``out`` dense [N, C, H, W] in the same layout (``channels_last``
    says which). Returns (mean, rstd) as [N, G] fp32, as PyTorch's native
    group norm does."""
    import torch

    N, C, H, W = x.shape
    Cg, HW = C // groups, H * W
    if channels_last:
        block_c = next_pow2(C)
        block_p = max(1, stats_block // block_c)
        # Chunks of at least 4 row blocks; enough programs to fill the GPU.
        splits = max(1, min(cdiv(HW, 4 * block_p), cdiv(target_programs, N)))
        chunk = cdiv(HW, splits)
        splits = cdiv(HW, chunk)
        part = torch.empty((N, splits, C, 3), dtype=torch.float32, device=x.device)
        group_norm_stats_nhwc_kernel[(N, splits)](x, part, C, HW, chunk, splits,
                                                  BLOCK_P=block_p, BLOCK_C=block_c)
        sub, psn, pss, psc = Cg, splits * C * 3, C * 3, 3
    else:
        # Enough programs to fill the GPU, each reading at least a few blocks.
        per_group = Cg * HW
        splits = max(1, min(cdiv(per_group, 4 * stats_block), cdiv(target_programs, N * groups)))
        chunk = cdiv(per_group, splits)
        splits = cdiv(per_group, chunk)
        part = torch.empty((N * groups, splits, 3), dtype=torch.float32, device=x.device)
        group_norm_stats_kernel[(N * groups, splits)](x, part, per_group, chunk, splits, BLOCK=stats_block)
        sub, psn, pss, psc = 1, groups * splits * 3, 3, splits * 3
    mean = torch.empty((N * groups,), dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    group_norm_finalize_kernel[(N * groups,)](part, mean, rstd, groups, splits, sub, psn, pss, psc,
                                              float(eps), BLOCK=min(1024, next_pow2(splits * sub)))
    numel = x.numel()
    group_norm_apply_kernel[(cdiv(numel, block),)](
        x, out, mean, rstd, weight if weight is not None else x, bias if bias is not None else x,
        numel, C, HW, groups, Cg, HAS_AFFINE=weight is not None, ACT=int(activation),
        CHANNELS_INNER=channels_last, IDX64=numel + block > INT32_LIMIT, BLOCK=block)
    return mean.view(N, groups), rstd.view(N, groups)


__all__ = ["group_norm_stats_kernel", "group_norm_stats_nhwc_kernel", "group_norm_finalize_kernel",
           "group_norm_apply_kernel", "launch_group_norm"]
