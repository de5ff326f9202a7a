"""conv_transpose2d forward as an implicit GEMM in the gather formulation.

Output pixel (oh, ow) gathers x[ih, iw] for every tap with
``oh = ih * stride - pad + kh * dil``. Programs are split by output phase
``((oh + pad) % stride_h, (ow + pad) % stride_w)`` (grid axis 1): within one
phase the set of contributing taps is the same for every row of the tile, so a
tap is either skipped as a whole (a scalar branch) or gathered with a plain
strided read, and no work is spent on the stride**2 - 1 taps that never land.

Layer 1 (``conv_transpose2d_fwd_kernel``) and layer 2 (``launch_conv_transpose2d``)
as in conv2d.py; the epilogue is the shared one.
"""

import triton
import triton.language as tl

from .common import BATCH_EXTENTS, accumulate_tap, epilogue_store, grouped_tile, wide
from .launch import cdiv, run_conv_kernel


@triton.jit(do_not_specialize=BATCH_EXTENTS)
def conv_transpose2d_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
    N, C_in, H, W, C_out, OH, OW,
    sxn, sxc, sxh, sxw,
    swo, swi, swh, sww,
    srn, src, srh, srw,
    son, soc, soh, sow,
    KH, KW, STH, STW, PH, PW, DH, DW,
    beta, out_scale,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    IDX64: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    phase = tl.program_id(1)
    ph = phase // STW
    pw = phase - ph * STW
    # First output row/column of this phase; the double modulo keeps it
    # non-negative whichever sign convention the backend's % uses.
    oh0 = ((ph - PH) % STH + STH) % STH
    ow0 = ((pw - PW) % STW + STW) % STW
    cnt_h = tl.maximum((OH - oh0 + STH - 1) // STH, 0)
    cnt_w = tl.maximum((OW - ow0 + STW - 1) // STW, 0)
    Mp = N * cnt_h * cnt_w
    # The grid is sized for the largest phase; smaller phases mask the rest.
    num_pid_m = tl.cdiv(N * tl.cdiv(OH, STH) * tl.cdiv(OW, STW), BLOCK_M)
    num_pid_n = tl.cdiv(C_out, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < Mp
    n_ok = offs_n < C_out
    cw = tl.maximum(cnt_w, 1)
    ch = tl.maximum(cnt_h, 1)
    jw = offs_m % cw
    t = offs_m // cw
    jh = t % ch
    n = wide(t // ch, IDX64)
    x_row = n * sxn
    w_col = offs_n * swo

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tap in range(0, KH * KW):
        kh = tap // KW
        kw = tap - kh * KW
        num_h = oh0 + PH - kh * DH
        num_w = ow0 + PW - kw * DW
        if (num_h % STH == 0) & (num_w % STW == 0):
            # Exact divisions: ih = (oh + pad - kh*dil) / stride.
            acc = accumulate_tap(acc, x_ptr, w_ptr, x_row, row_ok,
                                 jh + num_h // STH, jw + num_w // STW, H, W, C_in,
                                 sxc, sxh, sxw, kh * swh + kw * sww, swi, w_col, n_ok,
                                 IDX64, UPCAST, PRECISION, BLOCK_K)

    epilogue_store(acc, n, oh0 + jh * STH, ow0 + jw * STW, row_ok, offs_n, n_ok,
                   out_ptr, son, soc, soh, sow, bias_ptr, res_ptr, srn, src, srh, srw,
                   beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


def launch_conv_transpose2d(x, w, bias, out, residual, **kw):
    """``w`` is the weight viewed as [C_out, C_in, KH, KW] (the module's
    [C_in, C_out, KH, KW] transposed, or a pack); ``out`` has the full output
    shape, output_padding included."""
    sh, sw = kw["stride"]
    m_max = x.shape[0] * cdiv(out.shape[2], sh) * cdiv(out.shape[3], sw)
    c_out = w.shape[0]
    return run_conv_kernel(
        conv_transpose2d_fwd_kernel,
        lambda bm, bn: (cdiv(m_max, bm) * cdiv(c_out, bn), sh * sw),
        x, w, bias, out, residual, pixels=m_max // x.shape[0], **kw)
