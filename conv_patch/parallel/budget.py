"""How many bands, and whether to stage them to host memory, for a memory
budget; and the report of what a banded call did.

The estimates are byte counts of the activations each layer holds, from the
program's shapes (no measurement): the plain decode keeps a resnet's input,
its two intermediates and its output; banded on the device, each layer's
whole input and output (a resnet's input, conv1's output, the shortcut's and
the block's) plus one band's temporaries (the normalised band plus halo and
the band's conv output); staged, only a band's worth of each of those, plus
the attention's whole latent-resolution tensor. They decide, they are not
promises: ``BandReport.peak_estimate_gib`` says what was assumed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from conv_patch.parallel.walker import Program
from conv_patch.recipes.layers import Resnet, Whole

GIB = float(1 << 30)
# The attention's score blocks (ops.attention bounds them at 1 GiB).
ATTENTION_SCRATCH = 1 << 30
# The most bands a budget may ask for (each band is a launch per layer).
MAX_BANDS = 256


@dataclasses.dataclass
class BandReport:
    """What a decode or encode in bands did. ``mode``: ``"plain"`` (one
    band: the ordinary forward), ``"bands"`` (sequential bands in this
    process), ``"distributed"`` (one band per rank); ``rows``: latent rows
    per band; ``staged``: finished bands of the large layers kept in host
    memory (``staged_layers`` of them, ``staged_gib`` copied there,
    ``host_peak_gib`` held at once, ``pin_seconds`` spent pinning new host
    buffers; ``device_layers`` stayed on the device);
    ``peak_estimate_gib``: the activation memory the plan assumed;
    ``fallback``: why the plain forward ran instead of bands, if it did;
    ``sent_bytes`` (distributed): what this rank sent the others (halo rows,
    GroupNorm moments, whole tensors, its band of the output)."""

    mode: str
    bands: int
    rows: Tuple[int, ...] = ()
    staged: bool = False
    peak_estimate_gib: Optional[float] = None
    budget_gib: Optional[float] = None
    world_size: int = 1
    over_budget: bool = False
    fallback: Optional[str] = None
    # Staged runs: layers whose output stayed on the device / went to host;
    # GiB copied to the host, the most of it held there at once, and the
    # seconds this call spent pinning new host buffers (the pool keeps them
    # for the next call: conv_patch.parallel.release_host_staging()).
    device_layers: int = 0
    staged_layers: int = 0
    staged_gib: float = 0.0
    host_peak_gib: float = 0.0
    pin_seconds: float = 0.0
    sent_bytes: int = 0


def _walk(program: Program, shape, elsize: int):
    """(step, input bytes, output bytes, attention scratch bytes) of every
    step, for an input of ``shape`` [N, C, H, W]."""
    n, c, h, w = shape
    out = []
    for s in program.steps:
        oh, ow = s.out_hw(h, w)
        oc = _channels(s, c)
        # A Whole step's fp32 scores, in blocks of at most ATTENTION_SCRATCH.
        scratch = min(ATTENTION_SCRATCH, n * (h * w) ** 2 * 4) if isinstance(s, Whole) else 0
        out.append((s, n * c * h * w * elsize, n * oc * oh * ow * elsize, scratch))
        c, h, w = oc, oh, ow
    return out


def _channels(step, c: int) -> int:
    conv = getattr(step, "conv2", None) or getattr(step, "conv", None) or getattr(step, "m", None)
    return conv.out_channels if isinstance(conv, torch.nn.Conv2d) else c


def plain_peak(program: Program, shape, elsize: int) -> float:
    peak = 0
    for s, i, o, scratch in _walk(program, shape, elsize):
        if isinstance(s, Resnet):
            need = i + 3 * o
        elif isinstance(s, Whole):
            need = 3 * i + scratch
        else:
            need = 2 * i + o
        peak = max(peak, need)
    return peak


def whole_peak(program: Program, shape, elsize: int) -> float:
    """The peak of the steps that run on the whole tensor whatever the band
    count (the attention): a floor no number of bands lowers."""
    return max([3 * i + scratch for s, i, o, scratch in _walk(program, shape, elsize) if isinstance(s, Whole)],
               default=0)


def banded_peak(program: Program, shape, elsize: int, bands: int, staged: bool, with_whole: bool = True) -> float:
    """The activation estimate of ``bands`` bands (``with_whole``: the whole-tensor steps counted)."""
    h = shape[2]
    # The tallest band with its halo rows, as a fraction of the height.
    frac = min(1.0, (-(-h // bands) + 2) / h)
    peak = 0
    for s, i, o, scratch in _walk(program, shape, elsize):
        if isinstance(s, Whole):
            continue
        if staged:
            # (plus the next band's window on its way in and the last band's
            # output on its way out: the copies overlap the compute)
            need = frac * (2 * i + 2 * o) * (2 if isinstance(s, Resnet) else 1) + frac * (i + o)
        else:
            whole = i + (3 * o if isinstance(s, Resnet) else o)
            need = whole + frac * 2 * max(i, o)
        peak = max(peak, need)
    last = _walk(program, shape, elsize)[-1][2]
    peak += last if staged else 0
    return max(peak, whole_peak(program, shape, elsize)) if with_whole else peak


# A staged run keeps on the device the layers whose whole output is at most
# this share of the budget (the low-resolution ones): staging them would cost
# transfers and save little.
KEEP_SHARE = 0.125


def record_staging(report: BandReport, comm) -> None:
    """What a ``LocalComm`` run did, into its report."""
    report.device_layers, report.staged_layers = comm.device_layers, comm.staged_layers
    if comm.staged_bytes:
        report.staged_gib = comm.staged_bytes / GIB
        report.host_peak_gib = comm.pool.peak_bytes / GIB
        report.pin_seconds = comm.pin_seconds


def keep_bytes(budget: Optional[float]) -> float:
    return 0.0 if budget is None else KEEP_SHARE * budget


def auto_budget(device: torch.device) -> Optional[float]:
    """Bytes of activation memory to plan with where none is given: on CUDA
    90% of what is free (the driver's free memory plus what PyTorch's cache
    holds unused); elsewhere None (no banding unless asked)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return 0.9 * (free + cached)


