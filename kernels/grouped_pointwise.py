"""Grouped 1x1 convolution over channels-last rows: ``out[m, g*Co + o] =
sum_c x[m, g*Ci + c] * w[g*Co + o, c] (+ bias)``, every group at once.

Why: cuDNN runs a grouped 1x1 conv on NHWC tensors as one small GEMM per
group, each with a slicing kernel in front: in Sana's DC-AE decoder (its
multiscale attention's ``proj_out``, 32-channel groups) that is thousands
of small launches a decode (docs/performance.md, thirty-first session).
Here one launch covers every group: a program multiplies a block of rows
by one group's weight.

Layer 1: ``grouped_pointwise_kernel``, grid (row blocks, groups x column
blocks); the rows are an [M, C] view with any row stride (an NHWC tensor's
positions), the weight [C_out, C_in / groups] with any row stride. Layer 2:
``launch_grouped_pointwise``.

Numerics: fp32 accumulation (TF32 for fp32 operands where PyTorch allows
it, as the implicit-GEMM kernels), rounded once to the output's dtype.
"""

import triton
import triton.language as tl

from .common import GROUPED_POINTWISE_EXTENTS, mma
from .launch import cdiv, launch, needs_int64, next_pow2, MIN_DOT_BLOCK


@triton.jit(do_not_specialize=GROUPED_POINTWISE_EXTENTS)
def grouped_pointwise_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, CG_IN, CG_OUT, N_TILES, sxm, swo, som,
                             HAS_BIAS: tl.constexpr, IDX64: tl.constexpr, UPCAST: tl.constexpr,
                             PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_gn = tl.program_id(1)
    g = pid_gn // N_TILES
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_gn - g * N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < CG_OUT
    if IDX64:
        offs_m = offs_m.to(tl.int64)
    cols = g * CG_OUT + offs_n
    x_row = x_ptr + offs_m[:, None] * sxm + g * CG_IN
    w_col = w_ptr + cols[None, :] * swo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, CG_IN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < CG_IN
        a = tl.load(x_row + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_col + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST, PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * som + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tiles(cg_in: int, cg_out: int, block_m: int) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for groups of ``cg_in`` -> ``cg_out``
    channels: one group's columns (up to 128) and reduction (up to 64) a step."""
    block_n = min(128, max(MIN_DOT_BLOCK, next_pow2(cg_out)))
    block_k = min(64, max(MIN_DOT_BLOCK, next_pow2(cg_in)))
    return block_m, block_n, block_k


def launch_grouped_pointwise(x, w, bias, out, groups, *, precision, upcast, block_m=128, num_warps=4):
    """``out`` [M, C_out] = the grouped 1x1 conv of ``x`` [M, C_in] by ``w``
    [C_out, C_in / groups] (+ ``bias`` [C_out] or None); rows and weight
    rows with any stride, channels dense. Returns ``out``."""
    M, c_in = x.shape
    c_out = w.shape[0]
    cg_in, cg_out = c_in // groups, c_out // groups
    bm, bn, bk = tiles(cg_in, cg_out, block_m)
    n_tiles = cdiv(cg_out, bn)
    launch(grouped_pointwise_kernel, (cdiv(M, bm), groups * n_tiles), x, w, w if bias is None else bias, out,
           M, cg_in, cg_out, n_tiles, x.stride(0), w.stride(0), out.stride(0),
           HAS_BIAS=bias is not None, IDX64=needs_int64(x, out), UPCAST=bool(upcast), PRECISION=precision,
           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps)
    return out
