"""Compiling ahead: ``conv_patch.warmup(model, *example_args, **kwargs)``.

A patched model's first call at a new input signature builds its plans, and
where a kernel was never compiled on this machine Triton compiles it (seconds
each on a cold cache; a line on stderr names what is compiling after 2 s).
Triton keeps what it compiled on disk, so a later process only loads it.
``warmup`` makes those calls now, at a moment of the user's choosing (a
server's start, a node's load, a CI job that fills the cache): the first
call builds and compiles, the second is the one ``passthrough`` watches, the
third runs as every later call will. A user's first real call at that
signature then starts at steady state; another resolution or batch is
another signature, warmed by another ``warmup``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List

import torch

from conv_patch.runtime.plans import BuildCount


@dataclass
class WarmupReport:
    seconds: List[float] = field(default_factory=list)  # each call's wall time, GPU work included
    plans_built: List[int] = field(default_factory=list)  # plans each call built (0: nothing left to build)

    def __str__(self) -> str:
        calls = ", ".join(f"{s:.3g} s ({n} plans built)" for s, n in zip(self.seconds, self.plans_built))
        return f"conv-patch warmup: {len(self.seconds)} calls: {calls}"


def warmup(model: Callable, *args, calls: int = 3, **kwargs) -> WarmupReport:
    """Call ``model(*args, **kwargs)`` ``calls`` times under
    ``torch.inference_mode()`` (the caches serve later calls in any mode)
    and say what each call took and how many plans it built. ``model`` is a
    patched module or any callable that runs one (``pipe.vae.decode``)."""
    if calls < 1:
        raise ValueError(f"calls={calls}: at least one call")
    report = WarmupReport()
    with torch.inference_mode():
        for _ in range(calls):
            before = BuildCount.total
            t0 = time.perf_counter()
            model(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the call's GPU work in its time
            report.seconds.append(time.perf_counter() - t0)
            report.plans_built.append(BuildCount.total - before)
    return report
