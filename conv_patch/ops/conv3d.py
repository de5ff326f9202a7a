"""The Conv3d ops a route runs: the kernel's launch (``run_kernel``, the
output in the input's layout), the cuDNN route (``cudnn_conv3d``: PyTorch's
conv3d with fewer copies than a causal module's own forward, the bias and
epilogue as one pass on NDHWC), PyTorch's own computation of a call
(``torch_conv3d``), and the output shape and argument checks they share.
The kernels are kernels/conv3d.py and kernels/conv3d_tma.py.

A video VAE's causal conv pads time at the front only and puts the frames
cached from the previous chunk in front of the new one; here both are
arguments (``pads``: (front, back) per axis, and ``cache``) that the kernel
reads in place, so neither the concatenation nor the padded tensor is
written.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.activations import activation_code, eager_epilogue
from conv_patch.ops.epilogue import epilogue
from conv_patch.ops.loader import kernels
from conv_patch.routing.registry import Route, launcher_of
from conv_patch.specs import layout_of
from conv_patch.target import Target, dot_precision

# Tiles of the conv3d kernel where no table entry gives them (a given
# call of the functional op): the sm90 table's most frequent 2-D
# implicit-GEMM tile, and under the interpreter its table's one large tile
# (there the fewest programs win).
CONV3D_TILES = {
    "gpu": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
    "interpreter": {"BLOCK_M": 1024, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
                    "num_stages": 1},
}


def output_shape(x, weight, bias, cache, stride, pads, dilation) -> tuple:
    """The output shape, or a one-line ValueError for a call F.conv3d
    (after the concatenation) would reject or this op does not take."""
    if x.dim() != 5 or weight.dim() != 5:
        raise ValueError(f"conv3d: needs a 5-D input [N, C, T, H, W] and weight [C_out, C_in, KT, KH, KW], "
                         f"got input {tuple(x.shape)} and weight {tuple(weight.shape)}")
    n, c, t, h, w = x.shape
    c_out, c_w = weight.shape[:2]
    if c_w != c:
        if c_w > 0 and c % c_w == 0:
            raise ValueError(f"conv3d: weight {tuple(weight.shape)} on {c} input channels means groups = "
                             f"{c // c_w}; only groups = 1 is supported")
        raise ValueError(f"conv3d: weight {tuple(weight.shape)} expects {c_w} input channels, the input has {c}")
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise ValueError(f"conv3d: bias has shape {tuple(bias.shape)}, expected ({c_out},)")
    if cache is not None:
        if cache.dim() != 5 or (cache.shape[0], cache.shape[1], cache.shape[3], cache.shape[4]) != (n, c, h, w):
            raise ValueError(f"conv3d: cache has shape {tuple(cache.shape)}, expected [{n}, {c}, Tc, {h}, {w}]")
        if cache.dtype != x.dtype or cache.device != x.device:
            raise ValueError(f"conv3d: cache is {cache.dtype} on {cache.device}, the input {x.dtype} on {x.device}")
        t += cache.shape[2]
    size = []
    for extent, (front, back), k, s, d in zip((t, h, w), pads, weight.shape[2:], stride, dilation):
        span = extent + front + back - d * (k - 1) - 1
        if span < 0:
            raise ValueError(f"conv3d: kernel {tuple(weight.shape[2:])} (dilation {dilation}) is larger than the "
                             f"padded input {(t, h, w)} (padding {pads})")
        size.append(span // s + 1)
    return (n, c_out, *size)


def run_kernel(route: Route, config: Optional[dict], target: Target, x, weight, bias, cache, pads, stride,
               dilation, *, residual=None, beta=1.0, activation="none", out_scale=1.0, out=None,
               force_int64=False):
    """Launch kernel route ``route`` (arguments checked by the caller,
    ``output_shape``; ``weight`` in the layout the route reads:
    ``runtime.pack.route_weight``), with tile ``config`` (None: the default
    tile): into ``out`` or a new output in the input's layout."""
    k = kernels()
    if out is None:
        cl = any(t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous()
                 for t in (x, weight))
        out = k.empty(output_shape(x, weight, bias, cache, stride, pads, dilation), dtype=x.dtype,
                      device=x.device, memory_format=torch.channels_last_3d if cl else torch.contiguous_format)
    tiles = config if config is not None else CONV3D_TILES["interpreter" if target.interpreter else "gpu"]
    return launcher_of(route)(x, cache, weight, bias, out, residual, stride=stride,
                              padding=tuple(p[0] for p in pads), dilation=dilation, beta=beta,
                              activation=activation_code(activation), out_scale=out_scale, config=tiles,
                              precision=dot_precision(x.dtype, target), upcast=target.interpreter,
                              force_int64=force_int64)


