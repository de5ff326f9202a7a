"""Attention with a wide head: two GEMM kernels with the softmax folded
into them, for Hopper (TMA tensor descriptors feeding wgmma) and the
interpreter.

Why: the VAE mid-block attention has one head of 512 channels, wider than
FlashAttention's and cuDNN's limit (256), and a 512-wide fp32 output
accumulator does not fit one program's registers, so the scores are
materialised. ``softmax.py``'s route writes them in fp32 (cuBLAS), reads
them twice to normalise and writes the probabilities again: at 65536 tokens
(a 2048^2 decode) ~68 GB of traffic around 8.8 TFLOP of GEMMs, 26-28 ms on
the H200 (bench/results/attention-*.json). Here the scores are written once
and read once, in the input dtype:

  * ``attention_scores_kernel``: a [BLOCK_M, BLOCK_N] tile of ``S = scale *
    Q K^T`` and, in its epilogue, the tile's row maxima ``m_t``, ``E =
    exp(S - m_t)`` (values in (0, 1], rounded once to the input dtype, as
    FlashAttention rounds its probabilities for the second GEMM) and the
    tile's fp32 row sums ``l_t``.
  * ``attention_combine_kernel``: per row, ``M = max_t m_t`` and ``L =
    sum_t l_t exp(m_t - M)``; each tile's weight ``w_t = exp(m_t - M) / L``
    replaces ``m_t`` (a few MB, a few microseconds).
  * ``attention_pv_kernel``: ``O = sum_t w_t (E_t V_t)``, one score tile per
    K step, so E feeds the MMA from shared memory as it arrived and the
    weight scales each step's fp32 product. (Scaling E in registers before
    the MMA instead ran at 150-200 TF/s on the H200, against 420.) Where a
    block's output tiles would leave most of the GPU idle (few query rows
    per block: the rows are bounded by the scores' bytes, so at a million
    keys a block holds 512 rows, 16 output tiles), the keys are split
    among programs (``pv_splits``) whose fp32 partial outputs are summed.

Layer 1: the kernels; layer 2: ``launch_attention_block`` (descriptors,
grids); the torch-facing layer is ``conv_patch.functional.attention``.
"""

import triton
import triton.language as tl

