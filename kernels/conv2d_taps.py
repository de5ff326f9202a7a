"""conv2d with few output channels (C_out * KH * KW <= 64): one GEMM of every
input pixel against all taps' weights, then a pass that sums each output
pixel's taps.

Why: an implicit GEMM with N = C_out = 3 (a VAE's conv_out) runs a 16-wide
column tile for 3 columns and re-reads each input pixel once per tap: at
128 -> 3 on 1024^2 that is 9 x 256 MB through L2, 0.33 ms on the H200 for
what cuDNN also needs 0.34 ms, against 0.06 ms to read the input once.
Here the input is read once, by the portable kernel as a 1x1 conv whose
N = C_out * KH * KW outputs are every tap's contribution (P, fp32, one
plane per output channel and tap; the weight pack co,kh,kw,ci viewed as
[C_out * KH * KW, C_in] is exactly that GEMM's B operand, no copy), and
``conv2d_tap_sum_kernel`` gathers out[n, co, oh, ow] = sum over taps of
P[n, co*KH*KW + tap, ih, iw] (zero outside the input: the padding) and ends
in the shared epilogue. P is fp32, so the only rounding to the output dtype
is the epilogue's, as in the implicit GEMM.

Layer 1: ``conv2d_tap_sum_kernel``; layer 2: ``launch_conv2d_taps`` (both
stages; the first takes the table's config, the second is memory-bound
and takes a fixed block).
"""

import triton
import triton.language as tl

from .common import epilogue_store, wide
from .launch import cdiv, empty, launch, needs_int64, next_pow2
from .conv2d import launch_conv2d


@triton.jit
def conv2d_tap_sum_kernel(p_ptr, bias_ptr, res_ptr, out_ptr, C_out, H, W, OH, OW, TILES,
                          spn, spc, sph, spw, srn, src, srh, srw, son, soc, soh, sow,
                          KH, KW, STH, STW, PH, PW, DH, DW, beta, out_scale,
                          HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                          IDX64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    n = pid // TILES
    m = (pid - n * TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < OH * OW
    oh = m // OW
    ow = m - oh * OW
    co = tl.arange(0, BLOCK_N)
    co_ok = co < C_out
    n = wide(n, IDX64)
    taps = KH * KW
    ch = wide(co * taps, IDX64) * spc
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tap in range(0, taps):
        kh = tap // KW
        kw = tap - kh * KW
        ih = oh * STH - PH + kh * DH
        iw = ow * STW - PW + kw * DW
        ok = row_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        row = n * spn + wide(ih, IDX64) * sph + wide(iw, IDX64) * spw + tap * spc
        acc += tl.load(p_ptr + row[:, None] + ch[None, :], mask=ok[:, None] & co_ok[None, :], other=0.0)
    epilogue_store(acc, n, oh, ow, row_ok, co, co_ok, out_ptr, son, soc, soh, sow, bias_ptr, res_ptr,
                   srn, src, srh, srw, beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


def launch_conv2d_taps(x, w, bias, out, residual, *, stride, padding, dilation, beta, activation,
                       out_scale, config, precision, upcast, force_int64=False, block=512):
    """Same call as the other conv launchers (``w`` the [C_out, C_in, KH, KW]
    view); ``block`` output pixels per tap-sum program."""
    import torch

    N, C_in, H, W = x.shape
    C_out, _, KH, KW = w.shape
    taps = C_out * KH * KW
    # [C_out*KH*KW, C_in, 1, 1]: a view of a co,kh,kw,ci-dense weight.
    w1 = w.permute(0, 2, 3, 1).reshape(taps, C_in)[:, :, None, None]
    # One plane per (co, tap): the tap-sum program then reads each tap's
    # partials along a row of pixels, coalesced. Rows of C_out*KH*KW partials
    # per pixel (channels_last) made those reads 4-byte gathers at a 108-byte
    # stride: on the H200 at 128 -> 3 on 1024^2 the whole conv took 0.43 ms
    # that way and 0.23 ms with planes, side by side; bench.layers then
    # measured 0.14 ms against cuDNN's 0.335
    # (bench/results/layers-sm90-taps-planar-h200-2026-11-30.json).
    p = empty((N, taps, H, W), dtype=torch.float32, device=x.device)
    launch_conv2d(x, w1, None, p, None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), beta=1.0,
                  activation=0, out_scale=1.0, config=config, precision=precision, upcast=upcast,
                  force_int64=force_int64)
    OH, OW = out.shape[2], out.shape[3]
    tiles = cdiv(OH * OW, block)
    res = residual if residual is not None else out
    launch(conv2d_tap_sum_kernel, (N * tiles,),
           p, bias if bias is not None else out, res, out, C_out, H, W, OH, OW, tiles,
           *p.stride(), *res.stride(), *out.stride(),
           KH, KW, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
           float(beta), float(out_scale),
           HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=int(activation),
           IDX64=bool(force_int64 or needs_int64(p, out, residual)), BLOCK_M=block,
           BLOCK_N=next_pow2(C_out))
    return out
