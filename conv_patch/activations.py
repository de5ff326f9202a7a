"""The fused epilogue's one activation table, read by the kernels (their
integer codes, ``kernels/common.py``) and by the eager fallback alike, so
the two can never drift apart: ``out_scale * act(y + bias + beta * residual)``.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F


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


def _expected() -> str:
    return f"expected one of {', '.join(ACTIVATIONS)}, {LEAKY} or {LEAKY}_<slope> (0 <= slope < 1, in thousandths)"


def _entry(activation) -> Tuple[int, Optional[Callable]]:
    entry = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if entry is not None:
        return entry
    slope = _leaky_slope(activation)
    if slope is None:
        raise ValueError(f"activation {activation!r}: {_expected()}")
    return LEAKY_BASE + round(slope * LEAKY_STEPS), functools.partial(F.leaky_relu, negative_slope=slope)


def activation_code(activation: str) -> int:
    """The kernels' code of ``activation``; ValueError naming the table for
    a name it does not hold."""
    return _entry(activation)[0]


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