from .common import ATTENTION_EXTENTS, grouped_tile
from .launch import cdiv, launch, sm_count

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=ATTENTION_EXTENTS)
def attention_scores_kernel(q_desc, k_desc, e_desc, mx_ptr, sm_ptr, R, M, D, stride_p, scale_log2,
                            UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    num_pid_n = tl.cdiv(M, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(R, BLOCK_M), num_pid_n, GROUP_M)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Columns of D past its end are TMA zeros in both operands.
    for k0 in range(0, D, BLOCK_K):
        a = q_desc.load([row0, k0])
        b = k_desc.load([col0, k0])
        if UPCAST:
            # The interpreter's tl.dot is wrong on bf16 operands (Triton
            # 3.4-3.9); on hardware this branch is compiled out.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
    cols = col0 + tl.arange(0, BLOCK_N)
    # Keys past M read TMA zeros, i.e. scores of 0, which must not count.
    s = tl.where((cols < M)[None, :], acc * scale_log2, float("-inf"))
    # Every tile holds at least one real key, so the maximum is finite.
    m_t = tl.max(s, axis=1)
    e = tl.exp2(s - m_t[:, None])
    e_desc.store([row0, col0], e.to(e_desc.dtype))
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = rows < R
    part = pid_n * stride_p + rows
    tl.store(mx_ptr + part, m_t, mask=ok)
    tl.store(sm_ptr + part, tl.sum(e, axis=1), mask=ok)


@triton.jit(do_not_specialize=ATTENTION_EXTENTS)
def attention_combine_kernel(mx_ptr, sm_ptr, R, T, stride_p, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row maximum M and sum L from a block of rows' partials, then each
    tile's weight ``exp(m_t - M) / L`` written over ``m_t``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    m_row = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        at = (t0 + tl.arange(0, BLOCK_T))[:, None]
        msk = (at < T) & ok[None, :]
        m_row = tl.maximum(m_row, tl.max(tl.load(mx_ptr + at * stride_p + rows[None, :], mask=msk,
                                                 other=float("-inf")), 0))
    # Rows past R hold no partials; 0 keeps their (unstored) arithmetic finite.
    m_row = tl.where(ok, m_row, 0.0)
    l_row = tl.zeros((BLOCK_R,), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        at = (t0 + tl.arange(0, BLOCK_T))[:, None]
        msk = (at < T) & ok[None, :]
        m_t = tl.load(mx_ptr + at * stride_p + rows[None, :], mask=msk, other=float("-inf"))
        l_row += tl.sum(tl.load(sm_ptr + at * stride_p + rows[None, :], mask=msk, other=0.0)
                        * tl.exp2(m_t - m_row[None, :]), 0)
    inv = 1.0 / tl.where(ok, l_row, 1.0)
    for t0 in range(0, T, BLOCK_T):
        at = (t0 + tl.arange(0, BLOCK_T))[:, None]
        msk = (at < T) & ok[None, :]
        m_t = tl.load(mx_ptr + at * stride_p + rows[None, :], mask=msk, other=float("-inf"))
        tl.store(mx_ptr + at * stride_p + rows[None, :], tl.exp2(m_t - m_row[None, :]) * inv[None, :], mask=msk)


@triton.jit(do_not_specialize=ATTENTION_EXTENTS)
def attention_pv_kernel(e_desc, v_desc, w_ptr, out_ptr, R, M, DV, stride_p, so_r, so_c, so_s, split_steps,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    # The output-column blocks of one row block run side by side, so the
    # score rows they all read come from L2 after the first.
    num_pid_n = tl.cdiv(DV, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    # Axis 1: this program's share of the keys, ``split_steps`` score tiles
    # (all of them where the keys are not split), written at ``so_s``.
    split = tl.program_id(1)
    k_lo = split * split_steps * BLOCK_K
    k_hi = tl.minimum(M, k_lo + split_steps * BLOCK_K)
    row0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = rows < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A K block is one score tile (BLOCK_K is the scores' BLOCK_N), so E
    # goes from shared memory straight into the MMA and the tile's weight
    # scales the product. The next tile's weights are loaded one step ahead:
    # an L2 round trip on every step would stall the MMA. E's columns and
    # V's rows past M are TMA zeros.
    w_next = tl.load(w_ptr + (k_lo // BLOCK_K) * stride_p + rows, mask=ok, other=0.0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = w_next
        # The last step reads the next tile's row (the partials' spare row
        # after the last tile): unused, in bounds.
        w_next = tl.load(w_ptr + (k0 // BLOCK_K + 1) * stride_p + rows, mask=ok, other=0.0)
        p = e_desc.load([row0, k0])
        v = v_desc.load([k0, n0])
        if UPCAST:
            # The interpreter's tl.dot is wrong on bf16 operands (Triton
            # 3.4-3.9); on hardware this branch is compiled out.
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc += tl.dot(p, v) * w[:, None]
    cols = n0 + tl.arange(0, BLOCK_N)
    dst = out_ptr + split.to(tl.int64) * so_s + rows.to(tl.int64)[:, None] * so_r + cols[None, :] * so_c
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (cols < DV)[None, :])


def tiles(config):
    """(scores BLOCK_M, BLOCK_N, BLOCK_K), (pv BLOCK_M, BLOCK_N); the pv K
    block is the score tile's width."""
    s = config["scores"]
    p = config["pv"]
    return (int(s["BLOCK_M"]), int(s["BLOCK_N"]), int(s["BLOCK_K"])), (int(p["BLOCK_M"]), int(p["BLOCK_N"]))


def partial_columns(m, config):
    """Rows of the partials for ``m`` keys: one per score tile, plus a spare
    one that the pv kernel's read-ahead touches after the last tile."""
    return cdiv(m, tiles(config)[0][1]) + 1


# Keys are split among P V programs only where a block's output tiles fill
# less than this fraction of the SMs (a 2048^2 FLUX decode's 65536-key
# blocks, 256 tiles, and a 512^2 one's 128, are not split: the partial sum
# would add launches to host-bound calls), into at most two programs per SM
# and at least PV_MIN_SPLIT_STEPS score tiles each.
PV_SPLIT_BELOW = 0.5
PV_MIN_SPLIT_STEPS = 16


def pv_splits(r, dv, m, config, sms):
    """How many programs share each P V output tile's keys (1: unsplit) for
    ``r`` query rows, ``dv`` output channels and ``m`` keys on ``sms`` SMs
    (None: unknown, unsplit)."""
    (_, sbn, _), (pbm, pbn) = tiles(config)
    t = cdiv(r, pbm) * cdiv(dv, pbn)
    if not sms or t >= PV_SPLIT_BELOW * sms:
        return 1
    return max(1, min(cdiv(2 * sms, t), cdiv(m, sbn) // PV_MIN_SPLIT_STEPS))


def launch_attention_block(q, k, v, out, e, mx, sm, scale, config, upcast, splits=None):
    """``out = softmax(scale * q k^T) v`` for 2-D ``q`` [R, D], ``k`` [M, D],
    ``v`` [M, DV] (dense rows, TMA-aligned: 16-byte base and row stride) and
    ``out`` [R, DV] (any strides). ``e`` [>=R, >=M] is the score scratch, in
    V's dtype, with a 16-byte aligned row stride; ``mx`` and ``sm`` are fp32
    [partial_columns(M), >=R] scratch with one row stride (tile-major, so
    that a tile's per-row values are one contiguous run). ``splits``: the
    programs sharing each output tile's keys (default ``pv_splits`` on the
    device's SMs; 1 under the interpreter)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    R, D = q.shape
    M, DV = v.shape
    (sbm, sbn, sbk), (pbm, pbn) = tiles(config)
    T = cdiv(M, sbn)
    assert mx.stride() == sm.stride() and mx.shape[0] > T and mx.shape[1] >= R and e.shape[1] >= M
    assert e.dtype == v.dtype
    s_cfg, p_cfg = config["scores"], config["pv"]
    q_desc = TensorDescriptor(q, [R, D], [q.stride(0), 1], [sbm, sbk])
    k_desc = TensorDescriptor(k, [M, D], [k.stride(0), 1], [sbn, sbk])
    # The score scratch is described as R x M: the tile columns past M are
    # clipped on store and read back as TMA zeros.
    e_store = TensorDescriptor(e, [R, M], [e.stride(0), 1], [sbm, sbn])
    launch(attention_scores_kernel, (cdiv(R, sbm) * T,), q_desc, k_desc, e_store, mx, sm, R, M, D,
           mx.stride(0), float(scale) * LOG2E,
           UPCAST=bool(upcast), BLOCK_M=sbm, BLOCK_N=sbn, BLOCK_K=sbk, GROUP_M=int(s_cfg.get("GROUP_M", 8)),
           num_warps=int(s_cfg.get("num_warps", 4)), num_stages=int(s_cfg.get("num_stages", 3)))
    c_cfg = config["combine"]
    block_r = int(c_cfg["BLOCK_R"])
    launch(attention_combine_kernel, (cdiv(R, block_r),), mx, sm, R, T, mx.stride(0),
           BLOCK_R=block_r, BLOCK_T=int(c_cfg["BLOCK_T"]), num_warps=int(c_cfg.get("num_warps", 4)))
    e_load = TensorDescriptor(e, [R, M], [e.stride(0), 1], [pbm, sbn])
    v_desc = TensorDescriptor(v, [M, DV], [v.stride(0), 1], [sbn, pbn])
    if splits is None:
        splits = pv_splits(R, DV, M, config, sm_count(q.device) if q.is_cuda else None)
    steps = cdiv(T, splits)
    splits = cdiv(T, steps)  # (no program without keys)
    dst = out if splits == 1 else mx.new_empty((splits, R, DV))  # (fp32, as mx)
    launch(attention_pv_kernel, (cdiv(R, pbm) * cdiv(DV, pbn), splits), e_load, v_desc, mx, dst, R, M, DV,
           mx.stride(0), dst.stride(-2), dst.stride(-1), dst.stride(0) if splits > 1 else 0, steps,
           UPCAST=bool(upcast), BLOCK_M=pbm, BLOCK_N=pbn, BLOCK_K=sbn,
           num_warps=int(p_cfg.get("num_warps", 8)), num_stages=int(p_cfg.get("num_stages", 3)))
    if splits > 1:
        out.copy_(dst.sum(0))
    return out

