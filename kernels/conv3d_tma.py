"""conv3d forward for Hopper (sm90): TMA tensor descriptors feeding wgmma.

Layer 1 (``conv3d_tma_kernel``): the @triton.jit kernel.
Layer 2 (``launch_conv3d_tma``): the descriptors, the grid and the launch;
``conv_patch.routing.registry.conv3d_tma_problem`` says which calls it
takes (dense NDHWC input and cached frames, 16-byte aligned channel rows,
H and W at stride 1): the descriptors' strides are derived from the
shapes. The torch-facing function
is ``conv_patch.functional.conv3d``, shared with the portable kernel.

Design (the 2-D TMA kernel's, kernels/conv2d_tma.py, one axis up):
  * An output tile is ``BLOCK_H x BLOCK_W`` pixels of one output frame
    ``(n, ot)`` times ``BLOCK_N`` output channels, so every time tap of the
    tile reads one input frame, ``t = ot * ST - PT + kt * DT`` (any time
    stride and dilation; H and W at stride 1).
  * The input is described as the 5-D [N, T, H, W, C] of a dense NDHWC
    tensor with box [1, 1, BH, BW, BK]: boxes over a spatial edge, and the
    frames before the first and after the last, are zero-filled by the TMA
    unit, which *is* the zero padding.
  * A causal conv's cached frames are a second descriptor of the same
    shape over the cache: frame ``t < Tc`` is the cache's, ``t >= Tc`` the
    input's at ``t - Tc``; the concatenation is never written. The taps of
    the cached frames are one pipelined loop over (time tap, spatial tap,
    channel block), the input's another; a frame that is all padding costs
    nothing.
  * The weight ([C_out, C_in, KT, KH, KW] in channels_last_3d, i.e. dense
    [C_out, KT, KH, KW, C_in]) is described as [C_out, KT*KH*KW, C_in] with
    box [BN, 1, BK]: a channel block past C_in reads TMA zeros.
  * A tile's output channels may be split in two power-of-two blocks
    (``BLOCK_N2``: 96 = 64 + 32, 192 = 128 + 64), two accumulators fed
    from the same input box, a second weight descriptor for the second:
    every output channel in one tile, no MMA work past C_out.
  * The epilogue is the shared pointer epilogue (``epilogue_store``) at the
    output frame's base, in whatever layout the output has.
"""

import triton
import triton.language as tl

from .common import TMA_3D_EXTENTS, epilogue_store, grouped_tile, wide
from .launch import MIN_DOT_BLOCK, cdiv, launch, needs_int64, next_pow2, split_block_sizes



