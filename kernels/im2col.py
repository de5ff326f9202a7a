"""conv2d as im2col + the Hopper TMA GEMM, the module's NCHW weight read in
place: no weight pack, so nothing is refreshed per call.

Layer 1 (``im2col_kernel``): the @triton.jit kernel writing the column
matrix. Layer 2 (``launch_im2col``, ``launch_conv2d_im2col``): the column
buffer, then the GEMM through ``conv2d_tma.launch_conv2d_tma``. The
torch-facing wrapper is ``conv_patch.functional``, shared with the other
kernels.

Why: the other TMA routes read the weight as [C_out, KH, KW, C_in] (each
tap's channel block one box), so an NCHW module weight is copied into a
pack at every call (conv_patch/runtime/pack.py says why a pack cannot be
trusted across calls). A UNet's deep convs have small images and large
weights (1280 -> 1280 3x3: 29.5 MB of weight against 1.3 MB of input at
2x16x16), so the copy costs more than the conv. Here the reduction runs in
the weight's own order, ``k = (ci*KH + kh)*KW + kw``: the NCHW weight is the
dense matrix [C_out, K] and the input is unfolded into ``col[n, k, p]``
(``p = oh*OW + ow``, K = C_in*KH*KW rows of the output's pixels), every
padding, stride and dilation resolved there. ``col`` viewed as the NCHW
tensor [N, K, 1, OH*OW] is then the input of a stride-1 1x1 conv, which the
TMA kernel boxes in place (its one-row, transposed NCHW path) and whose
output [N, C_out, 1, OH*OW] is the caller's [N, C_out, OH, OW]. The column
buffer costs K*OH*OW elements per image, written once and read once: small
where the input is (the route's table entries say where it pays).
"""

import triton
import triton.language as tl

from .common import IM2COL_EXTENTS
from .conv2d_tma import launch_conv2d_tma
from .launch import cdiv, empty, launch, needs_int64, next_pow2

# A program's tile of the column matrix: BLOCK_P pixels (a power of two from
# 64 to 256, no wider than the image's pixels need) by 4096 / BLOCK_P rows,
# stored along the pixels (coalesced, 16-byte vectors: the rows are 8
# elements apart at least), loaded along an input row where the stride is 1.
TILE_ELEMS = 4096
MIN_PIXELS, MAX_PIXELS = 64, 256
ROW_ALIGN = tl.constexpr(8)


@triton.jit(do_not_specialize=IM2COL_EXTENTS)
def im2col_kernel(x_ptr, col_ptr, K, L, P8, H, W, OW, sxn, sxc, sxh, sxw,
                  KH, KW, SH, SW, PH, PW, DH, DW,
                  IDX64: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr):
    """col[n, k, p] = x[n, ci, oh*SH - PH + kh*DH, ow*SW - PW + kw*DW], 0
    outside the image, for k = (ci*KH + kh)*KW + kw and p = oh*OW + ow < L;
    a row is ``ROW_ALIGN * P8`` elements apart from the next (its pitch, a
    multiple of 8 that the compiler sees: 16-byte stores), written up to the
    pitch (zeros past L)."""
    pid_p = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    P = P8 * ROW_ALIGN
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    taps = KH * KW
    ci = offs_k // taps
    t = offs_k - ci * taps
    kh = t // KW
    kw = t - kh * KW
    oh = offs_p // OW
    ow = offs_p - oh * OW
    ih = oh[None, :] * SH - PH + kh[:, None] * DH
    iw = ow[None, :] * SW - PW + kw[:, None] * DW
    inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    rows = offs_k < K
    if IDX64:
        src = ci[:, None].to(tl.int64) * sxc + ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw
        dst = offs_k[:, None].to(tl.int64) * P + offs_p[None, :]
    else:
        src = ci[:, None] * sxc + ih * sxh + iw * sxw
        dst = offs_k[:, None] * P + offs_p[None, :]
    v = tl.load(x_ptr + n * sxn + src, mask=inside & rows[:, None] & (offs_p < L)[None, :], other=0.0)
    tl.store(col_ptr + n * K * P + dst, v, mask=rows[:, None] & (offs_p < P)[None, :])


def launch_im2col(x, kh, kw, stride, padding, dilation, oh, ow):
    """The column matrix of ``x`` ([N, C, H, W], any strides): a
    [N, C*KH*KW, OH*OW] tensor whose rows are ``ROW_ALIGN``-element aligned
    (dense where OH*OW is a multiple of it, else a view of a pitched
    buffer) (``padding``: top and left; the bottom and right follow from OH
    and OW)."""
    n, c, h, w = x.shape
    k, l = c * kh * kw, oh * ow
    pitch = cdiv(l, ROW_ALIGN.value) * ROW_ALIGN.value
    col = empty((n, k, pitch), dtype=x.dtype, device=x.device)
    bp = min(MAX_PIXELS, max(MIN_PIXELS, next_pow2(pitch)))
    bk = TILE_ELEMS // bp
    grid = (cdiv(pitch, bp), cdiv(k, bk), n)
    launch(im2col_kernel, grid, x, col, k, l, pitch // ROW_ALIGN.value, h, w, ow, *x.stride(),
           kh, kw, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
           IDX64=bool(needs_int64(x, col)), BLOCK_K=bk, BLOCK_P=bp, num_warps=4)
    return col if pitch == l else col[:, :, :l]


def gemm_config(config, pixels):
    """The GEMM's tile: one pixel row of ``BLOCK_M`` (the TMA kernel reads
    the NCHW column matrix in place under one-row tiles only), no taller
    than the image's pixels rounded up to a power of two (the TMA unit
    clips the rest)."""
    bm = min(int(config["BLOCK_M"]), next_pow2(pixels))
    return dict(config, BLOCK_M=bm, BLOCK_W=bm, nchw_in_place=True)


def launch_conv2d_im2col(x, w, bias, out, residual, *, stride, padding, dilation, beta, activation,
                         out_scale, config, precision, upcast, force_int64=False):
    """Same call as the other launchers. ``x``: [N, C, H, W] in any strides;
    ``w``: the module's weight [C_out, C_in, KH, KW], dense (read in place
    as [C_out, K]); ``out`` (and ``residual``) viewable as [N, C_out, 1,
    OH*OW] (dense NCHW or NHWC); the route's rule
    (``registry.im2col_problem``) has checked the rest."""
    n = x.shape[0]
    c_out, c_in, kh, kw = w.shape
    oh, ow = out.shape[2], out.shape[3]
    col = launch_im2col(x, kh, kw, stride, padding, dilation, oh, ow)
    k, l = col.shape[1], col.shape[2]
    launch_conv2d_tma(col.view(n, k, 1, l), w.view(c_out, k, 1, 1), bias, out.view(n, c_out, 1, l),
                      None if residual is None else residual.reshape(n, c_out, 1, l),
                      stride=(1, 1), padding=(0, 0), dilation=(1, 1), beta=beta, activation=activation,
                      out_scale=out_scale, config=gemm_config(config, l), precision=precision, upcast=upcast,
                      force_int64=force_int64)
    return out
