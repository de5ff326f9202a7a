"""Weight preparation on the device: the kernels' pack layout and the
subpixel fold of an upsampling conv's weight.

Layer 1: ``weight_pack_kernel`` (a [C_out, C_in, KH, KW] weight of any
strides into the dense co, kh, kw, ci pack, see conv_patch/pack.py),
``grouped_weight_pack_kernel`` (the same for many weights in one launch) and
``subpixel_fold_kernel`` (a 3x3 weight into the four 2x2 weights of
``ops.upsample_conv2d``, packed). Layer 2: ``launch_weight_pack``,
``grouped_pack_args`` / ``launch_grouped_weight_pack`` and
``launch_subpixel_fold``.

Why: both run at every call (a cached copy could be stale, pack.py says
why). Inside a CUDA graph of a FLUX decode at 1024^2 on the H200, PyTorch's
strided copies took 7.4 us per 512x512x3x3 pack (34 of them, 0.25 ms) and the
fold's ~15 elementwise, stack and copy ops another 0.19 ms. Each kernel here
reads the weight once in whole per-output-channel runs and writes the result
coalesced: a program owns one output channel's [BLOCK_CI, KH*KW] slab, loaded
along the source's contiguous taps and stored along ci (Triton transposes the
tile through shared memory between the two).
"""

import triton
import triton.language as tl

from .common import INTERPRET  # noqa: F401  (fixed before this module's decorations)
from .launch import cdiv, launch, next_pow2


@triton.jit
def _taps_tile(src_ptr, co, ci, ci_ok, KW, s_co, s_ci, s_kh, s_kw, TAPS: tl.constexpr, BLOCK_T: tl.constexpr):
    # [BLOCK_CI, BLOCK_T] of output channel co: column t is tap (t // KW, t % KW).
    t = tl.arange(0, BLOCK_T)
    kh = t // KW
    kw = t - kh * KW
    ok = ci_ok[:, None] & (t < TAPS)[None, :]
    offs = co * s_co + ci[:, None] * s_ci + (kh * s_kh + kw * s_kw)[None, :]
    return tl.load(src_ptr + offs, mask=ok, other=0.0), t, ok


@triton.jit
def weight_pack_kernel(src_ptr, dst_ptr, C_in, KW, TAPS, s_co, s_ci, s_kh, s_kw,
                       BLOCK_CI: tl.constexpr, BLOCK_T: tl.constexpr):
    co = tl.program_id(0)
    ci = tl.program_id(1) * BLOCK_CI + tl.arange(0, BLOCK_CI)
    ci_ok = ci < C_in
    tile, t, ok = _taps_tile(src_ptr, co, ci, ci_ok, KW, s_co, s_ci, s_kh, s_kw, TAPS, BLOCK_T)
    tl.store(dst_ptr + (co * TAPS + t[None, :]) * C_in + ci[:, None], tile, mask=ok)


@triton.jit
def grouped_weight_pack_kernel(desc_ptr, map_ptr, like_ptr, CO_PER_PROGRAM: tl.constexpr, BLOCK_CI: tl.constexpr,
                               BLOCK_T: tl.constexpr):
    # Program p packs CO_PER_PROGRAM output channels' [BLOCK_CI, TAPS] slabs
    # of weight t from output channel co0, (t, co0, ci block) = map[p]
    # (several channels a program: a channel's slab is a few KiB). desc[t]
    # holds the weight's and its pack's addresses, then C_out, C_in, KW,
    # TAPS and the weight's strides (elements). like_ptr only carries the
    # element type (every weight of a launch has it).
    p = tl.program_id(0)
    t = tl.load(map_ptr + 3 * p)
    co0 = tl.load(map_ptr + 3 * p + 1)
    cb = tl.load(map_ptr + 3 * p + 2)
    d = desc_ptr + 10 * t
    ty = tl.pointer_type(like_ptr.dtype.element_ty)
    src_ptr = tl.load(d).to(ty)
    dst_ptr = tl.load(d + 1).to(ty)
    C_out = tl.load(d + 2)
    C_in = tl.load(d + 3)
    KW = tl.load(d + 4)
    TAPS = tl.load(d + 5)
    s_co = tl.load(d + 6)
    s_ci = tl.load(d + 7)
    s_kh = tl.load(d + 8)
    s_kw = tl.load(d + 9)
    ci = cb * BLOCK_CI + tl.arange(0, BLOCK_CI)
    for i in tl.static_range(CO_PER_PROGRAM):
        co = co0 + i
        ci_ok = ci < tl.where(co < C_out, C_in, 0)  # (a channel past C_out: nothing)
        tile, tap, ok = _taps_tile(src_ptr, co, ci, ci_ok, KW, s_co, s_ci, s_kh, s_kw, TAPS, BLOCK_T)
        tl.store(dst_ptr + (co * TAPS + tap[None, :]) * C_in + ci[:, None], tile, mask=ok)


