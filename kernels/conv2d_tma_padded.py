"""conv2d forward for Hopper (sm90) over a zero-bordered NHWC copy: every
tap's operand is one 2-D TMA box, whatever the image width.

Layer 1 (``conv2d_tma_padded_kernel``): the @triton.jit kernel. Layer 2
(``launch_conv2d_tma_padded``): the padded staging copy (kernels/layout.py),
the descriptors, the grid. The torch-facing wrapper is
``conv_patch.functional``, shared with the other kernels.

Why a second TMA kernel: ``conv2d_tma`` boxes the input as [1, BH, BW, BK]
of the 4-D tensor, so its zero fill is the padding, but a tile of several
pixel rows (any tile of an image narrower than BLOCK_M pixels: a UNet's
64x64, 32x32 and 16x16 levels) is reshaped in registers before wgmma reads
it (Triton 3.6), an ldmatrix round trip and a CTA barrier every K step.
Here the caller's input (NCHW or NHWC) is first copied into an NHWC buffer
with the padding written as zeros, [N, Hp, Wp, C] with Hp = PT + H + PB and
Wp = PL + W + PR, and described as the 2-D matrix [N*Hp*Wp, C]. GEMM row
``q`` is the padded pixel ``(n, r, c)``; output pixel ``(n, oh, ow)`` is
row ``(n*Hp + oh)*Wp + ow``, and tap ``(kh, kw)`` reads row
``q + kh*DH*Wp + kw*DW``: one [BLOCK_M, BLOCK_K] box per tap and channel
block, any BLOCK_M, straight from shared memory into wgmma. Rows whose
``r >= OH`` or ``c >= OW`` (the border, ``(Hp*Wp)/(OH*OW)`` of the work: 6%
at 64x64, 13% at 32x32, 27% at 16x16) are computed and not stored. The
padded copy costs one pass over the input, which an NCHW caller pays for
the NHWC staging copy anyway.

The weight pack ([C_out, KH, KW, C_in]) is the 2-D matrix [C_out, KH*KW*C_in]
with box [BN, BK] at (n0, tap*C_in + c0): a channel block that runs past
C_in reads the next tap's weights, against the input's zero-filled columns
past C, so it adds nothing.

``BLOCK_N2`` splits a tile's output channels in two blocks (two
accumulators fed by one input box) so a tile covers 160 = 128 + 32 or
320 = 256 + 64 channels: a UNet's 320/640/1280 channels without padding a
third of a 128-wide block. ``PERSISTENT``: a grid of one program per SM
walks the tiles.

Stride 1 only (the launcher's caller checks it: ``registry.tma_padded_problem``).
"""

import triton
import triton.language as tl

from .common import TMA_PADDED_EXTENTS, epilogue_store, grouped_tile, wide
from .launch import MIN_DOT_BLOCK, cdiv, launch, needs_int64, sm_count, split_block_sizes
from .layout import launch_pad_nhwc


