"""The torch-facing Conv3d: the functional op (``conv3d``, re-exported by
``conv_patch.functional``), the argument checks and output shape, the conv's
description (``Conv3dSpec``) and the one kernel launch both the op and the
dispatch core (``dispatch.conv3d``) use. The kernel is kernels/conv3d.py.

A video VAE's causal conv pads time at the front only and puts the frames
cached from the previous chunk in front of the new one; here both are
arguments (``time_padding=(front, back)``, ``cache``) that the kernel reads
in place, so neither the concatenation nor the padded tensor is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.routing import tables as config_tables
from conv_patch.ops.conv2d import check_residual, kernels
from conv_patch.activations import activation_code, eager_epilogue
from conv_patch.specs import needs_grad
from conv_patch.target import Target, dot_precision, target_for

Pads = Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]

# Tiles of the conv3d kernel, until the route tables have conv3d entries:
# the sm90 table's most frequent 2-D implicit-GEMM tile, and under the
# interpreter its table's one large tile (there the fewest programs win).
CONV3D_TILES = {
    "gpu": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
    "interpreter": {"BLOCK_M": 1024, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
                    "num_stages": 1},
}
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triple(value, name: str) -> tuple:
    if isinstance(value, int):
        value = (value,) * 3
    if not (isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(v, int) for v in value)):
        raise ValueError(f"conv3d: {name} {value!r}: expected an int or 3 ints (t, h, w)")
    if min(value) < 1:
        raise ValueError(f"conv3d: {name} {tuple(value)}: must be >= 1")
    return tuple(int(v) for v in value)


def _front_back(value, what: str) -> tuple:
    if isinstance(value, int):
        value = (value, value)
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise ValueError(f"conv3d: {what} {value!r}: expected an int or a (front, back) pair")
    if min(value) < 0:
        raise ValueError(f"conv3d: {what} {tuple(value)}: negative padding")
    return int(value[0]), int(value[1])


def conv3d_padding(padding, time_padding=None) -> Pads:
    """``((front, back),) * 3`` per axis (t, h, w) from ``conv3d``'s
    ``padding`` and ``time_padding`` arguments."""
    if isinstance(padding, int):
        padding = (padding,) * 3
    if not (isinstance(padding, (tuple, list)) and len(padding) == 3):
        raise ValueError(f"conv3d: padding {padding!r}: expected an int or 3 entries (t, h, w)")
    pads = [_front_back(p, "padding") for p in padding]
    if time_padding is not None:
        pads[0] = _front_back(time_padding, "time_padding")
    return tuple(pads)


@dataclass(frozen=True)
class Conv3dSpec:
    """A Conv3d's hyper-parameters; ``pads`` is (front, back) per axis
    (t, h, w): a causal conv's time entry is (front, 0)."""

    in_channels: int
    out_channels: int
    kernel: Tuple[int, int, int]
    stride: Tuple[int, int, int]
    dilation: Tuple[int, int, int]
    pads: Pads
    groups: int
    padding_mode: str
    has_bias: bool

    @classmethod
    def from_module(cls, m: nn.Conv3d, pads: Optional[Pads] = None) -> "Conv3dSpec":
        """``pads`` replaces the module's own ``padding`` (a causal conv
        pads in its forward, not through ``padding``)."""
        if pads is None:
            if isinstance(m.padding, str):
                # "same"/"valid": what PyTorch pads, the odd element at the end.
                total = [d * (k - 1) for d, k in zip(m.dilation, m.kernel_size)] if m.padding == "same" else [0] * 3
                pads = tuple((t // 2, t - t // 2) for t in total)
            else:
                pads = tuple((int(p), int(p)) for p in m.padding)
        return cls(int(m.in_channels), int(m.out_channels), tuple(m.kernel_size), tuple(m.stride),
                   tuple(m.dilation), pads, int(m.groups), str(m.padding_mode), m.bias is not None)

    def describe(self) -> str:
        """``96->96 k3x3x3 s1x1x1 p2/0x1x1``: per axis the padding, front/back
        where they differ (a causal conv's time axis)."""
        k, s, d = self.kernel, self.stride, self.dilation
        pads = "x".join(str(f) if f == b else f"{f}/{b}" for f, b in self.pads)
        txt = f"{self.in_channels}->{self.out_channels} k{k[0]}x{k[1]}x{k[2]} s{s[0]}x{s[1]}x{s[2]} p{pads}"
        if d != (1, 1, 1):
            txt += f" d{d[0]}x{d[1]}x{d[2]}"
        return txt

    def problem(self) -> Optional[str]:
        """Why the kernel never takes this conv (whatever the call), or None."""
        if self.groups != 1:
            return f"groups={self.groups}"
        if self.padding_mode != "zeros":
            return f"padding_mode={self.padding_mode!r}"
        return None


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


def kernel_target(x, weight, bias, cache, residual, out) -> Tuple[Optional[Target], str]:
    """(the target the kernel can run this call on, "") or (None, why not:
    PyTorch computes the call then)."""
    if torch.compiler.is_compiling():
        return None, "traced by torch.compile"
    if needs_grad(x, weight, bias, cache, residual):
        return None, "autograd (the kernels compute no backward)"
    if x.numel() == 0:
        return None, "empty input"
    target = target_for(x.device)
    if not target.kernels:
        return None, target.reason or f"no kernels on {x.device}"
    if x.dtype not in KERNEL_DTYPES:
        return None, f"{x.dtype} input"
    if not all(t is None or (t.device == x.device and t.dtype == x.dtype)
               for t in (weight, bias, cache, residual, out)):
        return None, "the weight, bias, cache, residual or output differ from the input in device or dtype"
    return target, ""


def run_kernel(x, weight, bias, cache, pads, stride, dilation, target, *, residual=None, beta=1.0,
               activation="none", out_scale=1.0, out=None, config=None, force_int64=False):
    """The kernel's call (arguments checked by the caller, ``output_shape``):
    into ``out`` or a new output in the input's layout."""
    k = kernels()
    if out is None:
        cl = any(t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous()
                 for t in (x, weight))
        out = k.empty(output_shape(x, weight, bias, cache, stride, pads, dilation), dtype=x.dtype,
                      device=x.device, memory_format=torch.channels_last_3d if cl else torch.contiguous_format)
    tiles = config if config is not None else CONV3D_TILES["interpreter" if target.interpreter else "gpu"]
    launcher = k.launch_conv3d
    if tiles.get("route") == "tma":
        # The TMA kernel boxes the weight as dense [C_out, KT, KH, KW, C_in]:
        # a module's NCDHW weight is repacked per call (a copy of the weight,
        # small beside a video conv's activations; measured with the call).
        if not weight.is_contiguous(memory_format=torch.channels_last_3d):
            weight = weight.contiguous(memory_format=torch.channels_last_3d)
        problem = k.conv3d_tma_problem(x, cache, weight, stride, target.interpreter)
        if problem:
            raise ValueError(f"conv3d: the tma route cannot take this call: {problem}")
        launcher = k.launch_conv3d_tma
    return launcher(x, cache, weight, bias, out, residual, stride=stride,
                           padding=tuple(p[0] for p in pads), dilation=dilation, beta=beta,
                           activation=activation_code(activation), out_scale=out_scale, config=tiles,
                           precision=dot_precision(x.dtype, target), upcast=target.interpreter,
                           force_int64=force_int64)


def _layout_of(x) -> torch.memory_format:
    return torch.channels_last_3d if config_tables.conv3d_layout(x) == "ndhwc" else torch.contiguous_format


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
    from conv_patch.ops.conv2d import epilogue
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


def conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1, *, cache=None, time_padding=None,
           residual=None, beta=1.0, activation="none", out_scale=1.0, out=None, route=None, config=None,
           force_int64=False):
    """``out_scale * act(F.conv3d(pad(cat([cache, x], 2)), weight, bias, stride, 0, dilation) + beta * residual)``
    in one kernel, groups = 1, the concatenation and the padding never written.

    ``x`` is [N, C, T, H, W] in any strides (NCDHW and channels_last_3d
    alike); ``cache`` (optional) [N, C, Tc, H, W], the frames that precede
    ``x`` in time (a causal video VAE's cached frames), read in place.
    ``padding`` is, per axis (t, h, w), an int (both ends) or a
    ``(front, back)`` pair; a single int pads every axis at both ends, as
    F.conv3d does. ``time_padding=(front, back)`` replaces padding's time
    entry: a causal conv is ``padding=(0, 1, 1), time_padding=(2, 0)``
    (front only) for a 3x3x3 kernel. The output size follows from the padded,
    concatenated input. ``out`` may be a preallocated output of any
    strides. Where no kernel runs (no GPU and no interpreter, float64,
    autograd, mixed devices or dtypes) PyTorch computes the same expression.
    ``route``: None (the kernel under the interpreter; PyTorch on a GPU,
    where only the dispatch core's measured table entries say when the
    kernel beats cuDNN), "kernel" (the kernel wherever it can run) or
    "pytorch". ``config`` overrides the tile; with ``"route": "tma"`` it runs
    the sm90 TMA kernel (kernels/conv3d_tma.py: fp16/bf16, dense NDHWC input
    and cache, H and W at stride 1; ValueError otherwise). ``force_int64``
    forces 64-bit offsets (tests). Raises ValueError for groups > 1 and ill-shaped
    arguments."""
    if route not in (None, "kernel", "pytorch"):
        raise ValueError(f"conv3d: route {route!r}: expected None, 'kernel' or 'pytorch'")
    activation_code(activation)
    stride, dilation = _triple(stride, "stride"), _triple(dilation, "dilation")
    pads = conv3d_padding(padding, time_padding)
    shape = output_shape(x, weight, bias, cache, stride, pads, dilation)
    check_residual(residual, shape)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"conv3d: out has shape {tuple(out.shape)}, the convolution's output is {shape}")
    target = None if route == "pytorch" else kernel_target(x, weight, bias, cache, residual, out)[0]
    if target is not None and not target.interpreter and route is None:
        target = None
    if target is None:
        y = eager_epilogue(torch_conv3d(x, weight, bias, cache, pads, stride, dilation), residual, beta,
                           activation, out_scale)
        return out.copy_(y) if out is not None else y
    return run_kernel(x, weight, bias, cache, pads, stride, dilation, target, residual=residual, beta=beta,
                      activation=activation, out_scale=out_scale, out=out, config=config,
                      force_int64=force_int64)
