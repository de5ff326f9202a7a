"""The fused epilogue's one activation table, read by the kernels (their
integer codes, ``kernels/_common.py``) and by the eager fallback alike, so
the two can never drift apart: ``out_scale * act(y + bias + beta * residual)``.
"""

from __future__ import annotations

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


def activation_code(activation: str) -> int:
    try:
        return ACTIVATIONS[activation][0]
    except (KeyError, TypeError):
        raise ValueError(f"activation {activation!r}: expected one of {', '.join(ACTIVATIONS)}") from None


def eager_epilogue(y: torch.Tensor, residual: Optional[torch.Tensor], beta: float,
                   activation: str, out_scale: float) -> torch.Tensor:
    """out_scale * act(y + beta * residual) with PyTorch ops (fallback path)."""
    if residual is not None:
        y = y + residual if beta == 1.0 else torch.add(y, residual, alpha=beta)
    fn = ACTIVATIONS[activation][1]
    if fn is not None:
        y = fn(y)
    if out_scale != 1.0:
        y = y * out_scale
    return y