@triton.jit
def padded_tile(tile, x_desc, w_desc, w2_desc, bias_ptr, res_ptr, out_ptr,
                N, C_in, HP, WP, C_out, OH, OW, srn, src, srh, srw, son, soc, soh, sow,
                KH, KW, DH, DW, beta, out_scale,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                IDX64: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr, SPLIT_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    TILE_N: tl.constexpr = BLOCK_N + BLOCK_N2 * SPLIT_N
    rows = N * HP * WP
    pid_m, pid_n = grouped_tile(tile, tl.cdiv(rows, BLOCK_M), tl.cdiv(C_out, TILE_N), GROUP_M)
    q0 = pid_m * BLOCK_M
    n0 = pid_n * TILE_N
    k_blocks = tl.cdiv(C_in, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
    for it in range(0, KH * KW * k_blocks):
        tap = it // k_blocks
        c0 = (it - tap * k_blocks) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        a = x_desc.load([q0 + kh * DH * WP + kw * DW, c0])
        b = w_desc.load([n0, tap * C_in + c0])
        if UPCAST:
            # The interpreter's tl.dot is wrong on bf16 operands (Triton
            # 3.4-3.9); on hardware this branch is compiled out.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
        if SPLIT_N:
            b2 = w2_desc.load([n0 + BLOCK_N, tap * C_in + c0])
            if UPCAST:
                b2 = b2.to(tl.float32)
            acc2 = tl.dot(a, tl.trans(b2), acc2)

    q = q0 + tl.arange(0, BLOCK_M)
    n = q // (HP * WP)
    rem = q - n * (HP * WP)
    oh = rem // WP
    ow = rem - oh * WP
    row_ok = (n < N) & (oh < OH) & (ow < OW)
    n = wide(n, IDX64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    epilogue_store(acc, n, oh, ow, row_ok, offs_n, offs_n < C_out,
                   out_ptr, son, soc, soh, sow, bias_ptr, res_ptr, srn, src, srh, srw,
                   beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)
    if SPLIT_N:
        offs_n2 = n0 + BLOCK_N + tl.arange(0, BLOCK_N2)
        epilogue_store(acc2, n, oh, ow, row_ok, offs_n2, offs_n2 < C_out,
                       out_ptr, son, soc, soh, sow, bias_ptr, res_ptr, srn, src, srh, srw,
                       beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


@triton.jit(do_not_specialize=TMA_PADDED_EXTENTS)
def conv2d_tma_padded_kernel(
    x_desc, w_desc, w2_desc, bias_ptr, res_ptr, out_ptr,
    N, C_in, HP, WP, C_out, OH, OW,
    srn, src, srh, srw,
    son, soc, soh, sow,
    KH, KW, DH, DW,
    beta, out_scale,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    IDX64: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr, SPLIT_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
):
    if PERSISTENT:
        TILE_N: tl.constexpr = BLOCK_N + BLOCK_N2 * SPLIT_N
        tiles = tl.cdiv(N * HP * WP, BLOCK_M) * tl.cdiv(C_out, TILE_N)
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            padded_tile(tile, x_desc, w_desc, w2_desc, bias_ptr, res_ptr, out_ptr,
                        N, C_in, HP, WP, C_out, OH, OW, srn, src, srh, srw, son, soc, soh, sow,
                        KH, KW, DH, DW, beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64, UPCAST,
                        BLOCK_M, BLOCK_N, BLOCK_N2, SPLIT_N, BLOCK_K, GROUP_M)
    else:
        padded_tile(tl.program_id(0), x_desc, w_desc, w2_desc, bias_ptr, res_ptr, out_ptr,
                    N, C_in, HP, WP, C_out, OH, OW, srn, src, srh, srw, son, soc, soh, sow,
                    KH, KW, DH, DW, beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64, UPCAST,
                    BLOCK_M, BLOCK_N, BLOCK_N2, SPLIT_N, BLOCK_K, GROUP_M)


def launch_conv2d_tma_padded(x, w, bias, out, residual, *, stride, padding, dilation, beta, activation,
                             out_scale, config, precision, upcast, force_int64=False):
    """Same call as the other launchers. ``x``: [N, C, H, W] in any
    strides; ``padding`` the (top, left) padding (the bottom and right ones
    follow from ``out``'s size: stride 1, the router's rule); ``w`` the
    [C_out, C_in, KH, KW] view of a co,kh,kw,ci-dense pack."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    N, C_in, H, W = x.shape
    C_out, _, KH, KW = w.shape
    OH, OW = out.shape[2], out.shape[3]
    pt, pl = padding
    pb = OH + dilation[0] * (KH - 1) - H - pt
    pr = OW + dilation[1] * (KW - 1) - W - pl
    xp = launch_pad_nhwc(x, pt, pb, pl, pr)
    HP, WP = xp.shape[1], xp.shape[2]
    bm, bn, bn2, bk = split_block_sizes(config, C_in, C_out)
    warps = int(config.get("num_warps", 4))
    x_desc = TensorDescriptor(xp, [N * HP * WP, C_in], [C_in, 1], [bm, bk])
    w_desc = TensorDescriptor(w, [C_out, KH * KW * C_in], [w.stride(0), 1], [bn, bk])
    w2_desc = TensorDescriptor(w, [C_out, KH * KW * C_in], [w.stride(0), 1], [bn2, bk]) if bn2 else w_desc
    res = residual if residual is not None else out
    tile_n = bn + bn2
    tiles = cdiv(N * HP * WP, bm) * cdiv(C_out, tile_n)
    per_sm = int(config.get("persistent", 0))
    grid = (min(tiles, per_sm * sm_count(x.device)) if per_sm else tiles,)
    launch(conv2d_tma_padded_kernel, grid,
           x_desc, w_desc, w2_desc, bias if bias is not None else out, res, out,
           N, C_in, HP, WP, C_out, OH, OW,
           *res.stride(), *out.stride(),
           KH, KW, dilation[0], dilation[1],
           float(beta), float(out_scale),
           HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=int(activation),
           IDX64=bool(force_int64 or needs_int64(out, residual, xp)), UPCAST=bool(upcast),
           BLOCK_M=bm, BLOCK_N=bn, BLOCK_N2=bn2 or MIN_DOT_BLOCK, SPLIT_N=bn2 > 0, BLOCK_K=bk,
           GROUP_M=int(config.get("GROUP_M", 8)), PERSISTENT=per_sm > 0,
           num_warps=warps, num_stages=int(config.get("num_stages", 3)))
    return out
