"""Depthwise convolution (groups == channels, one filter a channel) over a
channels-last input: ``out[n, oh, ow, c] = sum_{kh, kw} x[n, oh*sh - ph +
kh*dh, ow*sw - pw + kw*dw, c] * w[c, kh, kw] (+ bias[c])``, zero padding.

Why: cuDNN's NHWC depthwise kernel ran Sana DC-AE's 5x5 ``proj_in`` far
below the memory bandwidth the work needs, a few multiply-adds per element
loaded (docs/performance.md, thirty-first session).
Here a program takes a block of output positions by a block of channels and
walks the taps: each tap's loads are rows of contiguous channels, and the
neighbouring taps' rows come from L1/L2.

Layer 1: ``depthwise_kernel``, grid (samples x position blocks, channel
blocks); kernel size, stride, padding and dilation are runtime arguments.
Layer 2: ``launch_depthwise``.

Numerics: fp32 accumulation, rounded once to the output's dtype.
"""

import triton
import triton.language as tl

from .common import DEPTHWISE_EXTENTS
from .launch import cdiv, launch, needs_int64


@triton.jit(do_not_specialize=DEPTHWISE_EXTENTS)
def depthwise_kernel(x_ptr, w_ptr, b_ptr, out_ptr, C, H, W, OH, OW, P_TILES, KH, KW, sh, sw, ph, pw, dh, dw,
                     sxn, sxh, sxw, son, soh, sow, HAS_BIAS: tl.constexpr, IDX64: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    n = pid // P_TILES
    offs_p = (pid - n * P_TILES) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = offs_p < OH * OW
    c_ok = offs_c < C
    oh = offs_p // OW
    ow = offs_p - oh * OW
    if IDX64:
        n = n.to(tl.int64)
    x_n = x_ptr + n * sxn
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for kh in range(0, KH):
        ih = oh * sh - ph + kh * dh
        h_ok = p_ok & (ih >= 0) & (ih < H)
        for kw in range(0, KW):
            iw = ow * sw - pw + kw * dw
            ok = h_ok & (iw >= 0) & (iw < W)
            pos = ih * sxh + iw * sxw
            if IDX64:
                pos = ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw
            xv = tl.load(x_n + pos[:, None] + offs_c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
            wv = tl.load(w_ptr + offs_c * (KH * KW) + kh * KW + kw, mask=c_ok, other=0.0)
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    opos = oh * soh + ow * sow
    if IDX64:
        opos = oh.to(tl.int64) * soh + ow.to(tl.int64) * sow
    out = out_ptr + n * son + opos[:, None] + offs_c[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])


def launch_depthwise(x, w, bias, out, *, stride, padding, dilation, block_p=64, block_c=64, num_warps=4):
    """``out`` [N, C, OH, OW] (channels dense, any other strides) = the
    depthwise conv of ``x`` [N, C, H, W] (channels dense) by ``w`` [C, 1, KH,
    KW] (contiguous), + ``bias`` [C] or None. Returns ``out``."""
    N, C, H, W = x.shape
    KH, KW = w.shape[2], w.shape[3]
    OH, OW = out.shape[2], out.shape[3]
    p_tiles = cdiv(OH * OW, block_p)
    launch(depthwise_kernel, (N * p_tiles, cdiv(C, block_c)), x, w, w if bias is None else bias, out,
           C, H, W, OH, OW, p_tiles, KH, KW, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
           x.stride(0), x.stride(2), x.stride(3), out.stride(0), out.stride(2), out.stride(3),
           HAS_BIAS=bias is not None, IDX64=needs_int64(x, out), BLOCK_P=block_p, BLOCK_C=block_c,
           num_warps=num_warps)
    return out