def fits_free(device: torch.device, need: float) -> bool:
    """Whether ``need`` bytes fit 90% of the driver's free memory alone: a
    lower bound of ``auto_budget`` at one driver query. The allocator's
    counters ``auto_budget`` adds (PyTorch builds its whole statistics
    dictionary for them, about half a millisecond on the H200's host) are
    only read where this says no."""
    return device.type == "cuda" and 0.9 * torch.cuda.mem_get_info(device)[0] >= need


def plan(program: Program, shape, elsize: int, latent_height: int, budget: Optional[float],
         bands: Optional[int] = None, staged: Optional[bool] = None) -> BandReport:
    """The bands for this call: ``bands`` where given (staged where asked,
    or where the resident estimate exceeds ``budget``); else the fewest that
    fit ``budget``, on the device if they fit there, else staged (capped at
    one band per latent row: a budget never makes a band thinner than its
    halo; ``over_budget`` where even that does not fit); one band where
    ``budget`` is None or the plain forward fits it."""
    gib = None if budget is None else budget / GIB
    if bands is not None:
        if staged is None:
            staged = budget is not None and bands > 1 and banded_peak(program, shape, elsize, bands, False) > budget
        est = banded_peak(program, shape, elsize, bands, staged) if bands > 1 else plain_peak(program, shape, elsize)
        return BandReport("bands" if bands > 1 else "plain", bands, staged=bool(staged) and bands > 1,
                          peak_estimate_gib=est / GIB, budget_gib=gib,
                          over_budget=budget is not None and est > budget)
    plain = plain_peak(program, shape, elsize)
    if budget is None or plain <= budget:
        return BandReport("plain", 1, peak_estimate_gib=plain / GIB, budget_gib=gib)
    most = max(1, min(MAX_BANDS, latent_height))
    # Where the attention alone exceeds the budget no band count helps it:
    # the bands are planned for the other steps, and the report says so.
    over = whole_peak(program, shape, elsize) > budget
    for stage in ((False, True) if staged is None else (staged,)):
        for n in range(2, most + 1):
            est = banded_peak(program, shape, elsize, n, stage, with_whole=not over)
            # (staged: plus the small layers kept on the device, in and out)
            if est + (2 * keep_bytes(budget) if stage else 0) <= budget:
                return BandReport("bands", n, staged=stage, peak_estimate_gib=est / GIB, budget_gib=gib,
                                  over_budget=over)
    stage = True if staged is None else staged
    est = banded_peak(program, shape, elsize, most, stage)
    return BandReport("bands" if most > 1 else "plain", most, staged=stage and most > 1,
                      peak_estimate_gib=est / GIB, budget_gib=gib, over_budget=True)
