"""The fused epilogue's one activation table, read by the kernels (their
integer codes, ``kernels/common.py``) and by the eager fallback alike, so
the two can never drift apart: ``out_scale * act(y + bias + beta * residual)``.

Besides the named activations, PReLU (``ChannelSlopes``: an ``nn.PReLU``'s
slopes, one per channel or one for all) for the conv epilogues only: its
kernels read the bias and the slopes from one [C, 2] fp32 buffer
(``ChannelSlopes.params``) where the others read the bias, so no kernel
takes an argument more. The norm kernels have no channel vector to read it
from: ``activation_code`` refuses it unless the caller is a conv epilogue.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from conv_patch.buffers import persistent


def _gelu_tanh(y):
    return F.gelu(y, approximate="tanh")


# name -> (kernel code, eager function); code 0 is the identity.
ACTIVATIONS: Dict[str, Tuple[int, Optional[Callable]]] = {
    "none": (0, None),
    "relu": (1, F.relu),
    "silu": (2, F.silu),
    "gelu": (3, F.gelu),
    "gelu_tanh": (4, _gelu_tanh),
}
CODES = {name: code for name, (code, _) in ACTIVATIONS.items()}
# PReLU's code: a ``ChannelSlopes``, never a name (its slopes are tensors).
PRELU_CODE = 5

# LeakyReLU, one entry per negative slope: ``"leaky_relu"`` (PyTorch's
# default slope, 0.01) and ``"leaky_relu_<slope>"`` (``"leaky_relu_0.2"``,
# ESRGAN's). The kernels' code carries the slope in thousandths
# (``LEAKY_BASE + 200`` for 0.2; a compile-time constant like the other
# codes, so no kernel takes an argument more), hence slopes in [0, 1) that
# are whole thousandths; any other is no activation of this table.
LEAKY = "leaky_relu"
LEAKY_BASE = 1000
LEAKY_STEPS = 1000


def leaky_relu(slope: float) -> Optional[str]:
    """The table's name of LeakyReLU with ``negative_slope`` ``slope``, or
    None where the kernels cannot carry that slope."""
    steps = round(slope * LEAKY_STEPS)
    if not 0 <= steps < LEAKY_STEPS or steps / LEAKY_STEPS != slope:
        return None
    return LEAKY if steps == 10 else f"{LEAKY}_{steps / LEAKY_STEPS:g}"


def _leaky_slope(activation) -> Optional[float]:
    if activation == LEAKY:
        return 0.01
    if not isinstance(activation, str) or not activation.startswith(LEAKY + "_"):
        return None
    try:
        slope = float(activation[len(LEAKY) + 1:])
    except ValueError:
        return None
    return slope if leaky_relu(slope) is not None else None


class ChannelSlopes:
    """PReLU with the slopes of ``module`` (an ``nn.PReLU``: one slope per
    channel, or one for all), read at every call, as an epilogue
    activation. Equal (and hashing alike) for the same module, so a plan
    keyed on it holds while the module does; callable as the eager
    fallback (``F.prelu``: the channel is dim 1)."""

    __slots__ = ("module", "_buf")

    def __init__(self, module):
        self.module = module
        self._buf = None

    def __eq__(self, other):
        return type(other) is ChannelSlopes and other.module is self.module

    def __hash__(self):
        return id(self.module)

    def __repr__(self) -> str:
        return f"prelu[{self.module.weight.numel()}]"

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return F.prelu(y, self.module.weight)

    def fits(self, channels: int) -> bool:
        """Whether the slopes apply to a ``channels``-channel output."""
        return self.module.weight.dim() == 1 and self.module.weight.numel() in (1, channels)

    def params(self, bias: Optional[torch.Tensor], channels: int, device) -> torch.Tensor:
        """The kernels' [channels, 2] (bias, slope) buffer, rewritten from
        the bias and the slopes at every call (never trusted to be fresh, as
        the weight packs are not: conv_patch/runtime/pack.py) in one launch:
        in the dtype the bias and the slopes share (the kernels read it in
        fp32, an exact widening), else fp32. Kept between calls, so a
        recorded launch replays on it and a CUDA graph captures its refresh.
        The casts and the stack into an fp32 buffer were three launches and
        two allocations a call: a third of a PReLU conv's host time on an
        upscaler's body (docs/performance.md)."""
        slopes = self.module.weight.detach()
        # (The slopes, and the bias where there is one, on the buffer's device in one dtype.)
        same = slopes.device == device and (bias is None or (bias.dtype == slopes.dtype and bias.device == device))
        dtype = slopes.dtype if same else torch.float32
        held = self._buf
        # (Without a bias the zeros written at allocation are the bias
        # column: a buffer a biased call wrote is not reused for that.)
        key = (channels, device, bias is None, dtype)
        if held is None or held[0] != key:
            held = self._buf = (key, persistent(torch.zeros, (channels, 2), dtype=dtype, device=device))
        buf = held[1]
        if bias is None:
            buf[:, 1].copy_(slopes.expand(channels))
        elif same:
            torch.stack((bias.detach(), slopes.expand(channels)), 1, out=buf)
        else:
            torch.stack((bias.detach().float(), slopes.float().expand(channels)), 1, out=buf)
        return buf


def _expected() -> str:
    return f"expected one of {', '.join(ACTIVATIONS)}, {LEAKY} or {LEAKY}_<slope> (0 <= slope < 1, in thousandths)"


def _entry(activation) -> Tuple[int, Optional[Callable]]:
    if type(activation) is ChannelSlopes:
        return PRELU_CODE, activation
    entry = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if entry is not None:
        return entry
    slope = _leaky_slope(activation)
    if slope is None:
        raise ValueError(f"activation {activation!r}: {_expected()}")
    return LEAKY_BASE + round(slope * LEAKY_STEPS), functools.partial(F.leaky_relu, negative_slope=slope)


def activation_code(activation, per_channel: bool = False) -> int:
    """The kernels' code of ``activation``; ValueError naming the table for
    a name it does not hold, and for PReLU unless ``per_channel`` (the
    caller is a conv epilogue, which reads the slopes with the bias)."""
    if type(activation) is ChannelSlopes and not per_channel:
        raise ValueError(f"activation {activation!r}: per-channel slopes are for conv epilogues only; {_expected()}")
    return _entry(activation)[0]


def per_channel(activation) -> bool:
    """Whether ``activation`` reads a vector per channel (PReLU): the
    kernels then read ``activation.params(bias, ...)`` as their bias."""
    return type(activation) is ChannelSlopes


def activation_fn(activation: str) -> Optional[Callable]:
    """The eager function of ``activation`` (None for ``"none"``): what the
    fallback computes where the kernel's code computes it."""
    return _entry(activation)[1]


def eager_epilogue(y: torch.Tensor, residual: Optional[torch.Tensor], beta: float,
                   activation: str, out_scale: float) -> torch.Tensor:
    """out_scale * act(y + beta * residual) with PyTorch ops (fallback path)."""
    if residual is not None:
        y = y + residual if beta == 1.0 else torch.add(y, residual, alpha=beta)
    fn = activation_fn(activation)
    if fn is not None:
        y = fn(y)
    if out_scale != 1.0:
        y = y * out_scale
    return y
