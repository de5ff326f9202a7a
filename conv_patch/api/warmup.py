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
three times (a first call's kernels and what later calls add: a fused
block's grouped weight-pack refresh, the layouts passthrough's idle parts
hand on, ``PASS_CALLS``) with every Triton launch turned into a compile
on a worker thread
(``kernels.launch.compile_ahead``), so the kernels the call needs compile
(and their launchers are built and loaded) side by side rather than one
after another as the launches reach them
(``compile_workers`` threads, default the CPU count up to 16; 0 turns the
pass off). That pass's outputs are garbage and nothing it planned is kept
(``dispatch.forget`` on the model's modules and every call site); the calls
after it plan as first calls do, with their kernels compiled. A pass that
raises is a warning: it only saves time. A pass that compiled and loaded
every kernel leaves a mark in Triton's cache directory (``pass_marks``): a
later process's first call of the same model and input, whose kernels are
all in that cache, makes no pass before it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import nn

from conv_patch.api import pass_marks
from conv_patch.runtime import compiled, dispatch, passthrough
from conv_patch.runtime.plans import COMPILE_NOTICE_S, BuildCount

# The calls of a pass: the first builds the plans; the second launches a fused
# block's grouped weight-pack refresh and is the one passthrough watches; the
# third is the first with passthrough's idle components on their own classes,
# whose outputs reach the busy parts in the unpatched modules' layouts (other
# strides: other kernel specialisations; docs/performance.md, thirty-sixth
# session).
PASS_CALLS = 3
# Compile threads at most: each holds a compiler's memory (hundreds of MB).
MAX_COMPILE_WORKERS = 16
# A pass still compiling after COMPILE_NOTICE_S says so on stderr, and then
# how far it is every this many seconds (in place on a terminal).
PROGRESS_EVERY_S = 10.0


@dataclass
class WarmupReport:
    seconds: List[float] = field(default_factory=list)  # each call's wall time, GPU work included
    plans_built: List[int] = field(default_factory=list)  # plans each call built (0: nothing left to build)
    compile_ahead_s: Optional[float] = None  # the compiling pass's wall time (None: not run)
    compile_ahead_skipped: Optional[str] = None  # why no pass ran (None: it ran)

    def __str__(self) -> str:
        calls = ", ".join(f"{s:.3g} s ({n} plans built)" for s, n in zip(self.seconds, self.plans_built))
        if self.compile_ahead_s is not None:
            ahead = f"compiled ahead in {self.compile_ahead_s:.3g} s, then "
        else:
            ahead = "" if self.compile_ahead_skipped is None else f"no compiling pass ({self.compile_ahead_skipped}), "
        return f"conv-patch warmup: {ahead}{len(self.seconds)} calls: {calls}"


@dataclass
class PassRecord:
    """What the compiling pass before a module's call last did
    (``last_pass``): it ran (``seconds``, ``kernels`` compiled or found in
    the cache and loaded, ``failed`` of them) or it did not (``skipped``:
    why). A first call whose pass was skipped compiles its kernels one after
    another as its launches reach them: the reason says why it was slow."""

    what: str
    seconds: Optional[float] = None
    kernels: int = 0
    failed: int = 0
    skipped: Optional[str] = None

    def __str__(self) -> str:
        if self.skipped is not None:
            return f"{self.what}: no compiling pass ({self.skipped})"
        failed = f", {self.failed} failed" if self.failed else ""
        return f"{self.what}: compiled ahead in {self.seconds:.3g} s ({self.kernels} kernels{failed})"


_RECORDS: "weakref.WeakKeyDictionary[nn.Module, PassRecord]" = weakref.WeakKeyDictionary()


def last_pass(module: nn.Module) -> Optional[PassRecord]:
    """The record of the last compiling pass made or skipped for a call of
    ``module`` (its forward or a method of it) in this process, None where
    none was considered (no first call hooked, no ``warmup``)."""
    return _RECORDS.get(module)


def _record(module: Optional[nn.Module], rec: PassRecord) -> PassRecord:
    if module is not None:
        _RECORDS[module] = rec
    return rec


def _modules_of(model) -> Optional[List[nn.Module]]:
    """The modules a call of ``model`` (a module, or a bound method of one:
    ``pipe.vae.decode``) plans on; None for another callable."""
    owner = model if isinstance(model, nn.Module) else getattr(model, "__self__", None)
    return list(owner.modules()) if isinstance(owner, nn.Module) else None


def _call_tensors(modules, args, kwargs) -> list:
    """A call's tensor arguments and the parameters of its (first) module."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    return tensors + [p for m in modules[:1] for p in m.parameters()]


def _on_gpu(modules, args, kwargs) -> bool:
    return any(t.is_cuda for t in _call_tensors(modules, args, kwargs))


def default_workers() -> int:
    """Compile threads of a pass: the CPU count, at most ``MAX_COMPILE_WORKERS``."""
    return min(MAX_COMPILE_WORKERS, os.cpu_count() or 1)


def compile_ahead(model: Callable, args: tuple, kwargs: dict, workers: int, what: Optional[str] = None,
                  key: Optional[str] = None) -> Optional[float]:
    """The compiling pass (module docstring): its wall time, or None where
    it does not run (no GPU tensor, a callable whose modules are unknown, a
    Triton without async compiles). ``what`` names the call in the progress
    line that a pass still compiling after ``COMPILE_NOTICE_S`` writes. A
    pass that compiled and loaded every kernel leaves its mark
    (``pass_marks``; ``key``: the call's, where the caller has it). What it
    did, or why it did not run, is the module's ``last_pass``."""
    return run_pass(model, args, kwargs, workers, what, key).seconds


def run_pass(model: Callable, args: tuple, kwargs: dict, workers: int, what: Optional[str] = None,
             key: Optional[str] = None) -> PassRecord:
    """``compile_ahead``, returning (and keeping as the module's
    ``last_pass``) its record."""
    modules = _modules_of(model)
    owner, method = (None, None) if modules is None else _owner_method(model)
    rec = PassRecord(what or (type(owner).__name__ if owner is not None else getattr(model, "__name__", "call")))
    if modules is None:
        rec.skipped = "not a module or a method of one"
    elif workers < 1:
        rec.skipped = "no compile workers (compile_workers=0)"
    elif not _on_gpu(modules, args, kwargs):
        rec.skipped = "no CUDA tensor in the call"
    if rec.skipped is not None:
        return _record(owner, rec)
    if key is None:
        key = _pass_key(owner, method, args, kwargs)
    if method != "forward":
        from conv_patch.recipes import catalog
        args, kwargs = catalog.pass_inputs(owner, method, args, kwargs)
    from conv_patch.ops.loader import kernels, wait_for_background
    t0 = time.perf_counter()
    wait_for_background()
    progress = line = None
    try:
        with torch.inference_mode(), kernels().compile_ahead(workers) as progress:
            if progress is not None:
                line = _ProgressLine(progress, what or type(modules[0]).__name__, workers)
                # PASS_CALLS times: later calls at a signature launch what
                # the first does not, and the user's should find it compiled
                # (no CUDA graph is captured in a pass).
                for _ in range(PASS_CALLS):
                    model(*_copied(args), **_copied(kwargs))
    except Exception as e:  # noqa: BLE001 - the pass only saves time: the calls after it compile as they go
        warnings.warn(f"conv-patch: compiling ahead failed ({type(e).__name__}: {e}); the calls after it compile "
                      "as they go", RuntimeWarning, stacklevel=3)
        rec.skipped = f"it failed: {type(e).__name__}: {e}"
        progress = None
    finally:
        if line is not None:
            line.close()  # (after the compiles and loads the pass's end waited for)
        dispatch.forget(modules)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if progress is None:
        if rec.skipped is None:
            rec.skipped = "this Triton has no async compiles"
        return _record(owner, rec)
    if not progress.failed:
        pass_marks.mark(key)
    rec.seconds, rec.kernels, rec.failed = time.perf_counter() - t0, progress.counts()[1], progress.failed
    return _record(owner, rec)


def _owner_method(model) -> tuple:
    """(the module, the method's name) of a module or a bound method of one."""
    if isinstance(model, nn.Module):
        return model, "forward"
    return model.__self__, model.__name__


def _pass_key(owner: nn.Module, method: str, args: tuple, kwargs: dict) -> Optional[str]:
    try:
        return pass_marks.pass_key(owner, method, args, kwargs)
    except Exception:  # noqa: BLE001 - no mark: the pass runs as it would without marks
        return None


class _ProgressLine:
    """While a pass runs and waits for its compiles: after
    ``COMPILE_NOTICE_S`` a line on stderr says what is compiling and how far
    it is (rewritten in place on a terminal, a line every
    ``PROGRESS_EVERY_S`` otherwise), and at ``close`` how long it took.
    Nothing where the pass ends sooner (a warm cache)."""

    def __init__(self, progress, what: str, workers: int):
        self.progress, self.what, self.workers = progress, what, workers
        self.done = threading.Event()
        self.shown = False
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="conv-patch-progress", daemon=True)
        self.thread.start()

    def _line(self) -> str:
        finished, total = self.progress.counts()
        stage = "loading" if self.progress.loading else "compiling"
        return (f"conv-patch: {stage} kernels for {self.what} ahead of its first call: {finished}/{total} "
                f"({self.workers} threads, {time.perf_counter() - self.t0:.0f} s; cached for later processes)")

    def _run(self) -> None:
        if self.done.wait(COMPILE_NOTICE_S):
            return
        tty = _stderr_is_tty()
        self.shown = True
        while True:
            _write(self._line(), tty)
            if self.done.wait(0.5 if tty else PROGRESS_EVERY_S):
                return

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        if self.shown:
            _write(f"conv-patch: {self.progress.counts()[1]} kernels for {self.what} compiled ahead in "
                   f"{time.perf_counter() - self.t0:.1f} s", _stderr_is_tty(), last=True)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _write(text: str, tty: bool, last: bool = False) -> None:
    try:
        if tty:
            sys.stderr.write("\r\x1b[K" + text + ("\n" if last else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (AttributeError, ValueError, OSError):
        pass


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
        compile_workers = default_workers()
    report = WarmupReport()
    rec = run_pass(model, args, kwargs, compile_workers)
    report.compile_ahead_s, report.compile_ahead_skipped = rec.seconds, rec.skipped
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


# -- compiling ahead at a patched model's first call ------------------------------
# ``apply`` hooks each patched model, and the decoder and encoder that a VAE's
# ``decode`` and ``encode`` call (``passthrough.entries``), to run the pass
# above once, just before its first call in this process
# (``PatchConfig.compile_ahead``): on a cold kernel cache that call would
# otherwise compile its kernels one after another as its launches reach them
# (docs/performance.md, thirty-fifth session). The hook takes itself off at
# that call. The pass calls the model three times more than the user did, so it runs
# only where nobody can tell (``first_pass_problem``): no forward hooks of
# anyone else's on the model's modules and no global ones (they would see the
# pass's garbage), no module in training mode, no accelerate hooks, no
# attention processor from outside diffusers (it may keep what it sees), no
# list or generator among the arguments (a cache the call appends to, as
# Wan's decoder's; random numbers the call would draw), no autograd. Dicts
# are copied for the pass, and the RNG states of the CPU and the call's GPUs
# are put back after it. A model with Conv3d layers is a video model whose
# decoder is called once per latent frame with the VAE's cache lists: it is
# hooked at the methods its family names (``recipes.catalog.pass_methods``: a
# Wan VAE's ``decode`` and ``encode``, the other diffusers video VAEs'
# ``decode``, as ``FirstMethodCall``), whose pass
# takes the clip cut to a few frames (``catalog.pass_inputs``), and not at
# all where its family has none. Elsewhere ``warmup`` compiles ahead on
# request.
def install_first_pass(model: nn.Module) -> bool:
    """Hook ``model`` and its ``passthrough.entries`` (a video model: the
    methods its family names) to compile ahead before their first call
    (above); whether it is hooked."""
    if any(isinstance(m, nn.Conv3d) for m in model.modules()):
        from conv_patch.recipes import catalog
        methods = catalog.pass_methods(model)
        for name in methods:
            if not isinstance(model.__dict__.get(name), FirstMethodCall):
                model.__dict__[name] = FirstMethodCall(model, name)
        return bool(methods)
    for m in (model, *passthrough.entries(model)):
        if not first_pass_pending(m):
            m.register_forward_pre_hook(first_call, with_kwargs=True, prepend=True)
    return True


def first_pass_pending(m: nn.Module) -> bool:
    """Whether ``m`` still carries the hook compiling ahead at its first
    call (or a method of it, ``FirstMethodCall``)."""
    return passthrough.carries_hook(m, first_call) or any(isinstance(v, FirstMethodCall) for v in m.__dict__.values())


def uninstall_first_pass(model: nn.Module) -> None:
    for m in (model, *passthrough.entries(model)):
        passthrough.drop_hooks(m, first_call)
    for name in [k for k, v in model.__dict__.items() if isinstance(v, FirstMethodCall)]:
        del model.__dict__[name]


class FirstMethodCall:
    """``model.<name>`` (a video VAE's ``decode``) until its first call: an
    instance attribute in front of the class's method, which at that call
    takes itself off and, where nobody can tell (``first_pass_problem``),
    compiles the call's kernels ahead on the input the family's pass takes,
    then makes the call. It looks like the bound method it stands for
    (``__self__``, ``__name__``), so ``warmup(vae.decode, z)`` before the
    first call compiles ahead as after it."""

    def __init__(self, model: nn.Module, name: str):
        self.__self__, self.__name__ = model, name

    def __call__(self, *args, **kwargs):
        model, name = self.__self__, self.__name__
        method = getattr(type(model), name).__get__(model)
        _hooked_call(lambda: model.__dict__.get(name) is self,
                     lambda: _first_pass(model, method, args, kwargs, f"{type(model).__name__}.{name}{_shape_of(args)}"),
                     lambda: model.__dict__.pop(name) if model.__dict__.get(name) is self else None)
        return method(*args, **kwargs)


# One pass at a time, and no other thread's call of a hooked model while it
# runs: the pass's plans (launches compiled, none run) live in the modules'
# shared state until its end forgets them, and another thread's call would
# replay them and compute nothing. A call that finds the hook waits here;
# the hook comes off once the pass has ended. (``_PASS.on``: the pass's own
# calls, in its thread, pass the hooks by.)
PASS_LOCK = threading.RLock()
_PASS = threading.local()


def _new_pass_lock() -> None:
    global PASS_LOCK
    PASS_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    # (A child forked during another thread's pass would find the lock held.)
    os.register_at_fork(after_in_child=_new_pass_lock)


def first_call(module, args, kwargs):
    """The forward pre-hook: where nobody can tell
    (``first_pass_problem``), compile this call's kernels ahead; then take
    itself off."""
    _hooked_call(lambda: first_pass_pending(module),
                 lambda: _first_pass(module, module, args, kwargs, _describe(module, args)),
                 lambda: uninstall_first_pass(module))
    return None


def _hooked_call(pending: Callable[[], bool], run_pass: Callable[[], None], take_off: Callable[[], None]) -> None:
    """What both first-call hooks do before the call: under the pass lock,
    where the hook is still ``pending`` (else another thread's pass ran
    while this one waited), run the pass, then ``take_off`` the hook. Not
    while compiling, nor for the pass's own calls."""
    if torch.compiler.is_compiling() or getattr(_PASS, "on", False):
        return
    with PASS_LOCK:
        if pending():
            try:
                run_pass()
            finally:
                take_off()


def _first_pass(module: nn.Module, fn: Callable, args: tuple, kwargs: dict, what: str) -> None:
    """The pass before ``module``'s first call (``fn``: the module or its
    method), where nobody can tell (``first_pass_problem``) and no pass is
    under way."""
    problem = first_pass_problem(module, args, kwargs)
    if problem is not None:
        _record(module, PassRecord(what, skipped=problem))
        return
    from conv_patch.ops.loader import kernels, wait_for_background
    if kernels().compiling_ahead():
        return  # (called inside a pass: its kernels compile in that one)
    key = _pass_key(*_owner_method(fn), args, kwargs)
    if pass_marks.marked(key):
        # A pass of this call compiled every kernel into the cache already:
        # the call loads them. (The background load of Triton's key first,
        # which the call's first kernel would otherwise compute beside it.)
        wait_for_background()
        _record(module, PassRecord(what, skipped="an earlier pass of this call compiled its kernels into the cache"))
        return
    _PASS.on = True
    try:
        with torch.random.fork_rng(devices=_cuda_devices(module, args, kwargs)):
            compile_ahead(fn, args, kwargs, default_workers(), what=what, key=key)
    finally:
        _PASS.on = False


# (Seen by ``passthrough.other_hooks`` as none of anyone else's: a module
# that carries it runs as it would without it.)
first_call.cp_transparent = True


def whole_block_first_call(module: nn.Module, args: tuple) -> None:
    """The pass before a block's first call inside a compiled graph
    (``runtime.compiled.whole_block``: the graph runs the block's forward,
    so its hook never ran), where the block still carries the hook. The
    hook stays on: taking it off would change what Dynamo guarded on the
    module and compile the graph again; the pass's mark (``pass_marks``)
    spares a later eager call another."""
    _hooked_call(lambda: first_pass_pending(module),
                 lambda: _first_pass(module, module, args, {}, _describe(module, args)),
                 lambda: None)


compiled.on_first_whole_call(whole_block_first_call)


def first_pass_problem(module: nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
    """Why a pass before ``module``'s first call could be seen by someone
    (above), or None."""
    if not _on_gpu([module], args, kwargs):
        return "no CUDA tensor in the call"
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        return "autograd"
    from conv_patch.recipes.fuse import global_hooks
    if global_hooks():
        return "global forward hooks"
    for name, m in module.named_modules():
        if m.training:
            return f"{name or 'the model'} in training mode (a batch norm's statistics would see the pass)"
        if passthrough.other_hooks(m):
            return f"forward hooks on {name or 'the model'}"
        if getattr(m, "_hf_hook", None) is not None:
            return f"accelerate hooks on {name or 'the model'}"
        proc = m.__dict__.get("processor")
        if proc is not None and not type(proc).__module__.startswith(("diffusers.", "conv_patch.")):
            return f"attention processor {type(proc).__qualname__} on {name}"
    try:
        # (Lists refused: a call may change them, and the pass would see to it.)
        for v in (*args, *kwargs.values()):
            pass_marks.describe_argument(v, containers=(tuple, dict))
    except TypeError as e:
        return str(e)
    return None


def _copied(v):
    """``v`` with its dicts copied (the pass's own, should the call change them)."""
    if isinstance(v, dict):
        return {k: _copied(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return tuple(_copied(x) for x in v)
    return v


def _cuda_devices(module: nn.Module, args: tuple, kwargs: dict) -> list:
    """The GPUs a call may draw random numbers on: its tensors' and its
    parameters'."""
    return pass_marks.cuda_indices(_call_tensors([module], args, kwargs))


def _describe(module: nn.Module, args: tuple) -> str:
    return type(module).__name__ + _shape_of(args)


def _shape_of(args: tuple) -> str:
    shape = next((tuple(v.shape) for v in args if isinstance(v, torch.Tensor)), None)
    return "" if shape is None else f" on {shape}"