def _layout_of(x) -> torch.memory_format:
    return torch.channels_last_3d if layout_of(x) == "ndhwc" else torch.contiguous_format


def join_frames(pieces, fmt) -> torch.Tensor:
    """``torch.cat(pieces, dim=2)`` written in layout ``fmt`` (the input's),
    whatever layout each piece has: a cache sliced from an NCDHW chunk in
    front of an NDHWC input would otherwise make the joined frames, and so
    the conv's output, NCDHW."""
    if len(pieces) == 1:
        return pieces[0]
    n, c, _, h, w = pieces[-1].shape
    out = torch.empty((n, c, sum(p.shape[2] for p in pieces), h, w), dtype=pieces[-1].dtype,
                      device=pieces[-1].device, memory_format=fmt)
    return torch.cat(pieces, dim=2, out=out)


def torch_conv3d(x, weight, bias, cache, pads, stride, dilation):
    """PyTorch's computation of the call: the concatenation, F.pad, F.conv3d
    (the output in the input's layout)."""
    full = x if cache is None else join_frames([cache, x], _layout_of(x))
    (t0, t1), (h0, h1), (w0, w1) = pads
    if any((t0, t1, h0, h1, w0, w1)):
        full = F.pad(full, (w0, w1, h0, h1, t0, t1))
    return F.conv3d(full, weight, bias, stride, 0, dilation)


def cudnn_conv3d(x, weight, bias, cache, pads, stride, dilation, *, residual=None, beta=1.0, activation="none",
                 out_scale=1.0):
    """The call through PyTorch's conv3d with fewer copies than a causal
    module's own forward (``torch_conv3d``'s three: the concatenation, F.pad
    writing the whole padded input, cuDNN's separate bias add): the frames of
    time padding, the cached frames and the input in one concatenation (none
    where there is only the input), the padding both sides share passed to
    the conv (cuDNN pads without a copy), only an odd remainder F.pad's. On
    a channels_last_3d output the bias, residual, activation and scale run as
    one pass of the epilogue kernel (PyTorch's own bias add is an
    unvectorised pass on NDHWC); elsewhere PyTorch's ops."""
    (t0, t1), (h0, h1), (w0, w1) = pads
    sym = (min(t0, t1), min(h0, h1), min(w0, w1))
    t0, t1 = t0 - sym[0], t1 - sym[0]
    fmt = _layout_of(x)
    ndhwc = fmt == torch.channels_last_3d
    n, c, _, h, w = x.shape
    pieces = [x] if cache is None else [cache, x]
    if t0:
        pieces.insert(0, torch.empty((n, c, t0, h, w), dtype=x.dtype, device=x.device, memory_format=fmt).zero_())
    if t1:
        pieces.append(torch.empty((n, c, t1, h, w), dtype=x.dtype, device=x.device, memory_format=fmt).zero_())
    full = join_frames(pieces, fmt)
    rest = (w0 - sym[2], w1 - sym[2], h0 - sym[1], h1 - sym[1])
    if any(rest):
        full = F.pad(full, rest)
    if not ndhwc or (bias is None and residual is None and activation == "none" and out_scale == 1.0):
        return eager_epilogue(F.conv3d(full, weight, bias, stride, sym, dilation), residual, beta, activation,
                              out_scale)
    y = F.conv3d(full, weight, None, stride, sym, dilation)
    if not y.is_contiguous(memory_format=torch.channels_last_3d):
        y = y if bias is None else y + bias.view(-1, 1, 1, 1)
        return eager_epilogue(y, residual, beta, activation, out_scale)
    # [N, C, T*H, W] channels_last views: the epilogue kernel's layout.
    y4 = y.flatten(2, 3)
    epilogue(y4, bias, None if residual is None else residual.flatten(2, 3), beta, activation, out_scale, out=y4)
    return y
