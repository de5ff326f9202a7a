"""Band geometry: which rows of an image each band owns at every resolution
of a VAE, and which input rows (the band plus its halo) a convolution needs
to compute one band of its output.

Bands are cut in *latent* rows (the decoder's input, the encoder's output):
every level of the network scales them by a power of two, so a band's
boundary falls on the same image position at every resolution and a nearest
x2 upsample or a stride-2 downsample maps band ``i`` to band ``i``. Only the
last band's end follows the level's own height (an encoder input whose height
is not a multiple of 2^levels ends on a partial row pair).
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

# The deepest halo any layer of the recognised VAEs needs, in rows of that
# layer's input: a 3x3 conv reads one row on each side, the stride-2 conv one
# row below, the nearest-x2 upsample's conv one low-resolution row on each
# side. A band must hold at least this many rows at every level, so its
# neighbours' halos come from it alone (never from two bands away).
HALO_ROWS = 1


def split_rows(height: int, bands: int) -> List[int]:
    """Band edges ``[0, e1, ..., height]`` of ``bands`` bands whose heights
    differ by at most one row (the first ones take the remainder)."""
    if bands < 1:
        raise ValueError(f"bands must be >= 1, got {bands}")
    base, extra = divmod(height, bands)
    edges = [0]
    for i in range(bands):
        edges.append(edges[-1] + base + (1 if i < extra else 0))
    return edges


def check_bands(latent_height: int, bands: int) -> None:
    """ValueError where a band would be thinner than the halo its neighbours
    read from it (more bands than latent rows)."""
    if bands > latent_height // HALO_ROWS:
        raise ValueError(f"{bands} bands of a {latent_height}-row latent: a band would be thinner than its "
                         f"{HALO_ROWS}-row halo; use at most {latent_height // HALO_ROWS} bands")


@dataclasses.dataclass(frozen=True)
class Level:
    """The band edges of one resolution: ``edges[i]:edges[i+1]`` are band
    ``i``'s rows."""

    edges: Tuple[int, ...]

    @property
    def height(self) -> int:
        return self.edges[-1]

    @property
    def bands(self) -> int:
        return len(self.edges) - 1

    def rows(self, i: int) -> Tuple[int, int]:
        return self.edges[i], self.edges[i + 1]

    def scaled(self, factor: int, height: int) -> "Level":
        """This level's interior edges times ``factor`` (a level ``factor``
        times finer), ending at ``height``."""
        inner = tuple(e * factor for e in self.edges[1:-1])
        if inner and inner[-1] >= height:
            raise ValueError(f"band edges {inner} do not fit a level of {height} rows")
        return Level((0,) + inner + (height,))

    def halved(self, height: int) -> "Level":
        """The level a stride-2 conv makes of this one (interior edges are
        even by construction: they are multiples of the latent scale)."""
        inner = self.edges[1:-1]
        if any(e % 2 for e in inner):
            raise ValueError(f"band edges {inner} are not even: the stride-2 conv would split a row pair")
        return Level((0,) + tuple(e // 2 for e in inner) + (height,))


@dataclasses.dataclass(frozen=True)
class Window:
    """The input rows ``lo:hi`` one output band reads, and the zero rows the
    conv adds above and below them (nonzero only at the image's edges, where
    the whole-image conv pads): the conv's padding for this band in place of
    its own, F.pad order with the module's own column padding."""

    lo: int
    hi: int
    top: int
    bottom: int


def window(out_rows: Tuple[int, int], kernel: int, stride: int, pad_top: int, in_height: int) -> Window:
    """The window of input rows (of ``in_height``) that output rows
    ``out_rows`` of a conv (``kernel`` rows, ``stride``, ``pad_top`` zero
    rows above the image) read: output row ``o`` reads input rows
    ``o*stride - pad_top + [0, kernel)``; what falls outside the image is
    the conv's zero padding, given back as ``top``/``bottom``."""
    a, b = out_rows
    lo, hi = a * stride - pad_top, (b - 1) * stride - pad_top + kernel
    clo, chi = max(lo, 0), min(hi, in_height)
    return Window(clo, chi, clo - lo, hi - chi)


def halo_of(win: Window, own: Tuple[int, int]) -> Tuple[int, int]:
    """(rows above, rows below) of ``win`` that lie outside the input band
    ``own``: what must come from the neighbouring bands."""
    return max(0, own[0] - win.lo), max(0, win.hi - own[1])


def check_halo(level: Level, wins: Sequence[Window]) -> None:
    """Every window reads only its own input band and the two next to it."""
    for i, w in enumerate(wins):
        lo_ok = w.lo >= (level.edges[i - 1] if i > 0 else 0)
        hi_ok = w.hi <= (level.edges[i + 2] if i + 2 < len(level.edges) else level.height)
        if not (lo_ok and hi_ok):
            raise ValueError(f"band {i} ({level.rows(i)} of {level.height} rows) needs rows {w.lo}:{w.hi}: "
                             f"a neighbouring band is thinner than its halo; use fewer bands")
