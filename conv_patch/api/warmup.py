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

Before those calls, on a GPU, one pass compiles ahead: the model is called
once with every Triton launch turned into a compile on a worker thread
(``kernels.launch.compile_ahead``), so the kernels the call needs compile
(and their launchers are built and loaded) side by side rather than one
after another as the launches reach them
(``compile_workers`` threads, default the CPU count up to 16; 0 turns the
pass off). That pass's outputs are garbage and nothing it planned is kept
(``dispatch.forget`` on the model's modules and every call site); the calls
after it plan as first calls do, with their kernels compiled. A pass that
raises is a warning: it only saves time.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import nn

from conv_patch.runtime import dispatch
from conv_patch.runtime.plans import BuildCount

# Compile threads at most: each holds a compiler's memory (hundreds of MB).
MAX_COMPILE_WORKERS = 16


@dataclass
class WarmupReport:
    seconds: List[float] = field(default_factory=list)  # each call's wall time, GPU work included
    plans_built: List[int] = field(default_factory=list)  # plans each call built (0: nothing left to build)
    compile_ahead_s: Optional[float] = None  # the compiling pass's wall time (None: not run)

    def __str__(self) -> str:
        calls = ", ".join(f"{s:.3g} s ({n} plans built)" for s, n in zip(self.seconds, self.plans_built))
        ahead = "" if self.compile_ahead_s is None else f"compiled ahead in {self.compile_ahead_s:.3g} s, then "
        return f"conv-patch warmup: {ahead}{len(self.seconds)} calls: {calls}"


def _modules_of(model) -> Optional[List[nn.Module]]:
    """The modules a call of ``model`` (a module, or a bound method of one:
    ``pipe.vae.decode``) plans on; None for another callable."""
    owner = model if isinstance(model, nn.Module) else getattr(model, "__self__", None)
    return list(owner.modules()) if isinstance(owner, nn.Module) else None


def _on_gpu(modules, args, kwargs) -> bool:
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    tensors += [p for m in modules[:1] for p in m.parameters()]
    return any(t.is_cuda for t in tensors)


def compile_ahead(model: Callable, args: tuple, kwargs: dict, workers: int) -> Optional[float]:
    """The compiling pass (module docstring): its wall time, or None where
    it does not run (no GPU tensor, a callable whose modules are unknown, a
    Triton without async compiles)."""
    modules = _modules_of(model)
    if modules is None or workers < 1 or not _on_gpu(modules, args, kwargs):
        return None
    from conv_patch.ops.loader import kernels
    t0 = time.perf_counter()
    on = False
    try:
        with torch.inference_mode(), kernels().compile_ahead(workers) as on:
            if on:
                model(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the pass only saves time: the calls after it compile as they go
        warnings.warn(f"conv-patch: compiling ahead failed ({type(e).__name__}: {e}); the warm-up calls compile "
                      "as they go", RuntimeWarning, stacklevel=3)
        on = False
    finally:
        dispatch.forget(modules)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0 if on else None


def warmup(model: Callable, *args, calls: int = 3, compile_workers: Optional[int] = None,
           **kwargs) -> WarmupReport:
    """Call ``model(*args, **kwargs)`` ``calls`` times under
    ``torch.inference_mode()`` (the caches serve later calls in any mode)
    and say what each call took and how many plans it built, after a pass
    compiling the kernels ahead on ``compile_workers`` threads (module
    docstring; 0: none). ``model`` is a patched module or a bound method of
    one (``pipe.vae.decode``); any other callable gets no compiling pass."""
    if calls < 1:
        raise ValueError(f"calls={calls}: at least one call")
    if compile_workers is None:
        compile_workers = min(MAX_COMPILE_WORKERS, os.cpu_count() or 1)
    report = WarmupReport()
    report.compile_ahead_s = compile_ahead(model, args, kwargs, compile_workers)
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
