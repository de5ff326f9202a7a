"""A VAE encoder's or decoder's layers as a recipe declares them for a call
in row bands (``Recipe.bands``): the band decoder (``conv_patch.parallel``)
runs these layer by layer over all bands; it knows no model family itself.

``Conv`` is any conv with its padding over the whole image (an F.pad folded
in: the stride-2 downsample), ``Resnet`` the resnet block, ``Up`` nearest x2
then a 3x3 conv, ``Whole`` a module that must see every row at once (the
attention), ``NormConv`` GroupNorm, SiLU and a conv (the tail).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from torch import nn
from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)


class UnsupportedModel(ValueError):
    """The module is not an encoder or decoder whose layers a recipe declares
    (its structure differs from what the recipes recognise)."""


def need(ok: bool, what: str) -> None:
    if not ok:
        raise UnsupportedModel(f"bands: {what}")


def own_pad(m: nn.Conv2d) -> Tuple[int, int, int, int]:
    """A conv's own padding in F.pad order (left, right, top, bottom)."""
    ph, pw = m.padding
    return (pw, pw, ph, ph)


def plus(a, b):
    return tuple(x + y for x, y in zip(a, b))


@dataclasses.dataclass
class Conv:
    """A conv over the whole image with padding ``pad`` (F.pad order: the
    module's own plus a folded F.pad)."""

    m: nn.Conv2d
    pad: Tuple[int, int, int, int]

    def out_hw(self, h: int, w: int) -> Tuple[int, int]:
        (kh, kw), (sh, sw) = self.m.kernel_size, self.m.stride
        l, r, t, b = self.pad
        return (h + t + b - kh) // sh + 1, (w + l + r - kw) // sw + 1


@dataclasses.dataclass
class Resnet:
    norm1: nn.GroupNorm
    conv1: nn.Conv2d
    norm2: nn.GroupNorm
    conv2: nn.Conv2d
    shortcut: Optional[nn.Conv2d]
    out_scale: float

    def out_hw(self, h, w):
        return h, w


@dataclasses.dataclass
class Up:
    """Nearest x2 then a 3x3 conv with padding 1."""

    conv: nn.Conv2d

    def out_hw(self, h, w):
        return 2 * h, 2 * w


@dataclasses.dataclass
class Whole:
    """A module computed over all rows at once (the attention, which every
    token of the image attends to)."""

    m: nn.Module

    def out_hw(self, h, w):
        return h, w


@dataclasses.dataclass
class NormConv:
    """GroupNorm, SiLU, then a conv (the tail of every VAE half)."""

    norm: nn.GroupNorm
    conv: nn.Conv2d

    def out_hw(self, h, w):
        return Conv(self.conv, own_pad(self.conv)).out_hw(h, w)


@dataclasses.dataclass
class Layers:
    """What ``Recipe.bands`` returns: the layers of a decoder or encoder."""

    kind: str  # "decoder" | "encoder"
    steps: List[object]
