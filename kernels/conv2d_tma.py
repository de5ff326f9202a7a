"""conv2d forward for Hopper (sm90): TMA tensor descriptors feeding wgmma.

Layer 1 (``conv2d_tma_kernel``): the @triton.jit kernel.
Layer 2 (``launch_conv2d_tma``): builds the two descriptors, sizes the grid,
launches with the config the router chose. The torch-facing wrapper is
``conv_patch.functional``, shared with the portable kernels.

Design:
  * An output tile is ``BLOCK_H x BLOCK_W`` pixels of one image (``BLOCK_M =
    BLOCK_H * BLOCK_W`` GEMM rows) times ``BLOCK_N`` output channels. For tap
    ``(kh, kw)`` and channel block ``c0`` the A operand is one TMA box of the
    4-D activation at ``(n, oh0 - ph + kh*dh, ow0 - pw + kw*dw, c0)``: boxes
    that hang over an edge (negative coordinates included) are zero-filled by
    the TMA unit, which *is* the zero padding; no mask, no padded copy.
  * The input is described as [N, H, W, C] with box [1, BH, BW, BK]. NCHW
    cannot be boxed the same way: its innermost coordinate would be the
    column ``ow0 - pw + kw``, and a TMA box must start 16-byte aligned in the
    innermost dimension (an unaligned start is an illegal instruction on the
    H200 with Triton 3.6; the interpreter asserts it too). So the torch-facing
    layer stages an NCHW input through one NHWC copy; the output is still
    written in the caller's layout by the epilogue. The exception is a conv
    with one column tap and no column padding (1x1, Kx1) under one-row
    tiles: its boxes start at a tile's first column, so the NCHW input is
    boxed in place as [1, BK, 1, BW] and the GEMM runs transposed
    (``reads_nchw_in_place``, ``nchw_in_place_reduction``); for the VAEs'
    1x1 shortcuts the copy would move as many bytes as the conv.
  * The weight pack ([C_out, KH, KW, C_in], see conv_patch.runtime.pack) is described
    as [C_out, KH*KW, C_in] with box [BN, 1, BK]: a channel block that runs
    past C_in reads TMA zeros, never the next tap's weights.
  * The reduction loop is one flat loop over (tap, channel block) so Triton's
    software pipeliner keeps ``num_stages`` TMA loads in flight across taps.
  * A tile of one pixel row (BLOCK_W = BLOCK_M) has an input box whose
    reshape to [BLOCK_M, BLOCK_K] Triton 3.6 folds into the shared layout, so
    wgmma reads it from shared memory; a taller box is reshaped in registers
    (ldmatrix and a CTA barrier every K step). One-row tiles measured
    0.84-0.91x the time of 8x16 ones on the FLUX decoder's 3x3 convs
    (bench/results/tma-tiles-h200-2026-12-01.json).
  * ``PERSISTENT``: a grid of ``persistent`` programs per SM walks the tiles
    (one-row tiles of stride-1 convs only, see the launcher): with 128x256
    tiles, one CTA per SM, it is what brought the 512-channel convs past
    cuDNN.
  * Stride S > 1 (a VAE encoder's downsampling convs) is a box too, of a
    5-D view of the same memory: [N, H/S, S, W/S, S*C] (row = S*q + p, column
    = S*q' + p', the column parity folded into the channel dimension). Tap
    (kh, kw) reads input row S*oh + kh*dh - ph = S*(oh + qh) + rh, so for a
    tile of output rows the rows it needs are the box at (n, oh0 + qh, rh,
    ow0 + qw, rw*C + c0): one box per tap again, edges zero-filled as
    before. The router requires S to divide H and W (the view must be
    exact) and C_in a multiple of 16, so a channel block never runs from
    one column parity into the next.
  * The input may also be a channel slice of a wider NHWC tensor (a dense
    block's channel prefix): described with its own pixel stride, its box
    reads the slice in place, channels past it zero-filled.
  * The epilogue's residual and output move as TMA boxes [1, BH, BW, BN]
    of the NHWC tensors, dense or channel slices (the pointer epilogue moves
    them in the wgmma accumulator's layout, 4-byte pieces per thread; boxes took
    0.90-1.003x its time on the H200's FLUX-decoder convs, the 1x1 with a
    residual 0.90, bench/results/tma-epilogue-*.json), clipped at the image edges by the
    TMA unit. An NCHW caller's output (and residual) moves as boxes
    [1, BN, 1, BW] of the NCHW tensor where the tile is one pixel row (the
    box is then the transposed tile). Outputs that are strided views (a
    subpixel parity), NCHW ones under taller tiles, and rows not 16-byte
    aligned keep the pointer epilogue.
  * Misaligned tensors, fp32 and other strides go to the portable kernel.
"""

