"""conv2d with few input channels (C_in * KH * KW <= 64): the implicit GEMM
with its reduction over (c_in, kh, kw) flattened into one dimension.

Why: the tap-by-tap implicit GEMM reduces over C_in per tap in blocks of at
least 16 (tl.dot's minimum). A VAE encoder's conv_in (3 -> 128, 3x3) then
spends 9 dots of K = 16 on 27 useful products per output, and on an NHWC
image each tap's A tile is 3-element slivers of 6-byte pixels: 0.53 ms at
1024^2 on the H200 (0.35 reading NCHW), for a conv whose output write
alone is 0.06 ms. Flattened, K = 27 is one K = 32 block: each A element is
a gather of x[n, c, oh*s - p + kh*d, ow*s - p + kw*d], the weight is read
in place through its strides, and the tile ends in the shared epilogue.

Layer 1: ``conv2d_flat_kernel`` (the portable kernels' signature); layer 2:
``launch_conv2d_flat``. Any layout, stride, padding and dilation.
"""

import triton
import triton.language as tl

from .common import BATCH_EXTENTS, epilogue_store, mma, output_tile, wide
from .launch import cdiv, run_conv_kernel


@triton.jit(do_not_specialize=BATCH_EXTENTS)
def conv2d_flat_kernel(
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
    w_col = wide(offs_n, IDX64) * swo

    TAPS = KH * KW
    K = C_in * TAPS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        c = k // TAPS
        tap = k - c * TAPS
        kh = tap // KW
        kw = tap - kh * KW
        ih = ih0[:, None] + (kh * DH)[None, :]
        iw = iw0[:, None] + (kw * DW)[None, :]
        ok = row_ok[:, None] & k_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a = tl.load(x_ptr + x_row[:, None] + wide(c, IDX64)[None, :] * sxc + wide(ih, IDX64) * sxh
                    + wide(iw, IDX64) * sxw, mask=ok, other=0.0)
        w_k = wide(c, IDX64) * swi + wide(kh, IDX64) * swh + wide(kw, IDX64) * sww
        b = tl.load(w_ptr + w_k[:, None] + w_col[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST, PRECISION)

    epilogue_store(acc, n, oh, ow, row_ok, offs_n, n_ok,
                   out_ptr, son, soc, soh, sow, bias_ptr, res_ptr, srn, src, srh, srw,
                   beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


def launch_conv2d_flat(x, w, bias, out, residual, **kw):
    """Same call as ``launch_conv2d``; BLOCK_K is narrowed to C_in*KH*KW."""
    pixels = out.shape[2] * out.shape[3]
    M = x.shape[0] * pixels
    c_out = w.shape[0]
    return run_conv_kernel(
        conv2d_flat_kernel,
        lambda bm, bn: (cdiv(M, bm) * cdiv(c_out, bn),),
        x, w, bias, out, residual, pixels=pixels, reduction=w.shape[1] * w.shape[2] * w.shape[3], **kw)