@triton.jit
def time_taps(base, lo, hi, KT, DT):
    """The time taps ``[ka, kb)`` whose input frame ``base + kt * DT`` lies
    in ``[lo, hi)``: a contiguous run, since frames grow with the tap."""
    ka = (tl.maximum(lo - base, 0) + DT - 1) // DT
    kb = tl.minimum((tl.maximum(hi - base, 0) + DT - 1) // DT, KT)
    return ka, tl.maximum(kb, ka)


@triton.jit
def frames_reduction(acc, acc2, desc, t0, n, base, ka, kb, oh0, ow0, n0, w_desc, w2_desc, C_in, KH, KW, PH, PW,
                     DT, DH, DW, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_N2: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += time taps ``[ka, kb)`` (input frame ``base + kt * DT``, which
    is frame ``- t0`` of ``desc``) over every spatial tap and channel block,
    as one flat loop: the pipeliner keeps loads in flight across taps and
    frames, with no drain between them. Under SPLIT_N, ``acc2`` takes the
    next BLOCK_N2 output channels from the same input box."""
    k_blocks = tl.cdiv(C_in, BLOCK_K)
    per_frame = KH * KW * k_blocks
    for it in range(0, (kb - ka) * per_frame):
        f = it // per_frame
        r = it - f * per_frame
        tap = r // k_blocks
        c0 = (r - tap * k_blocks) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        kt = ka + f
        a = tl.reshape(desc.load([n, base + kt * DT - t0, oh0 - PH + kh * DH, ow0 - PW + kw * DW, c0]),
                       (BLOCK_M, BLOCK_K))
        b = tl.reshape(w_desc.load([n0, kt * KH * KW + tap, c0]), (BLOCK_N, BLOCK_K))
        if UPCAST:
            # The interpreter's tl.dot is wrong on bf16 operands; compiled out on hardware.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
        if SPLIT_N:
            b2 = tl.reshape(w2_desc.load([n0 + BLOCK_N, kt * KH * KW + tap, c0]), (BLOCK_N2, BLOCK_K))
            if UPCAST:
                b2 = b2.to(tl.float32)
            acc2 = tl.dot(a, tl.trans(b2), acc2)
    return acc, acc2


@triton.jit(do_not_specialize=TMA_3D_EXTENTS)
def conv3d_tma_kernel(
    x_desc, c_desc, w_desc, w2_desc, bias_ptr, res_ptr, out_ptr,
    N, C_in, T, H, W, Tc, C_out, OD, OH, OW,
    srn, src, srt, srh, srw,
    son, soc, sot, soh, sow,
    KT, KH, KW, ST, PT, PH, PW, DT, DH, DW,
    beta, out_scale,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_CACHE: tl.constexpr, ACT: tl.constexpr,
    IDX64: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr, SPLIT_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, GROUP_M: tl.constexpr,
):
    BLOCK_H: tl.constexpr = BLOCK_M // BLOCK_W
    # A tile's output channels: BLOCK_N, and under SPLIT_N BLOCK_N2 more
    # (96 = 64 + 32: no MMA work on channels past C_out, one input box read).
    TILE_N: tl.constexpr = BLOCK_N + BLOCK_N2 * SPLIT_N
    tiles_w = tl.cdiv(OW, BLOCK_W)
    tiles_h = tl.cdiv(OH, BLOCK_H)
    pid_m, pid_n = grouped_tile(tl.program_id(0), N * OD * tiles_h * tiles_w, tl.cdiv(C_out, TILE_N), GROUP_M)
    ow0 = (pid_m % tiles_w) * BLOCK_W
    r = pid_m // tiles_w
    oh0 = (r % tiles_h) * BLOCK_H
    r = r // tiles_h
    ot = r % OD
    n = r // OD
    n0 = pid_n * TILE_N

    # Time tap kt reads frame base + kt * DT of [cache | input]: the cached
    # frames' taps come first, the input's after, each one flat loop; the
    # padding frames before and after are skipped.
    base = ot * ST - PT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
    if HAS_CACHE:
        ka, kb = time_taps(base, 0, Tc, KT, DT)
        acc, acc2 = frames_reduction(acc, acc2, c_desc, 0, n, base, ka, kb, oh0, ow0, n0, w_desc, w2_desc, C_in,
                                     KH, KW, PH, PW, DT, DH, DW, UPCAST, BLOCK_M, BLOCK_N, BLOCK_N2, SPLIT_N,
                                     BLOCK_K)
    ka, kb = time_taps(base, Tc, Tc + T, KT, DT)
    acc, acc2 = frames_reduction(acc, acc2, x_desc, Tc, n, base, ka, kb, oh0, ow0, n0, w_desc, w2_desc, C_in,
                                 KH, KW, PH, PW, DT, DH, DW, UPCAST, BLOCK_M, BLOCK_N, BLOCK_N2, SPLIT_N, BLOCK_K)

    offs = tl.arange(0, BLOCK_M)
    oh = oh0 + offs // BLOCK_W
    ow = ow0 + offs % BLOCK_W
    offs_n = n0 + tl.arange(0, BLOCK_N)
    frame = wide(ot, IDX64)
    nn = wide(n, IDX64)
    pix_ok = (oh < OH) & (ow < OW)
    epilogue_store(acc, nn, oh, ow, pix_ok, offs_n, offs_n < C_out,
                   out_ptr + frame * sot, son, soc, soh, sow, bias_ptr, res_ptr + frame * srt, srn, src, srh, srw,
                   beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)
    if SPLIT_N:
        offs_n2 = n0 + BLOCK_N + tl.arange(0, BLOCK_N2)
        epilogue_store(acc2, nn, oh, ow, pix_ok, offs_n2, offs_n2 < C_out,
                       out_ptr + frame * sot, son, soc, soh, sow, bias_ptr, res_ptr + frame * srt, srn, src, srh,
                       srw, beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


def tile_sizes(config, c_in, c_out, ow):
    """The table's tile narrowed to the problem (BLOCK_M stays: wgmma wants
    M >= 64; BLOCK_W shrinks to the frame's width): (BLOCK_M, BLOCK_N,
    BLOCK_N2, BLOCK_K, BLOCK_W), BLOCK_N2 0 where the tile's output channels
    are not split (none asked, or BLOCK_N alone covers C_out)."""
    bm, bn, bn2, bk = split_block_sizes(config, c_in, c_out)
    bw = min(int(config.get("BLOCK_W", 16)), next_pow2(ow), bm)
    return bm, bn, bn2, bk, bw


def launch_conv3d_tma(x, cache, w, bias, out, residual, *, stride, padding, dilation, beta, activation,
                      out_scale, config, precision, upcast, force_int64=False):
    """The portable launcher's call (kernels/conv3d.py) for the calls
    the registry's rule lets through (``w`` dense [C_out, KT, KH, KW, C_in]:
    ``runtime.pack.route_weight``); ``precision`` is unused (wgmma
    takes fp16/bf16 only)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    N, C_in, T, H, W = x.shape
    C_out, _, KT, KH, KW = w.shape
    OD, OH, OW = out.shape[2:]
    bm, bn, bn2, bk, bw = tile_sizes(config, C_in, C_out, OW)
    bh = bm // bw

    def frames(t):
        return TensorDescriptor(t, [t.shape[0], t.shape[2], H, W, C_in],
                                [t.shape[2] * H * W * C_in, H * W * C_in, W * C_in, C_in, 1], [1, 1, bh, bw, bk])
    x_desc = frames(x)
    c_desc = frames(cache) if cache is not None else x_desc
    taps = KT * KH * KW
    w_desc = TensorDescriptor(w, [C_out, taps, C_in], [taps * C_in, C_in, 1], [bn, 1, bk])
    w2_desc = TensorDescriptor(w, [C_out, taps, C_in], [taps * C_in, C_in, 1], [bn2, 1, bk]) if bn2 else w_desc
    res = residual if residual is not None else out
    grid = (N * OD * cdiv(OH, bh) * cdiv(OW, bw) * cdiv(C_out, bn + bn2),)
    launch(conv3d_tma_kernel, grid,
        x_desc, c_desc, w_desc, w2_desc, bias if bias is not None else out, res, out,
        N, C_in, T, H, W, 0 if cache is None else cache.shape[2], C_out, OD, OH, OW,
        *res.stride(), *out.stride(),
        KT, KH, KW, stride[0], *padding, *dilation,
        float(beta), float(out_scale),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_CACHE=cache is not None,
        ACT=int(activation), IDX64=bool(force_int64 or needs_int64(out, residual)), UPCAST=bool(upcast),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_N2=bn2 or MIN_DOT_BLOCK, SPLIT_N=bn2 > 0, BLOCK_K=bk, BLOCK_W=bw,
        GROUP_M=int(config.get("GROUP_M", 8)),
        num_warps=int(config.get("num_warps", 4)), num_stages=int(config.get("num_stages", 3)),
    )
    return out
