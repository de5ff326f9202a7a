"""NCHW -> NHWC staging copies for the TMA routes.

Layer 1 (``nchw_to_nhwc_kernel``), layer 2 (``launch_nchw_to_nhwc``). The TMA
kernel cannot box an NCHW input (see conv2d_tma.py), so an NCHW activation is
copied once into NHWC. PyTorch's own ``x.contiguous(memory_format=
torch.channels_last)`` moved 256 channels at 1024^2 in ~4 ms on the H200
(~130 GB/s), slower than the convolution it feeds; this tiled transpose
reads along the pixels and writes along the channels, each side coalesced
(Triton stages the tile through shared memory between the two).

``pad_nhwc_kernel`` / ``launch_pad_nhwc``: the padded TMA route's staging
copy (conv2d_tma_padded.py), NCHW or NHWC in, a zero-bordered NHWC buffer
out, the border written in the same pass.
"""

import triton
import triton.language as tl

from .common import INTERPRET, PAD_EXTENTS  # noqa: F401  (INTERPRET: fixed before this module's decorations)
from .launch import cdiv, empty, launch


@triton.jit
def nchw_to_nhwc_kernel(x_ptr, y_ptr, C, HW, sxn, sxc,
                        BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    pid_p = tl.program_id(0)
    pid_c = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    # int64 throughout: one image alone can pass 2**31 elements, and the
    # kernel is bound by memory, not by address arithmetic.
    offs_p = pid_p.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_c[:, None] < C) & (offs_p[None, :] < HW)
    tile = tl.load(x_ptr + n * sxn + offs_c[:, None] * sxc + offs_p[None, :], mask=mask)
    tl.store(y_ptr + n * HW * C + offs_p[None, :] * C + offs_c[:, None], tile, mask=mask)


def launch_nchw_to_nhwc(x, out, block_c=64, block_p=64):
    """``x``: [N, C, H, W] with unit stride over H*W (contiguous NCHW);
    ``out``: a dense channels_last tensor of the same shape."""
    N, C, H, W = x.shape
    grid = (cdiv(H * W, block_p), cdiv(C, block_c), N)
    launch(nchw_to_nhwc_kernel, grid, x, out, C, H * W, x.stride(0), x.stride(1),
           BLOCK_C=block_c, BLOCK_P=block_p, num_warps=4)
    return out


@triton.jit(do_not_specialize=PAD_EXTENTS)
def pad_nhwc_kernel(x_ptr, y_ptr, C, H, W, HP, WP, PT, PL, sxn, sxc, sxh, sxw,
                    X_NHWC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """y[n, r, c, :] = x[n, :, r - PT, c - PL] inside the image, 0 in the
    border: every element of the padded buffer written once."""
    pid_p = tl.program_id(0)
    pid_c = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    offs_p = pid_p.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = offs_p // WP
    ih = r - PT
    iw = offs_p - r * WP - PL
    inside = (offs_p < HP * WP) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    c_ok = offs_c < C
    src = x_ptr + n * sxn + ih * sxh + iw * sxw
    if X_NHWC:
        # Channels innermost in the input: the tile is [pixels, channels],
        # both sides read and written along the channels.
        tile = tl.load(src[:, None] + offs_c[None, :], mask=inside[:, None] & c_ok[None, :], other=0.0)
        tl.store(y_ptr + n * HP * WP * C + offs_p[:, None] * C + offs_c[None, :], tile,
                 mask=(offs_p < HP * WP)[:, None] & c_ok[None, :])
    else:
        tile = tl.load(src[None, :] + offs_c[:, None] * sxc, mask=c_ok[:, None] & inside[None, :], other=0.0)
        tl.store(y_ptr + n * HP * WP * C + offs_p[None, :] * C + offs_c[:, None], tile,
                 mask=c_ok[:, None] & (offs_p < HP * WP)[None, :])


def launch_pad_nhwc(x, pt, pb, pl, pr, block_c=64, block_p=64):
    """A dense [N, H + pt + pb, W + pl + pr, C] copy of ``x`` ([N, C, H, W],
    channels_last or with unit stride along W) with zeros in the border."""
    N, C, H, W = x.shape
    if x.stride(1) != 1 and x.stride(3) != 1:
        x = x.contiguous()
    HP, WP = H + pt + pb, W + pl + pr
    y = empty((N, HP, WP, C), dtype=x.dtype, device=x.device)
    x_nhwc = x.stride(1) == 1 and C > 1
    grid = (cdiv(HP * WP, block_p), cdiv(C, block_c), N)
    launch(pad_nhwc_kernel, grid, x, y, C, H, W, HP, WP, pt, pl, *x.stride(),
           X_NHWC=x_nhwc, BLOCK_C=block_c, BLOCK_P=block_p, num_warps=4)
    return y
