"""GroupNorm (+ activation) for dense NCHW and NHWC activations.

Why: in an eager FLUX-VAE decode on an H200, GroupNorm is 49 of 86 ms
(PyTorch's row-moments kernel alone 45 ms), for a tensor that takes a few
milliseconds to read at 4 TB/s. This is the building block the VAE block
recipes fuse around the convolutions.

Layer 1: ``group_norm_stats_kernel`` (NCHW: per (sample, group) partial
moments, split so that every SM has work even with 32 groups),
``group_norm_stats_nhwc_kernel`` (NHWC: per-channel moments over pixel
chunks, read in whole coalesced rows, merged per group before they are
written), ``group_norm_finalize_kernel``
(merges a group's partials into mean and rstd on the device, and folds them
with the affine into a per-(sample, channel) scale and shift) and
``group_norm_apply_{nhwc,nchw}_kernel`` (one FMA and the activation per
element, in the input's layout). Layer 2: ``launch_group_norm`` (both
passes), ``launch_group_norm_stats`` and ``launch_group_norm_apply`` (apart,
for a caller that normalises a tensor piece by piece), and
``launch_group_norm_partials`` (the statistics pass's raw per-split moments,
for a caller that merges them across tensors: the row bands of
``conv_patch.parallel``).

Numerics: fp32 throughout, never a raw sum of squares (a large mean would
cancel the variance away): the NCHW programs accumulate (count, mean, M2)
block by block with Chan's parallel update, the NHWC programs a Welford
(mean, M2) per register slot, merged per channel and group with Chan's
formula, and the finalize kernel Chan-merges the partials; one pair of
helpers (``merge_moments``, ``combine_moments``) for all of them.
"""

import triton
import triton.language as tl

from .common import GROUP_NORM_FINALIZE_EXTENTS, GROUP_NORM_NHWC_EXTENTS, activate
from .launch import cdiv, empty, launch, next_pow2


@triton.jit
def merge_moments(n, mean, m2, axis: tl.constexpr):
    # (count, mean, M2) of the union of partials laid along ``axis`` (counts
    # n, means, M2s): Chan's merge in closed form, M2 = sum of M2_i +
    # sum of n_i * (mean_i - mean)^2. Only deviations from means are
    # squared, so it is exact for any data (a raw sum of squares cancels the
    # variance away where mean >> std). A partial of count 0 adds nothing.
    tot = tl.sum(n, axis=axis)
    mu = tl.sum(n * mean, axis=axis) / tl.maximum(tot, 1.0)
    d = mean - tl.expand_dims(mu, axis)
    return tot, mu, tl.sum(m2 + n * d * d, axis=axis)


@triton.jit
def combine_moments(count, mean, m2, bn, bmean, bm2):
    # Chan's pairwise update: the moments of a union from its two parts'.
    tot = count + bn
    delta = bmean - mean
    frac = bn / tl.maximum(tot, 1.0)
    return tot, mean + delta * frac, m2 + bm2 + delta * delta * (count * frac)


@triton.jit
def group_norm_stats_kernel(x_ptr, part_ptr, GROUP_SIZE, CHUNK, SPLITS, BLOCK: tl.constexpr):
    # Dense NCHW: group (n, g) is one contiguous run of Cg*H*W elements
    # starting at ng * GROUP_SIZE; split into SPLITS chunks. Each block's
    # moments (its elements as partials of count 1) are merged into the
    # program's running (count, mean, M2).
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
        bn, bmean, bm2 = merge_moments(ok.to(tl.float32), x, 0.0, 0)
        count, mean, m2 = combine_moments(count, mean, m2, bn, bmean, bm2)
    out = part_ptr + (ng * SPLITS + s) * 3
    tl.store(out, count)
    tl.store(out + 1, mean)
    tl.store(out + 2, m2)


