"""conv2d forward as an implicit GEMM (no im2col buffer), portable Triton.

Layer 1 (``conv2d_fwd_kernel``): the @triton.jit kernel.
Layer 2 (``launch_conv2d``): the grid; block clamping, index width and the
launch itself are shared in _launch.py. It takes the config chosen by the router
and never tunes at run time.
The torch-facing wrapper lives in ``conv_patch.functional``.
"""

import triton
import triton.language as tl

from .common import BATCH_EXTENTS, accumulate_tap, epilogue_store, output_tile
from .launch import cdiv, run_conv_kernel


@triton.jit(do_not_specialize=BATCH_EXTENTS)
def conv2d_fwd_kernel(
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
    row_ok, n, oh, ow, offs_n, n_ok = output_tile(N, OH, OW, C_out, BLOCK_M, BLOCK_N, GROUP_M, IDX64)
    ih0 = oh * STH - PH
    iw0 = ow * STW - PW
    x_row = n * sxn
    w_col = offs_n * swo

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tap in range(0, KH * KW):
        kh = tap // KW
        kw = tap - kh * KW
        acc = accumulate_tap(acc, x_ptr, w_ptr, x_row, row_ok,
                             ih0 + kh * DH, iw0 + kw * DW, H, W, C_in,
                             sxc, sxh, sxw, kh * swh + kw * sww, swi, w_col, n_ok,
                             IDX64, UPCAST, PRECISION, BLOCK_K)

    epilogue_store(acc, n, oh, ow, row_ok, offs_n, n_ok,
                   out_ptr, son, soc, soh, sow, bias_ptr, res_ptr, srn, src, srh, srw,
                   beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


def launch_conv2d(x, w, bias, out, residual, **kw):
    """``w`` is the [C_out, C_in, KH, KW] weight (the module's own or a pack;
    only the strides differ)."""
    pixels = out.shape[2] * out.shape[3]
    M = x.shape[0] * pixels
    c_out = w.shape[0]
    return run_conv_kernel(
        conv2d_fwd_kernel,
        lambda bm, bn: (cdiv(M, bm) * cdiv(c_out, bn),),
        x, w, bias, out, residual, pixels=pixels, **kw)
