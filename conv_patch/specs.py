"""Plain descriptions of a convolution (``ConvSpec``, ``Conv3dSpec``) and of
one call to it (``CallDesc``), and the dtypes the kernels take.

The decision (``conv_patch.routing.decide``) is made from these alone, so it
can be made for a live call, for ``repr``, for the patch report and for the
benchmarks alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Pair = Tuple[int, int]
Pads = Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]

# The dtypes the kernels compute in (fp32 accumulation; fp32 as TF32 where
# PyTorch allows it), and of those the 16-bit ones: the TMA kernels' and
# wgmma's operands, the fused attention's, the tensor-core rate the tables
# measure (one's exact entries serve the other).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def pair(v) -> Pair:
    """An int or a sequence as an (h, w) pair."""
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(i) for i in v)
    return v if len(v) == 2 else (v[0], v[0])


def resolve_padding(padding, kernel: Pair, dilation: Pair) -> Tuple[Pair, Pair]:
    """(top, left) and (bottom, right) padding of a conv's ``padding``
    argument; ``"same"`` puts the odd element of the total at the end, as
    PyTorch does."""
    if padding == "valid":
        return (0, 0), (0, 0)
    if padding == "same":
        total = [dilation[i] * (kernel[i] - 1) for i in range(2)]
        begin = (total[0] // 2, total[1] // 2)
        return begin, (total[0] - begin[0], total[1] - begin[1])
    p = pair(padding)
    return p, p


def conv_geometry(m: nn.Module) -> tuple:
    """``(transposed, stride, dilation, pad_begin, pad_end, output_padding)``
    of a 2-D (transposed) conv module, read from the attributes its own
    forward reads (the kernel size only for a string padding): what a
    torch.compile trace of a patched conv reads, since Dynamo guards every
    value a trace reads."""
    s, d, padding = pair(m.stride), pair(m.dilation), m.padding
    transposed = isinstance(m, nn.ConvTranspose2d)
    begin, end = resolve_padding(padding, pair(m.kernel_size) if isinstance(padding, str) else None, d)
    return transposed, s, d, begin, end, pair(m.output_padding) if transposed else (0, 0)


@dataclass(frozen=True)
class ConvSpec:
    """A 2-D (transposed) convolution's hyper-parameters.

    ``pad_begin``/``pad_end`` are (top, left) and (bottom, right); they differ
    only for ``padding="same"`` with an even total, which the kernels handle
    for free because only the leading pad enters their index arithmetic.
    """

    transposed: bool
    in_channels: int
    out_channels: int
    kernel: Pair
    stride: Pair
    dilation: Pair
    pad_begin: Pair
    pad_end: Pair
    output_padding: Pair
    groups: int
    padding_mode: str
    has_bias: bool

    @property
    def kind(self) -> str:
        return "conv_transpose2d" if self.transposed else "conv2d"

    @property
    def padding_arg(self):
        """The padding ``ops.conv2d`` takes for this conv: (top, left), or
        F.pad's (left, right, top, bottom) where the ends differ (a folded
        pad, like diffusers' Downsample2D's)."""
        if self.pad_begin == self.pad_end:
            return self.pad_begin
        (t, l), (b, r) = self.pad_begin, self.pad_end
        return (l, r, t, b)

    def torch_conv2d(self, x, w, b=None):
        """PyTorch's computation of this (non-transposed) conv: ``F.conv2d``,
        after ``F.pad`` where the ends differ (what benchmarks and the tuner
        compare against)."""
        pad = self.padding_arg
        if len(pad) == 4:
            x, pad = F.pad(x, pad), 0
        return F.conv2d(x, w, b, self.stride, pad, self.dilation)

    def torch_forward(self, x, w, b=None):
        """PyTorch's computation of this conv, transposed ones included (``w``
        as the module holds it): what the torch.compile op falls back to."""
        if self.transposed:
            return F.conv_transpose2d(x, w, b, self.stride, self.pad_begin, self.output_padding, 1,
                                      self.dilation)
        return self.torch_conv2d(x, w, b)

    @classmethod
    def from_module(cls, m: nn.Module) -> "ConvSpec":
        transposed, s, d, begin, end, op = conv_geometry(m)
        return cls(
            transposed=transposed,
            in_channels=int(m.in_channels),
            out_channels=int(m.out_channels),
            kernel=pair(m.kernel_size), stride=s, dilation=d, pad_begin=begin, pad_end=end,
            output_padding=op,
            groups=int(m.groups),
            padding_mode=str(m.padding_mode),
            has_bias=m.bias is not None,
        )

    def output_hw(self, h: int, w: int, output_padding: Optional[Pair] = None) -> Pair:
        k, s, d = self.kernel, self.stride, self.dilation
        if self.transposed:
            op = output_padding if output_padding is not None else self.output_padding
            return tuple(
                ([h, w][i] - 1) * s[i] - self.pad_begin[i] - self.pad_end[i]
                + d[i] * (k[i] - 1) + op[i] + 1
                for i in range(2)
            )
        return tuple(
            ([h, w][i] + self.pad_begin[i] + self.pad_end[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1
            for i in range(2)
        )

    def describe(self) -> str:
        k, s, p, d = self.kernel, self.stride, self.pad_begin, self.dilation
        txt = f"{self.in_channels}->{self.out_channels} k{k[0]}x{k[1]} s{s[0]}x{s[1]} p{p[0]}x{p[1]}"
        if self.pad_end != self.pad_begin:
            txt += f"/{self.pad_end[0]}x{self.pad_end[1]}"
        if d != (1, 1):
            txt += f" d{d[0]}x{d[1]}"
        if self.transposed and self.output_padding != (0, 0):
            txt += f" op{self.output_padding[0]}x{self.output_padding[1]}"
        return txt


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

    @property
    def kind(self) -> str:
        return "conv3d"

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



def layout_of(x: torch.Tensor) -> str:
    """'nchw' for contiguous, 'nhwc' for channels_last or a channel slice
    of a channels_last tensor (``nhwc_pitch``), 'strided' otherwise.
    Tensors that are both (one channel, or 1x1 spatial) count as 'nchw'. A
    5-D one: 'ndhwc' for a channels_last_3d activation, else 'ncdhw'."""
    if x.dim() == 5:
        return "ndhwc" if x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous() \
            else "ncdhw"
    if x.dim() != 4 or x.is_contiguous():
        return "nchw"
    if x.is_contiguous(memory_format=torch.channels_last) or nhwc_pitch(x):
        return "nhwc"
    return "strided"


def nhwc_pitch(x: torch.Tensor) -> int:
    """P where ``x`` ([N, C, H, W]) is NHWC with its pixels P >= C elements
    apart: the channels dense, a pixel row W*P, an image H*W*P. A dense
    NHWC tensor has P = C; a channel slice of one (``buf[:, a:b]`` of a
    channels_last ``buf``: a dense block's channel prefixes, read in place)
    has P = ``buf``'s channel count. 0 for anything else. A size-1
    dimension's stride is not looked at (PyTorch may report any)."""
    if x.dim() != 4:
        return 0
    n, c, h, w = x.shape
    sn, sc, sh, sw = x.stride()
    p = sw if w > 1 else (sh if h > 1 else (sn if n > 1 else c))
    if p < c or (c > 1 and sc != 1) or (h > 1 and sh != w * p) or (n > 1 and sn != h * w * p):
        return 0
    return p


def suggests_channels_last(shape, stride) -> bool:
    """Whether PyTorch's ``suggest_memory_format`` names channels_last for
    a 4-D tensor of these sizes and strides (c10's
    ``is_channels_last_strides_2d``). A size-1 dimension makes the strides
    ambiguous (a one-channel NHWC tensor is also contiguous); PyTorch
    decides those by the order of the strides, a size-1 dimension's
    included, defaulting to contiguous where they tie."""
    if len(shape) != 4 or stride[1] == 0:
        return False
    lower = 0
    for d in (1, 3, 2, 0):
        if shape[d] == 0 or stride[d] < lower:
            return False
        # N111 with equal strides, or a W-sliced N11W: contiguous.
        if d == 0 and lower == stride[1]:
            return False
        lower = stride[d] * shape[d] if shape[d] > 1 else stride[d]
    return True


def needs_grad(*tensors) -> bool:
    """Autograd would record this call: grad mode on and a tensor (``None``
    allowed) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclass(frozen=True)
class CallDesc:
    """What the decision needs to know about one call. Beside the tensors'
    facts: ``epilogue``, the eager ops its fused epilogue stands for;
    ``graph``, whether it runs on a CUDA graph's path (only GPU time counts
    there); ``packed``, whether its weight is refreshed into a pack at every
    call; for a Conv3d call its cached frames (count, layout, dtype), its
    output's elements, and whether autocast is on; ``pitch``, the pixel
    stride of an NHWC input that is a channel slice (``nhwc_pitch``; 0 where
    the input is dense); ``weight_dense``, whether the weight is dense in
    its own [C_out, C_in, KH, KW] order (a route may read it in place);
    ``out_flat``, whether a given 4-D output's pixels are one run per
    channel (it views as [N, C, 1, H*W])."""

    shape: tuple
    dtype: torch.dtype
    device_type: str
    layout: str
    needs_grad: bool = False
    weight_dtype: Optional[torch.dtype] = None
    same_device: bool = True
    bias_dtype: Optional[torch.dtype] = None
    output_padding: Optional[Pair] = None
    compiling: bool = False
    aligned16: bool = True
    epilogue: int = 0
    graph: bool = False
    packed: bool = False
    residual_dtype: Optional[torch.dtype] = None
    cache_frames: int = 0
    cache_layout: Optional[str] = None
    cache_dtype: Optional[torch.dtype] = None
    out_numel: int = 0
    cast: bool = False
    pitch: int = 0
    weight_dense: bool = False
    out_flat: bool = True

    @classmethod
    def of_call(cls, x, weight, bias=None, residual=None, output_padding=None, *, cache=None, epilogue: int = 0,
                graph: bool = False, packed: bool = False, out_numel: int = 0, cast: bool = False,
                out=None) -> "CallDesc":
        grad = needs_grad(x, weight, bias, residual, cache)
        same = all(t is None or t.device == x.device for t in (weight, bias, residual, cache))
        # (Every tensor a kernel may read or write through a TMA descriptor,
        # whose base address must be 16-byte aligned: a caller's ``out`` or
        # residual may be a view into a larger buffer.)
        aligned = all(t is None or t.data_ptr() % 16 == 0 for t in (x, weight, cache, residual, out))
        pitch = nhwc_pitch(x) if x.dim() == 4 else 0
        return cls(
            shape=tuple(x.shape), dtype=x.dtype, device_type=x.device.type,
            layout=layout_of(x), needs_grad=bool(grad), weight_dtype=weight.dtype,
            same_device=same, bias_dtype=None if bias is None else bias.dtype,
            output_padding=output_padding, compiling=torch.compiler.is_compiling(), aligned16=aligned,
            epilogue=epilogue, graph=graph, packed=packed,
            residual_dtype=None if residual is None else residual.dtype,
            cache_frames=0 if cache is None else cache.shape[2], cache_layout=None if cache is None else layout_of(cache),
            cache_dtype=None if cache is None else cache.dtype, out_numel=out_numel, cast=cast,
            pitch=pitch if pitch != x.shape[1] else 0, weight_dense=weight.is_contiguous(),
            out_flat=out is None or out.dim() != 4 or _flat_pixels(out),
        )


def _flat_pixels(t) -> bool:
    """``t`` [N, C, H, W] views as [N, C, 1, H*W]."""
    return t.shape[2] <= 1 or t.shape[3] <= 1 or t.stride(2) == t.shape[3] * t.stride(3)