@triton.jit(do_not_specialize=GROUP_NORM_NHWC_EXTENTS)
def group_norm_stats_nhwc_kernel(x_ptr, ib_ptr, part_ptr, C, HW, CHUNK, SPLITS, G, Cg,
                                 BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr,
                                 BLOCK_R: tl.constexpr, CG_POW2: tl.constexpr, HAS_IB: tl.constexpr):
    # NHWC: a pixel's channels are contiguous, so a program reads whole rows
    # of C channels (coalesced) and keeps per-*channel* moments; walking one
    # group's Cg-channel slivers instead read 8-byte pieces of every 32-byte
    # sector and ran at ~0.2 TB/s on the H200. The loop keeps a Welford
    # (mean, M2) per register slot of [BLOCK_P, BLOCK_C], element-wise (no
    # cross-thread reduction per step): slot (r, c) sees pixel r of each
    # row block, channel c, so after k blocks every slot still reading has
    # count k. Exact for any data, unlike sums shifted by a sample of the
    # chunk (an outlier as that sample cancelled the variance away). The
    # slots then merge per channel, and the channels per group, with Chan's
    # formula.
    n = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    start = s * CHUNK
    stop = tl.minimum(start + CHUNK, HW)
    row = x_ptr + n * HW * C
    mean = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    rows = tl.arange(0, BLOCK_P)
    for p0 in range(start, stop, BLOCK_P):
        p = p0 + rows
        ok = (p < stop)[:, None] & c_ok[None, :]
        # Pixel offsets in int64: a 4096^2 image of 128 channels has 2^31
        # elements, past int32 (the decode crashed on an illegal address).
        x = tl.load(row + p.to(tl.int64)[:, None] * C + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / ((p0 - start) // BLOCK_P + 1).to(tl.float32)
        d = tl.where(ok, x - mean, 0.0)
        mean += d * inv
        m2 += d * (x - mean)  # zero where masked: d is
    # Slot r read ceil((stop - start - r) / BLOCK_P) pixels. The slots
    # merge in two levels, BLOCK_R at a time, then those: an outlier's M2 is
    # not the running sum every other slot is added to one by one (the
    # interpreter reduces in order, where small terms fell below its ulp).
    per_row = ((tl.maximum(stop - start - rows, 0) + BLOCK_P - 1) // BLOCK_P).to(tl.float32)
    slots = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32) + per_row[:, None]
    shape3: tl.constexpr = (BLOCK_P // BLOCK_R, BLOCK_R, BLOCK_C)
    n_r, mean_r, m2_r = merge_moments(tl.reshape(slots, shape3), tl.reshape(mean, shape3),
                                      tl.reshape(m2, shape3), 1)
    count, mean_c, m2_c = merge_moments(n_r, mean_r, m2_r, 0)
    if HAS_IB:
        # x is a conv output whose bias was left for this norm to add (see
        # ops.group_norm's input_bias): it moves each channel's mean, not its
        # spread, so it enters here, before channels merge into groups.
        mean_c += tl.load(ib_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    # The group's moments from its channels' (equal counts). One triple per
    # group instead of per channel: the finalize pass then merges SPLITS
    # partials per group, not SPLITS * Cg (at Cg = 16 and ~1000 splits that
    # merge was a latency-bound 15 us per GroupNorm).
    offs_g = tl.arange(0, BLOCK_G)
    if CG_POW2 > 0:
        # Cg a power of two: channel c is row c // Cg of a [BLOCK_G, Cg]
        # view (rows past G are padding channels, never stored).
        g_n, g_mean, g_m2 = merge_moments(tl.reshape(count, (BLOCK_G, CG_POW2)),
                                          tl.reshape(mean_c, (BLOCK_G, CG_POW2)),
                                          tl.reshape(m2_c, (BLOCK_G, CG_POW2)), 1)
    else:
        # Any other Cg: a [BLOCK_G, BLOCK_C] membership mask (register-
        # hungry at 32 x 512, which is why the view above exists).
        member = ((offs_c[None, :] // Cg) == offs_g[:, None]) & c_ok[None, :]
        g_n, g_mean, g_m2 = merge_moments(tl.where(member, count[None, :], 0.0),
                                          tl.where(member, mean_c[None, :], 0.0),
                                          tl.where(member, m2_c[None, :], 0.0), 1)
    g_ok = offs_g < G
    out = part_ptr + ((n * SPLITS + s) * G + offs_g) * 3
    tl.store(out, g_n, mask=g_ok)
    tl.store(out + 1, g_mean, mask=g_ok)
    tl.store(out + 2, g_m2, mask=g_ok)


@triton.jit(do_not_specialize=GROUP_NORM_FINALIZE_EXTENTS)
def group_norm_finalize_kernel(part_ptr, w_ptr, b_ptr, ib_ptr, ss_ptr, G, Cg, S,
                               psn, pss, psc, eps, HAS_AFFINE: tl.constexpr, HAS_IB: tl.constexpr,
                               BLOCK: tl.constexpr, BLOCK_CG: tl.constexpr):
    # One program per (sample, group): Chan-merges the group's S partial
    # (count, mean, M2) triples, at part + n*psn + s*pss + g*psc, into mean
    # and 1/sqrt(var + eps), folded with the affine into the apply pass's
    # scale and shift. On the device, so a GroupNorm is three launches and
    # one allocation.
    ng = tl.program_id(0)
    n = (ng // G).to(tl.int64)
    g = ng % G
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for b0 in range(0, S, BLOCK):
        s = b0 + tl.arange(0, BLOCK)
        ok = s < S
        ptr = part_ptr + n * psn + s * pss + g * psc
        c = tl.load(ptr, mask=ok, other=0.0)
        m = tl.load(ptr + 1, mask=ok, other=0.0)
        q = tl.load(ptr + 2, mask=ok, other=0.0)
        bn, bmean, bm2 = merge_moments(c, m, q, 0)
        count, mean, m2 = combine_moments(count, mean, m2, bn, bmean, bm2)
    rstd = 1.0 / tl.sqrt(m2 / count + eps)
    # The apply pass's per-(sample, channel) affine: y = x * scale + shift.
    c = g * Cg + tl.arange(0, BLOCK_CG)
    c_ok = tl.arange(0, BLOCK_CG) < Cg
    scale = tl.zeros((BLOCK_CG,), dtype=tl.float32) + rstd
    shift = -mean * scale
    if HAS_AFFINE:
        gamma = tl.load(w_ptr + c, mask=c_ok, other=1.0).to(tl.float32)
        scale = scale * gamma
        shift = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32) - mean * scale
    if HAS_IB:
        # The apply pass reads x without the input bias: (x + b) * scale + shift.
        shift += tl.load(ib_ptr + c, mask=c_ok, other=0.0).to(tl.float32) * scale
    row = ss_ptr + (n * (G * Cg) + c) * 2
    tl.store(row, scale, mask=c_ok)
    tl.store(row + 1, shift, mask=c_ok)


@triton.jit
def modulate(v, m_ptr, a_ptr, offs, ok, HAS_MOD: tl.constexpr):
    """``v * m + a`` where ``HAS_MOD`` (a spatially modulated norm, such as
    CogVideoX's spatial norm: tensors of ``x``'s shape and layout at
    ``offs``), else ``v``."""
    if HAS_MOD:
        v = v * tl.load(m_ptr + offs, mask=ok, other=0.0).to(tl.float32) \
            + tl.load(a_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return v


@triton.jit(do_not_specialize=GROUP_NORM_NHWC_EXTENTS)
def group_norm_apply_nhwc_kernel(x_ptr, y_ptr, ss_ptr, m_ptr, a_ptr, C, HW, TILES, ACT: tl.constexpr,
                                 HAS_MOD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # A [BLOCK_P pixels, C] slab of one sample: the per-channel scale and
    # shift are loaded once per program, then one FMA and the activation per
    # element (a flat walk with per-element index divisions and four gathers
    # ran at ~1.9 TB/s on the H200).
    pid = tl.program_id(0)
    n = pid // TILES
    p = (pid - n * TILES) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    scale = tl.load(ss_ptr + (n * C + offs_c) * 2, mask=c_ok, other=0.0)
    shift = tl.load(ss_ptr + (n * C + offs_c) * 2 + 1, mask=c_ok, other=0.0)
    ok = (p < HW)[:, None] & c_ok[None, :]
    offs = (n.to(tl.int64) * HW + p[:, None]) * C + offs_c[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    # Masked lanes are zeroed first: x * scale + shift of a padding lane can
    # be far negative, and the activation's exp would overflow there.
    v = modulate(x * scale[None, :] + shift[None, :], m_ptr, a_ptr, offs, ok, HAS_MOD)
    y = activate(tl.where(ok, v, 0.0), ACT)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def group_norm_apply_nchw_kernel(x_ptr, y_ptr, ss_ptr, m_ptr, a_ptr, HW, ACT: tl.constexpr,
                                 HAS_MOD: tl.constexpr, BLOCK: tl.constexpr):
    # Row (n, c) of HW contiguous elements, one scale/shift pair per program.
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < HW
    scale = tl.load(ss_ptr + row * 2)
    shift = tl.load(ss_ptr + row * 2 + 1)
    offs = row.to(tl.int64) * HW + idx
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = activate(tl.where(ok, modulate(x * scale + shift, m_ptr, a_ptr, offs, ok, HAS_MOD), 0.0), ACT)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


# The partials the finalize pass merges a step: fixed, not sized to the
# split count, which moves with the batch and resolution (a tile of its own
# would compile the pass again for each); it loops over more.
FINALIZE_BLOCK = 256


def launch_group_norm(x, out, groups, weight, bias, eps, activation, channels_last, block, stats_block,
                      target_programs, input_bias=None, modulation=None):
    """``x``/``out`` dense [N, C, H, W] in the same layout (``channels_last``
    says which; ``out`` may be ``x``: the apply pass reads each element
    before writing it, after the statistics are complete). Returns ``out``.
    ``input_bias`` ([C], NHWC only): normalise ``x + input_bias``."""
    scale_shift = launch_group_norm_stats(x, groups, weight, bias, eps, channels_last, stats_block,
                                          target_programs, input_bias)
    return launch_group_norm_apply(x, out, scale_shift, activation, channels_last, block, modulation)


def nhwc_stats_split(N, C, HW, stats_block, target_programs):
    """(BLOCK_P, splits, chunk) of the NHWC statistics pass: programs per
    sample and the pixels each reads (chunk ``s`` starts at ``s * chunk``)."""
    block_p = max(1, stats_block // next_pow2(C))
    # Chunks of at least 4 row blocks; enough programs to fill the GPU.
    splits = max(1, min(cdiv(HW, 4 * block_p), cdiv(target_programs, N)))
    chunk = cdiv(HW, splits)
    return block_p, cdiv(HW, chunk), chunk


def launch_group_norm_partials(x, groups, channels_last, stats_block, target_programs, input_bias=None,
                               extra=0):
    """The statistics pass alone over dense [N, C, H, W] ``x`` (plus
    ``input_bias`` [C] per channel, NHWC only): per (sample, split, group)
    fp32 (count, mean, M2) partials. Returns (workspace, partials, (psn, pss,
    psc)): ``partials`` is the workspace past its first ``extra`` floats (a
    caller's own result shares the allocation), its triples at
    ``n * psn + s * pss + g * psc``."""
    import torch

    if input_bias is not None and not channels_last:
        raise ValueError("group_norm: input_bias is only taken with NHWC input")
    N, C, H, W = x.shape
    Cg, HW = C // groups, H * W
    # One allocation for the partials and the caller's result: each
    # torch.empty is microseconds of host time, and a decode runs ~30
    # GroupNorms.
    if channels_last:
        block_c = next_pow2(C)
        block_p, splits, chunk = nhwc_stats_split(N, C, HW, stats_block, target_programs)
        ws = empty(extra + N * splits * groups * 3, dtype=torch.float32, device=x.device)
        part = ws[extra:]
        pow2 = Cg & (Cg - 1) == 0
        launch(group_norm_stats_nhwc_kernel, (N, splits), x, x if input_bias is None else input_bias, part,
               C, HW, chunk, splits, groups, Cg,
               BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_G=block_c // Cg if pow2 else next_pow2(groups),
               BLOCK_R=min(block_p, 32), CG_POW2=Cg if pow2 else 0, HAS_IB=input_bias is not None)
        return ws, part, (splits * groups * 3, groups * 3, 3)
    # Enough programs to fill the GPU, each reading at least a few blocks.
    per_group = Cg * HW
    splits = max(1, min(cdiv(per_group, 4 * stats_block), cdiv(target_programs, N * groups)))
    chunk = cdiv(per_group, splits)
    splits = cdiv(per_group, chunk)
    ws = empty(extra + N * groups * splits * 3, dtype=torch.float32, device=x.device)
    part = ws[extra:]
    launch(group_norm_stats_kernel, (N * groups, splits), x, part, per_group, chunk, splits, BLOCK=stats_block)
    return ws, part, (groups * splits * 3, 3, splits * 3)


def launch_group_norm_stats(x, groups, weight, bias, eps, channels_last, stats_block, target_programs,
                            input_bias=None):
    """Statistics of dense [N, C, H, W] ``x`` (plus ``input_bias`` [C] per
    channel, NHWC only), as the apply pass's per-(sample, channel) fp32
    (scale, shift) [N, C, 2]."""
    N, C = x.shape[:2]
    ws, part, (psn, pss, psc) = launch_group_norm_partials(x, groups, channels_last, stats_block, target_programs,
                                                          input_bias, extra=N * C * 2)
    splits = part.numel() // (N * groups * 3)
    Cg = C // groups
    scale_shift = ws[:N * C * 2].view(N, C, 2)
    launch(group_norm_finalize_kernel, (N * groups,),
           part, weight if weight is not None else x, bias if bias is not None else x,
           input_bias if input_bias is not None else x, scale_shift,
           groups, Cg, splits, psn, pss, psc, float(eps), HAS_AFFINE=weight is not None,
           HAS_IB=input_bias is not None, BLOCK=FINALIZE_BLOCK, BLOCK_CG=next_pow2(Cg))
    return scale_shift


def launch_group_norm_apply(x, out, scale_shift, activation, channels_last, block, modulation=None):
    """``out = act(x * scale + shift)`` per (sample, channel) for dense
    [N, C, H, W] ``x`` and ``out`` in one layout; ``scale_shift`` [N, C, 2].
    ``modulation`` (m, a), dense tensors of ``x``'s shape and layout:
    ``out = act((x * scale + shift) * m + a)``."""
    N, C, H, W = x.shape
    HW = H * W
    m, a = modulation if modulation is not None else (x, x)
    if channels_last:
        block_c = next_pow2(C)
        block_p = max(1, block // block_c)
        tiles = cdiv(HW, block_p)
        launch(group_norm_apply_nhwc_kernel, (N * tiles,), x, out, scale_shift, m, a, C, HW, tiles,
               ACT=int(activation), HAS_MOD=modulation is not None, BLOCK_P=block_p, BLOCK_C=block_c)
    else:
        launch(group_norm_apply_nchw_kernel, (N * C, cdiv(HW, block)), x, out, scale_shift, m, a, HW,
               ACT=int(activation), HAS_MOD=modulation is not None, BLOCK=block)
    return out
