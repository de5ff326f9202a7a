"""conv3d forward as an implicit GEMM (no im2col buffer), portable Triton.

Layer 1 (``conv3d_fwd_kernel``): the Triton kernel.
Layer 2 (``launch_conv3d``): the grid and the layout checks; tile
narrowing, index width and the launch itself are shared with the 2-D
kernels (_launch.py). The torch-facing function is ``conv_patch.functional.conv3d``.

A GEMM row is one output voxel ``(n, od, oh, ow)``. The output's D and H
axes are folded into one row axis ``od * OH + oh`` addressed with the H
stride, which is exact when ``stride_d == OH * stride_h`` (dense NCDHW and
NDHWC outputs alike): the 2-D tile order and epilogue then serve unchanged.
The launcher checks the condition and otherwise computes into a dense
temporary.

The time axis the convolution sees is ``cat([cache, x], dim=2)``, read in
place: a video VAE's causal convs put the last frames of the previous chunk
in front of the new one, and the concatenated tensor is never written.
Frame ``t < Tc`` comes from ``cache`` and frame ``t >= Tc`` from ``x`` at
``t - Tc``. Padding is given at the front of each axis only; the back
padding only decides the output size, which the caller passes in.
"""

import triton
import triton.language as tl

from .common import BATCH_EXTENTS, accumulate_tap, epilogue_store, output_tile, wide
from .launch import cdiv, conv_meta, empty, launch