@triton.jit
def subpixel_fold_kernel(src_ptr, dst_ptr, C_out, C_in, s_co, s_ci, s_kh, s_kw, BLOCK_CI: tl.constexpr):
    # dst is [2, 2, C_out, 2, 2, C_in] dense: (row parity a, column parity b,
    # co, kh, kw, ci). Along each axis, parity 0 folds the 3 taps into
    # (t0, t1 + t2) and parity 1 into (t0 + t1, t2): 2x2 tap i of parity a
    # sums the source taps lo .. lo + n - 1 with lo = i * (1 + a), n = 1 +
    # (a != i). Summed in fp32 and rounded once to the weight's dtype.
    co = tl.program_id(0)
    ci = tl.program_id(1) * BLOCK_CI + tl.arange(0, BLOCK_CI)
    ci_ok = ci < C_in
    tile, t, ok = _taps_tile(src_ptr, co, ci, ci_ok, 3, s_co, s_ci, s_kh, s_kw, 9, 16)
    tile = tile.to(tl.float32)
    r = t // 3
    c = t - r * 3
    for a in tl.static_range(2):
        for b in tl.static_range(2):
            for i in tl.static_range(2):
                for j in tl.static_range(2):
                    r_lo = i * (1 + a)
                    c_lo = j * (1 + b)
                    sel = ((r >= r_lo) & (r < r_lo + 1 + (a != i)) & (c >= c_lo) & (c < c_lo + 1 + (b != j))
                           & (t < 9))
                    v = tl.sum(tl.where(sel[None, :], tile, 0.0), axis=1)
                    row = (((a * 2 + b) * C_out + co) * 2 + i) * 2 + j
                    tl.store(dst_ptr + row * C_in + ci, v.to(dst_ptr.dtype.element_ty), mask=ci_ok)


def _block_ci(c_in):
    return min(128, next_pow2(c_in))


def launch_weight_pack(w, out):
    """``out`` (dense co, kh, kw, ci; any 4-D view of that memory) = ``w``
    ([C_out, C_in, KH, KW], any strides)."""
    C_out, C_in, KH, KW = w.shape
    bc = _block_ci(C_in)
    launch(weight_pack_kernel, (C_out, cdiv(C_in, bc)), w, out, C_in, KW, KH * KW, *w.stride(),
           BLOCK_CI=bc, BLOCK_T=next_pow2(KH * KW), num_warps=4)
    return out


GROUPED_BLOCK_CI = 64
GROUPED_CO_PER_PROGRAM = 4


def grouped_pack_args(pairs):
    """The device-side arguments of one ``launch_grouped_weight_pack`` for
    ``pairs`` of (weight [C_out, C_in, KH, KW] of any strides, dense co, kh,
    kw, ci pack), all of one dtype on one device: (desc, map, like,
    BLOCK_T). Built once and reused while the tensors' addresses and strides
    are unchanged (conv_patch/pack.py: ``PackGroup``): the addresses are in
    ``desc``, so the arguments hold no reference to the tensors."""
    import torch
    w0 = pairs[0][0]
    desc, progs, taps = [], [], 1
    for t, (w, buf) in enumerate(pairs):
        c_out, c_in, kh, kw = w.shape
        if w.dtype != w0.dtype or buf.dtype != w0.dtype or w.device != w0.device or buf.device != w0.device:
            raise ValueError("grouped weight pack: one dtype and one device per launch")
        desc.append([w.data_ptr(), buf.data_ptr(), c_out, c_in, kw, kh * kw, *w.stride()])
        taps = max(taps, kh * kw)
        blocks = cdiv(c_in, GROUPED_BLOCK_CI)
        progs.extend((t, co, cb) for co in range(0, c_out, GROUPED_CO_PER_PROGRAM) for cb in range(blocks))
    desc_t = torch.tensor(desc, dtype=torch.int64).to(w0.device)
    map_t = torch.tensor(progs, dtype=torch.int32).to(w0.device)
    return desc_t, map_t, w0.new_empty(1), next_pow2(taps)


def launch_grouped_weight_pack(args):
    """Every pack of ``grouped_pack_args``' pairs refreshed from its weight,
    in one launch."""
    desc, pmap, like, block_t = args
    launch(grouped_weight_pack_kernel, (pmap.shape[0],), desc, pmap, like,
           CO_PER_PROGRAM=GROUPED_CO_PER_PROGRAM, BLOCK_CI=GROUPED_BLOCK_CI, BLOCK_T=block_t, num_warps=4)


def launch_subpixel_fold(w, out):
    """``out`` [2, 2, C_out, 2, 2, C_in] dense = the subpixel fold of the 3x3
    ``w`` ([C_out, C_in, 3, 3], any strides)."""
    C_out, C_in, KH, KW = w.shape
    if (KH, KW) != (3, 3) or tuple(out.shape) != (2, 2, C_out, 2, 2, C_in) or not out.is_contiguous():
        raise ValueError(f"subpixel fold: a 3x3 weight into a dense [2, 2, C_out, 2, 2, C_in] buffer, got "
                         f"{tuple(w.shape)} -> {tuple(out.shape)}")
    bc = _block_ci(C_in)
    launch(subpixel_fold_kernel, (C_out, cdiv(C_in, bc)), w, out, C_out, C_in, *w.stride(),
           BLOCK_CI=bc, num_warps=4)
    return out
