"""Plain descriptions of a convolution and of one call to it.

The router (``conv_patch.routing.select``) decides from these alone, so the same
decision can be made for a live call, for ``repr``, for the patch report and
for the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Pair = Tuple[int, int]


def _pair(v) -> Pair:
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
    p = _pair(padding)
    return p, p


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
        k, s, d = _pair(m.kernel_size), _pair(m.stride), _pair(m.dilation)
        transposed = isinstance(m, nn.ConvTranspose2d)
        begin, end = resolve_padding(m.padding, k, d)
        return cls(
            transposed=transposed,
            in_channels=int(m.in_channels),
            out_channels=int(m.out_channels),
            kernel=k, stride=s, dilation=d, pad_begin=begin, pad_end=end,
            output_padding=_pair(getattr(m, "output_padding", 0)) if transposed else (0, 0),
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


def layout_of(x: torch.Tensor) -> str:
    """'nchw' for contiguous, 'nhwc' for channels_last, 'strided' otherwise.
    Tensors that are both (one channel, or 1x1 spatial) count as 'nchw'."""
    if x.dim() != 4 or x.is_contiguous():
        return "nchw"
    if x.is_contiguous(memory_format=torch.channels_last):
        return "nhwc"
    return "strided"


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
    """What the router needs to know about one call."""

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

    @classmethod
    def of_call(cls, x, weight, bias=None, residual=None, output_padding=None) -> "CallDesc":
        grad = needs_grad(x, weight, bias, residual)
        same = weight.device == x.device and (bias is None or bias.device == x.device) and (
            residual is None or residual.device == x.device)
        return cls(
            shape=tuple(x.shape), dtype=x.dtype, device_type=x.device.type,
            layout=layout_of(x), needs_grad=bool(grad), weight_dtype=weight.dtype,
            same_device=same, bias_dtype=None if bias is None else bias.dtype,
            output_padding=output_padding, compiling=torch.compiler.is_compiling(),
            aligned16=x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0,
        )