@triton.jit
def accumulate_frame(acc, src_ptr, w_ptr, src_row, ok, ih0, iw0, H, W, C_in,
                     ssc, ssh, ssw, w_frame, swi, swh, sww, w_col, n_ok,
                     KH, KW, DH, DW,
                     IDX64: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += the KH x KW taps of one input frame per row, as the 2-D
    kernel accumulates them: ``src_row`` is each row's offset of its frame
    (sample and time), ``ok`` the rows whose frame exists; the spatial
    padding is masked by ``accumulate_tap``."""
    for tap in range(0, KH * KW):
        kh = tap // KW
        kw = tap - kh * KW
        acc = accumulate_tap(acc, src_ptr, w_ptr, src_row, ok,
                             ih0 + kh * DH, iw0 + kw * DW, H, W, C_in,
                             ssc, ssh, ssw, w_frame + kh * swh + kw * sww, swi, w_col, n_ok,
                             IDX64, UPCAST, PRECISION, BLOCK_K)
    return acc


@triton.jit(do_not_specialize=BATCH_EXTENTS)
def conv3d_fwd_kernel(
    x_ptr, c_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
    N, C_in, T, H, W, Tc, C_out, OD, OH, OW,
    sxn, sxc, sxt, sxh, sxw,
    scn, scc, sct, sch, scw,
    swo, swi, swt, swh, sww,
    srn, src, srh, srw,
    son, soc, soh, sow,
    KT, KH, KW, STT, STH, STW, PT, PH, PW, DT, DH, DW,
    beta, out_scale,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_CACHE: tl.constexpr, ACT: tl.constexpr,
    IDX64: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Rows over (n, od * OH + oh, ow): the folded output (module docstring).
    row_ok, n, ohf, ow, offs_n, n_ok = output_tile(N, OD * OH, OW, C_out, BLOCK_M, BLOCK_N, GROUP_M, IDX64)
    od = ohf // OH
    oh = ohf - od * OH
    t0 = od * STT - PT
    ih0 = oh * STH - PH
    iw0 = ow * STW - PW
    w_col = offs_n * swo

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, KT):
        t = t0 + kt * DT
        t_ok = row_ok & (t >= 0) & (t < Tc + T)
        # A frame no row of the tile reads (time padding, or the other
        # source) is skipped whole: a tile rarely spans two output frames,
        # so each tap costs one pass over one source, not two masked ones.
        if HAS_CACHE:
            in_cache = t_ok & (t < Tc)
            if tl.max(in_cache.to(tl.int32), axis=0) > 0:
                acc = accumulate_frame(acc, c_ptr, w_ptr, n * scn + wide(t, IDX64) * sct, in_cache,
                                       ih0, iw0, H, W, C_in, scc, sch, scw, kt * swt, swi, swh, sww,
                                       w_col, n_ok, KH, KW, DH, DW, IDX64, UPCAST, PRECISION, BLOCK_K)
            t_ok = t_ok & (t >= Tc)
        if tl.max(t_ok.to(tl.int32), axis=0) > 0:
            acc = accumulate_frame(acc, x_ptr, w_ptr, n * sxn + wide(t - Tc, IDX64) * sxt, t_ok,
                                   ih0, iw0, H, W, C_in, sxc, sxh, sxw, kt * swt, swi, swh, sww,
                                   w_col, n_ok, KH, KW, DH, DW, IDX64, UPCAST, PRECISION, BLOCK_K)

    epilogue_store(acc, n, ohf, ow, row_ok, offs_n, n_ok,
                   out_ptr, son, soc, soh, sow, bias_ptr, res_ptr, srn, src, srh, srw,
                   beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


def folds_rows(t) -> bool:
    """Whether [N, C, D, H, W] ``t``'s (d, h) index folds into one row index
    ``d * H + h`` with the H stride (dense NCDHW and NDHWC do)."""
    return t.shape[2] == 1 or t.stride(2) == t.shape[3] * t.stride(3)


def _row_strides(t):
    return t.stride(0), t.stride(1), t.stride(3), t.stride(4)


def launch_conv3d(x, cache, w, bias, out, residual, *, stride, padding, dilation, beta, activation,
                  out_scale, config, precision, upcast, force_int64=False):
    """``out = out_scale * act(conv3d(cat([cache, x], 2)) + bias + beta * residual)``.

    ``x`` is [N, C_in, T, H, W] and ``cache`` (or None) [N, C_in, Tc, H, W],
    the frames in front of it; ``w`` [C_out, C_in, KT, KH, KW]; ``out``
    [N, C_out, OD, OH, OW], preallocated, sized by the caller from the
    padding at both ends; ``padding`` is the front padding (t, h, w). Every
    tensor is read and written through its strides; an ``out`` (or
    ``residual``) whose D and H axes do not fold (``folds_rows``) goes
    through a dense copy, made by PyTorch: a recorded plan (``recording``)
    replays launches only, so it must hand this launcher foldable tensors.
    """
    N, C_in, T, H, W = x.shape
    C_out, _, KT, KH, KW = w.shape
    OD, OH, OW = out.shape[2:]
    dst = out if folds_rows(out) else empty(out.shape, dtype=out.dtype, device=out.device)
    if residual is not None and not folds_rows(residual):
        residual = empty(residual.shape, dtype=residual.dtype, device=residual.device).copy_(residual)
    src = cache if cache is not None else x
    meta = conv_meta(config, C_in, C_out, bias=bias, residual=residual, activation=activation,
                     precision=precision, upcast=upcast, tensors=(x, cache, w, dst, residual),
                     force_int64=force_int64)
    res = residual if residual is not None else dst
    grid = (cdiv(N * OD * OH * OW, meta["BLOCK_M"]) * cdiv(C_out, meta["BLOCK_N"]),)
    launch(conv3d_fwd_kernel, grid,
        x, src, w, bias if bias is not None else dst, res, dst,
        N, C_in, T, H, W, 0 if cache is None else cache.shape[2], C_out, OD, OH, OW,
        *x.stride(), *src.stride(), *w.stride(), *_row_strides(res), *_row_strides(dst),
        KT, KH, KW, *stride, *padding, *dilation,
        float(beta), float(out_scale), HAS_CACHE=cache is not None, **meta)
    if dst is not out:
        out.copy_(dst)
    return out