import triton
import triton.language as tl

from conv_patch.specs import nhwc_pitch

from .common import TMA_2D_EXTENTS, epilogue_store, epilogue_values, grouped_tile, wide
from .launch import TMA_ALIGN, block_sizes, cdiv, launch, needs_int64, next_pow2, sm_count


@triton.jit
def nhwc_reduction(x_desc, w_desc, n, oh0, ow0, n0, C_in, KH, KW, PH, PW, DH, DW, SH, SW,
                   UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   STRIDED: tl.constexpr):
    """The tile's [BLOCK_M, BLOCK_N] fp32 sum over every (tap, channel
    block) of an NHWC input (or its strided 5-D view)."""
    k_blocks = tl.cdiv(C_in, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, KH * KW * k_blocks):
        tap = it // k_blocks
        c0 = (it - tap * k_blocks) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        if STRIDED:
            # Offsets made non-negative before // and %, whose rounding of
            # negatives differs between compiled Triton and the interpreter.
            dh = kh * DH + (SH - 1) * PH
            dw = kw * DW + (SW - 1) * PW
            a = x_desc.load([n, oh0 + dh // SH - PH, dh % SH, ow0 + dw // SW - PW, (dw % SW) * C_in + c0])
        else:
            a = x_desc.load([n, oh0 - PH + kh * DH, ow0 - PW + kw * DW, c0])
        a = tl.reshape(a, (BLOCK_M, BLOCK_K))
        b = tl.reshape(w_desc.load([n0, tap, c0]), (BLOCK_N, BLOCK_K))
        if UPCAST:
            # The interpreter's tl.dot is wrong on bf16 operands (Triton
            # 3.4-3.9); on hardware this branch is compiled out.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def nchw_in_place_reduction(x_desc, w_desc, n, oh0, ow0, n0, C_in, KH, PH, DH,
                            UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """The same sum for a one-row tile of a conv with one column tap and no
    column padding, over the NCHW input itself (``reads_nchw_in_place``):
    the box [1, BK, 1, BW] at (n, c0, row, ow0) is the tile's input
    transposed, so the GEMM runs transposed, out^T = W x^T, and both wgmma
    operands come straight from shared memory (a transposed A operand, or a
    3-D weight box reshaped, would go through registers: ldmatrix every K
    step, Triton 3.6). The weight is the 2-D [C_out, KH*C_in] view with box
    [BN, BK]: a channel block past C_in reads the next row tap's weights,
    but against the input's zero-filled channels past C_in."""
    k_blocks = tl.cdiv(C_in, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(0, KH * k_blocks):
        kh = it // k_blocks
        c0 = (it - kh * k_blocks) * BLOCK_K
        xt = tl.reshape(x_desc.load([n, c0, oh0 - PH + kh * DH, ow0]), (BLOCK_K, BLOCK_M))
        b = w_desc.load([n0, kh * C_in + c0])
        if UPCAST:
            xt = xt.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(b, xt, acc)
    return tl.trans(acc)


@triton.jit
def conv_tile(tile, x_desc, w_desc, bias_ptr, res_ptr, out_ptr, res_desc, out_desc,
              N, C_in, C_out, OH, OW,
              srn, src, srh, srw, son, soc, soh, sow,
              KH, KW, PH, PW, DH, DW, SH, SW, beta, out_scale,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
              IDX64: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_W: tl.constexpr, GROUP_M: tl.constexpr, STRIDED: tl.constexpr, TMA_IO: tl.constexpr,
              X_NCHW: tl.constexpr):
    """One output tile (number ``tile`` in grouped order): the reduction
    over every (tap, channel block), then the epilogue."""
    BLOCK_H: tl.constexpr = BLOCK_M // BLOCK_W
    tiles_w = tl.cdiv(OW, BLOCK_W)
    tiles_h = tl.cdiv(OH, BLOCK_H)
    pid_m, pid_n = grouped_tile(tile, N * tiles_h * tiles_w, tl.cdiv(C_out, BLOCK_N), GROUP_M)

    ow0 = (pid_m % tiles_w) * BLOCK_W
    t = pid_m // tiles_w
    oh0 = (t % tiles_h) * BLOCK_H
    n = t // tiles_h
    n0 = pid_n * BLOCK_N

    if X_NCHW:
        acc = nchw_in_place_reduction(x_desc, w_desc, n, oh0, ow0, n0, C_in, KH, PH, DH,
                                      UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = nhwc_reduction(x_desc, w_desc, n, oh0, ow0, n0, C_in, KH, KW, PH, PW, DH, DW, SH, SW,
                             UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, STRIDED)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    if TMA_IO == 1:
        # Residual in and output out as boxes of dense NHWC tensors, like the
        # input: a pointer epilogue moves them in the wgmma accumulator's
        # layout, 4-byte pieces per thread, rows far apart.
        r = acc
        if HAS_RES:
            r = tl.reshape(res_desc.load([n, oh0, ow0, n0]), (BLOCK_M, BLOCK_N)).to(tl.float32)
        v = epilogue_values(acc, r, offs_n, offs_n < C_out, bias_ptr, beta, out_scale, HAS_BIAS, HAS_RES, ACT)
        out_desc.store([n, oh0, ow0, n0], tl.reshape(v.to(out_desc.dtype), (1, BLOCK_H, BLOCK_W, BLOCK_N)))
    elif TMA_IO == 2:
        # Dense NCHW, one-row tile (the launcher's rule): the tile is the box
        # [1, BN, 1, BW] at (n, n0, oh0, ow0), transposed; the pointer
        # epilogue writes NCHW in 16-byte runs of 8 pixels per channel.
        r = acc
        if HAS_RES:
            r = tl.trans(tl.reshape(res_desc.load([n, n0, oh0, ow0]), (BLOCK_N, BLOCK_M))).to(tl.float32)
        v = epilogue_values(acc, r, offs_n, offs_n < C_out, bias_ptr, beta, out_scale, HAS_BIAS, HAS_RES, ACT)
        out_desc.store([n, n0, oh0, ow0], tl.reshape(tl.trans(v.to(out_desc.dtype)), (1, BLOCK_N, 1, BLOCK_M)))
    else:
        offs = tl.arange(0, BLOCK_M)
        oh = oh0 + offs // BLOCK_W
        ow = ow0 + offs % BLOCK_W
        epilogue_store(acc, wide(n, IDX64), oh, ow, (oh < OH) & (ow < OW), offs_n, offs_n < C_out,
                       out_ptr, son, soc, soh, sow, bias_ptr, res_ptr, srn, src, srh, srw,
                       beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


@triton.jit(do_not_specialize=TMA_2D_EXTENTS)
def conv2d_tma_kernel(
    x_desc, w_desc, bias_ptr, res_ptr, out_ptr, res_desc, out_desc,
    N, C_in, H, W, C_out, OH, OW,
    srn, src, srh, srw,
    son, soc, soh, sow,
    KH, KW, PH, PW, DH, DW, SH, SW,
    beta, out_scale,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    IDX64: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr, GROUP_M: tl.constexpr, STRIDED: tl.constexpr, TMA_IO: tl.constexpr,
    X_NCHW: tl.constexpr, PERSISTENT: tl.constexpr,
):
    if PERSISTENT:
        # A fixed grid walks the tiles; the programs' tiles interleave, so
        # neighbours in grouped order still run at the same time.
        BLOCK_H: tl.constexpr = BLOCK_M // BLOCK_W
        tiles = N * tl.cdiv(OH, BLOCK_H) * tl.cdiv(OW, BLOCK_W) * tl.cdiv(C_out, BLOCK_N)
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            conv_tile(tile, x_desc, w_desc, bias_ptr, res_ptr, out_ptr, res_desc, out_desc,
                      N, C_in, C_out, OH, OW, srn, src, srh, srw, son, soc, soh, sow,
                      KH, KW, PH, PW, DH, DW, SH, SW, beta, out_scale,
                      HAS_BIAS, HAS_RES, ACT, IDX64, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_W,
                      GROUP_M, STRIDED, TMA_IO, X_NCHW)
    else:
        # No loop around the tile here: the one-tile kernel keeps the code
        # the table's one-tile configs were measured with.
        conv_tile(tl.program_id(0), x_desc, w_desc, bias_ptr, res_ptr, out_ptr, res_desc, out_desc,
                  N, C_in, C_out, OH, OW, srn, src, srh, srw, son, soc, soh, sow,
                  KH, KW, PH, PW, DH, DW, SH, SW, beta, out_scale,
                  HAS_BIAS, HAS_RES, ACT, IDX64, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_W,
                  GROUP_M, STRIDED, TMA_IO, X_NCHW)


def tile_sizes(config, c_in, c_out, ow):
    """The table's tile narrowed to the problem; BLOCK_M stays as configured
    (wgmma wants M >= 64), BLOCK_W shrinks to the image width so rows are not
    wasted past the right edge."""
    bm, bn, bk = block_sizes(config, c_in, c_out)
    bw = min(int(config.get("BLOCK_W", 16)), next_pow2(ow), bm)
    return bm, bn, bk, bw


def nhwc_box_pitch(t) -> int:
    """The pixel stride of ``t`` ([N, C, H, W]) where it can be an NHWC TMA
    box target: NHWC, dense or a channel slice (``nhwc_pitch``; a band of
    rows of a one-sample tensor is too), with a 16-byte aligned base and
    pixel stride; else 0."""
    p = nhwc_pitch(t)
    return p if p and (p * t.element_size()) % TMA_ALIGN == 0 and t.data_ptr() % TMA_ALIGN == 0 else 0


def nhwc_strides(t, pitch: int) -> list:
    """The [N, H, W, C] strides of an NHWC tensor of pixel stride
    ``pitch``, written out: PyTorch may report any stride for a size-1
    dimension, TMA wants every stride 16-byte aligned."""
    h, w = t.shape[2], t.shape[3]
    return [h * w * pitch, w * pitch, pitch, 1]


def dense_nchw(t) -> bool:
    """``t`` ([N, C, H, W]) is dense NCHW with 16-byte aligned base and
    pixel rows: an NCHW box target."""
    n, c, h, w = t.shape
    return ((w * t.element_size()) % TMA_ALIGN == 0 and t.data_ptr() % TMA_ALIGN == 0 and t.stride(3) == 1
            and t.stride(2) == w and t.stride(1) == h * w and (n == 1 or t.stride(0) == c * h * w))


def flat_plane(x, w_shape, padding, stride, config, out, residual) -> bool:
    """A 1x1 conv at stride 1 without padding whose input, output and
    residual are dense NCHW: each output pixel reads the input pixel at its
    own index, so the [N, C, H, W] planes are read and written as one pixel
    row [N, C, 1, H*W] (``plane_row``), and a one-row tile covers BLOCK_M
    pixels of the plane however narrow its rows (a UNet's 1x1 shortcuts
    and projections at 8x8-64x64). Off with the config's ``nchw_in_place``."""
    if (not config.get("nchw_in_place", True) or tuple(stride) != (1, 1) or tuple(padding) != (0, 0)
            or tuple(w_shape[2:]) != (1, 1) or out is None):
        return False
    return (x.shape[2] > 1 and out.shape[2:] == x.shape[2:] and all(t.is_contiguous() for t in (x, out))
            and (residual is None or (residual.shape == out.shape and residual.is_contiguous())))


def plane_row(t):
    """``t`` [N, C, H, W], dense NCHW, as the one-row view [N, C, 1, H*W]."""
    n, c, h, w = t.shape
    return t.view(n, c, 1, h * w)


def reads_nchw_in_place(x, w_shape, padding, stride, config, out=None, residual=None) -> bool:
    """The kernel reads this NCHW input ``x`` in place, as boxes [1, BK, 1,
    BW] of the NCHW tensor, instead of through the NHWC staging copy: a conv
    with one column tap and no column padding (1x1, Kx1) at stride 1, whose
    tile is one pixel row, on a dense NCHW input with 16-byte aligned rows
    (a 1x1 conv's whole plane as one row where ``flat_plane``: the call's
    ``out`` and ``residual`` decide that too). Then every box starts at an
    output tile's first column, aligned; with a column tap or padding it
    would start at ``ow0 - pw + kw``, which a TMA box cannot (the module
    docstring). A config may turn it off (``"nchw_in_place": false``) for
    an A/B."""
    if not config.get("nchw_in_place", True) or tuple(stride) != (1, 1):
        return False
    c_out, c_in, _, kw = w_shape
    if flat_plane(x, w_shape, padding, stride, config, out, residual):
        x = plane_row(x)
    if kw != 1 or padding[1] != 0 or not dense_nchw(x):
        return False
    bm, _, _, bw = tile_sizes(config, c_in, c_out, x.shape[3])
    return bm == bw


def launch_conv2d_tma(x, w, bias, out, residual, *, stride, padding, dilation, beta, activation,
                      out_scale, config, precision, upcast, force_int64=False):
    """Same call as the portable launchers. ``x`` is NHWC (logical
    [N, C, H, W], channels_last strides, or a channel slice of such a
    tensor: ``nhwc_pitch``; dense at a stride > 1), or NCHW where
    ``reads_nchw_in_place`` says so, and ``w`` the [C_out, C_in, KH, KW]
    view of a co,kh,kw,ci-dense pack; the router has checked alignment and
    that the stride divides H and W."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if flat_plane(x, w.shape, padding, stride, config, out, residual):
        launch_conv2d_tma(plane_row(x), w, bias, plane_row(out), None if residual is None else plane_row(residual),
                          stride=stride, padding=padding, dilation=dilation, beta=beta, activation=activation,
                          out_scale=out_scale, config=config, precision=precision, upcast=upcast,
                          force_int64=force_int64)
        return out
    N, C_in, H, W = x.shape
    C_out, _, KH, KW = w.shape
    OH, OW = out.shape[2], out.shape[3]
    sh, sw = stride
    bm, bn, bk, bw = tile_sizes(config, C_in, C_out, OW)
    strided = (sh, sw) != (1, 1)
    if strided:
        # A channel block must not run from one column parity into the next
        # (C_in is a multiple of 16, the router's rule).
        while C_in % bk:
            bk //= 2
    bh = bm // bw
    warps = int(config.get("num_warps", 4))
    if warps == 8 and bn < 256:
        # Measured on the H200 (Triton 3.6): 8 warps on a 128x128 tile with 3
        # stages gave run-to-run different, sometimes 3.5x-too-large errors
        # (7 of 10 stress shapes; 128x256 clamped to 128 by C_out = 128
        # likewise); 4 warps on the same tile, and 8 warps on an unclamped
        # 128x256 tile, were bit-stable and cuDNN-accurate on every shape.
        # tests/test_gpu.py::test_tma_is_deterministic_and_cudnn_accurate.
        warps = 4
    # Dense strides written out: PyTorch may report any stride for a size-1
    # dimension, TMA wants every stride 16-byte aligned.
    x_nchw = reads_nchw_in_place(x, w.shape, padding, stride, config, out, residual)
    if x_nchw:
        x_desc = TensorDescriptor(x, [N, C_in, H, W], [C_in * H * W, H * W, W, 1], [1, bk, 1, bw])
        w_desc = TensorDescriptor(w, [C_out, KH * KW * C_in], [w.stride(0), 1], [bn, bk])
    else:
        # NHWC, dense or a channel slice read in place (its pixels ``pitch``
        # apart): channels past C_in are outside the described tensor, so a
        # box reads them as TMA zeros, never the slice's neighbours.
        pitch = nhwc_pitch(x)
        if strided:
            if pitch != C_in:
                raise ValueError("a strided TMA conv reads dense NHWC (its box folds columns into channels)")
            x_desc = TensorDescriptor(x, [N, H // sh, sh, W // sw, sw * C_in],
                                      [H * W * C_in, sh * W * C_in, W * C_in, sw * C_in, 1], [1, bh, 1, bw, bk])
        else:
            x_desc = TensorDescriptor(x, [N, H, W, C_in], nhwc_strides(x, pitch), [1, bh, bw, bk])
        w_desc = TensorDescriptor(w, [C_out, KH * KW, C_in], [w.stride(0), C_in, 1], [bn, 1, bk])
    res = residual if residual is not None else out
    # A config may turn the TMA epilogue off ("tma_io": false) for an A/B.
    tma_io = 0
    if config.get("tma_io", True):
        pitches = [nhwc_box_pitch(t) for t in (out, residual) if t is not None]
        if all(pitches):
            tma_io, dims, box = 1, [N, OH, OW, C_out], [1, bh, bw, bn]
            strides = [nhwc_strides(t, p) for t, p in zip((out, residual), pitches)]
        elif bh == 1 and dense_nchw(out) and (residual is None or dense_nchw(residual)):
            tma_io, dims, box = 2, [N, C_out, OH, OW], [1, bn, 1, bw]
            strides = [[C_out * OH * OW, OH * OW, OW, 1]] * 2
    if tma_io:
        out_desc = TensorDescriptor(out, dims, strides[0], box)
        res_desc = out_desc if residual is None else TensorDescriptor(residual, dims, strides[-1], box)
    else:
        out_desc = res_desc = x_desc
    tiles = N * cdiv(OH, bh) * cdiv(OW, bw) * cdiv(C_out, bn)
    per_sm = int(config.get("persistent", 0))
    # Persistent only with one-row tiles (BLOCK_W = BLOCK_M) of a stride-1
    # conv: then the input box [1, 1, BW, BK] reaches wgmma straight from
    # shared memory. Boxes of several rows go through registers (Triton 3.6
    # cannot fold their reshape into the shared layout), and in a persistent
    # loop that path gave run-to-run different results on the H200 (errors
    # 1.2-3x the one-tile kernel's, any stage count or barrier placement;
    # bench/results/persistent-tma-*.json).
    persistent = per_sm > 0 and bh == 1 and not strided
    grid = (min(tiles, per_sm * sm_count(x.device)) if persistent else tiles,)
    launch(conv2d_tma_kernel, grid,
        x_desc, w_desc, bias if bias is not None else out, res, out, res_desc, out_desc,
        N, C_in, H, W, C_out, OH, OW,
        *res.stride(), *out.stride(),
        KH, KW, padding[0], padding[1], dilation[0], dilation[1], sh, sw,
        float(beta), float(out_scale),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=int(activation),
        IDX64=bool(force_int64 or needs_int64(out, residual)), UPCAST=bool(upcast),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_W=bw, GROUP_M=int(config.get("GROUP_M", 8)), STRIDED=strided,
        TMA_IO=tma_io, X_NCHW=x_nchw, PERSISTENT=persistent, num_warps=warps, num_stages=int(config.get("num_stages", 3)),
    )
    return out
