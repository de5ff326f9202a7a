"""CUDA-graph replay of a patched model's outermost fused blocks:
``PatchConfig(cuda_graphs=True)`` for every such block, and by default
(``cuda_graphs="auto"``) for the blocks whose recipe says their eager call
is bound by the host (``Recipe.auto_graphs``: the tiny autoencoders' stacks,
Real-ESRGAN's compact net), within a memory bound.

Why: a FLUX VAE decode at 1024^2 issues some 400 kernel launches and their
Python. On the H200 issuing them takes as long as the GPU takes to run them
(~20 ms), so an eager decode is host-bound and its time moves with the host
CPU (bench/README.md). A captured graph is replayed with one launch. A tiny
decoder is host-bound at every size a preview or a decode uses (TAEF2 at
512^2: 1.2 ms of GPU kernels in a 3.3 ms launched call).

What a user can rely on:

* A call is captured the second time its key is seen: the tensors' shapes,
  strides, dtypes and devices, the other arguments, the grad and inference
  modes, autocast and the fp32 convolutions' TF32 switch. It is captured and
  replayed on its tensors' GPU, whichever device is current. A one-off call (one image at an odd size) runs eagerly
  and costs no capture.
* A replay returns fresh tensors (cloned from the graph's static outputs):
  the next call does not overwrite a result the caller holds.
* The weights are read in place at every replay (the packs are refreshed
  inside the graph, see conv_patch/pack.py), so in-place weight updates,
  ``.data`` writes and LoRA merges included, are seen. What would change the
  launches themselves changes the module's signature, checked at every call:
  a parameter or buffer replaced, moved or re-typed (each gets a new storage
  address: ``.to()`` and ``.half()`` allocate the new tensor while the old
  one is alive), a module's training flag or class, a forward hook added
  anywhere below. The module's graphs are then dropped and recaptured. A
  module whose signature changes at more than ``MAX_RECAPTURES`` calls in a
  row (weights streamed in per call, as low-VRAM offloading does) stops being
  graphed and runs eagerly, with one warning (none under ``"auto"``, which
  nobody asked for: ``GraphCache.disabled`` says why).
* Each graph keeps a private memory pool as large as the call's peak
  activations while it is cached: at most ``max_graphs`` keys per module,
  the least recently used dropped first. ``conv_patch.remove`` drops them all.
  Under ``"auto"`` the pools a module keeps are also bounded in bytes
  (``auto_pool_bytes``: a 32nd of the GPU's memory, at most 1 GiB: 256 MiB
  on an 8 GiB card, 768 MiB on a 24 GiB one): a capture whose pool alone is larger is dropped and its key runs
  eagerly, and older graphs are dropped to keep the sum within the bound.
* What cannot be graphed runs the fused forward as without graphs: tensors
  not on a CUDA device, a call autograd would record, tracing under
  torch.compile, a call made while another graph is being captured (the
  caller's own capture then records the launches), arguments that are not
  hashable, outputs that are not tensors or tuples/lists of tensors. A
  capture that fails is reported once as a warning; its key runs eagerly.
* Threads: a call made while another thread replays the same module's graph
  runs eagerly; a replay on another stream than the last one waits for the
  last one's outputs to be copied out first (the static buffers are shared).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conv_patch.buffers import persistent
from conv_patch.ops.loader import kernels
from conv_patch.runtime import pack
from conv_patch.runtime.state import peek, state_of
from conv_patch.target import conv_tf32_enabled
from conv_patch.work import Work

MAX_RECAPTURES = 3
DEFAULT_MAX_GRAPHS = 4
# The bound on the graph pools one module keeps under cuda_graphs="auto":
# these bytes, or the GPU's memory over AUTO_POOL_SHARE where that is less
# (a consumer card holding a UNet as well keeps its room).
AUTO_POOL_BYTES = 1 << 30
AUTO_POOL_SHARE = 32
# Keys seen once, remembered so a second call captures; bounded so that a
# stream of one-off shapes does not grow it.
_SEEN_LIMIT = 64

_EAGER = object()  # a key whose capture failed or whose output cannot be graphed

# A graph's private pool is made of the caching allocator's segments, which
# it rounds: a block of 1-10 MiB gets a 20 MiB segment of its own. A tiny
# model's activations are such blocks, so its graph reserved about 1.5x its
# call's live peak, more than the unpatched model's whole peak (TAEF2 at
# 256², the compact net). A capture therefore also tries first taking one
# segment as large as the warm-up call's live peak, from which the capture's
# large blocks are split, and keeps the smaller pool (``Captured``). How the
# splits fragment that segment decides whether a block overflows into a
# segment of its own, and no one size of it gave the smallest pool on every
# tiny model, so each of RESERVE_FACTORS times the peak is tried
# (docs/performance.md, forty-seventh session). Blocks
# over 10 MiB get segments of their own size (rounded to 2 MiB): a peak
# larger than the auto bound is captured once, as it comes. A request below
# RESERVE_MIN would get a 20 MiB segment itself: a smaller peak reserves
# RESERVE_MIN; one of small blocks only (under 1 MiB, served from 2 MiB
# segments of their own) reserves nothing.
RESERVE_MIN = 10 << 20
SMALL_BLOCK = 1 << 20
RESERVE_ROUND = 2 << 20
RESERVE_FACTORS = (17 / 16, 5 / 4, 3 / 2)


def _walk(m: nn.Module, out: list) -> list:
    # Module.modules() builds a name for every submodule: 4x slower.
    out.append(m)
    for c in m._modules.values():
        if c is not None:
            _walk(c, out)
    return out


def signature(module: nn.Module) -> list:
    """What the launches of ``module``'s forward depend on besides its
    arguments (see the module docstring), in one walk over the submodules:
    their classes, training flags and hooks, and the storage address of
    every parameter and buffer (a ``.to()``, ``.half()`` or new tensor moves
    it; an in-place update keeps it, and the graph reads it in place). At
    every call, so it is kept to what is cheap to read: 130-200 us for a
    FLUX decoder's 134 modules on a 2-core CPU, 170 us on the H200's host
    (backward hooks are left out: a call autograd records is never
    graphed). The module's own hooks are left out: they run outside the
    graph."""
    from torch.nn.modules import module as mm
    sig = [bool(mm._global_forward_hooks or mm._global_forward_pre_hooks)]
    add = sig.append
    for m in _walk(module, []):
        add(m.__class__)
        add(m.training)
        # (The module's own hooks run around the replay, not in it: a
        # passthrough watch hooking it for a call changes nothing inside.)
        add(m is not module and bool(m._forward_hooks or m._forward_pre_hooks))
        for t in m._parameters.values():
            add(None if t is None else t.data_ptr())
        for t in m._buffers.values():
            add(None if t is None else t.data_ptr())
    return sig


def _params_need_grad(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _tensor_key(t: torch.Tensor) -> tuple:
    return ("T", tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def call_key(args: tuple, kwargs: dict) -> Optional[tuple]:
    """The graph key of a call, or None when it cannot be graphed (an
    argument that is neither a tensor nor hashable, a tensor not on CUDA).
    Besides the arguments, what the recorded launches depend on that a call
    may change: grad and inference modes, autocast (its dtype where on) and
    the fp32 convolutions' TF32 switch (the routes' precision)."""
    key = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
           torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None,
           conv_tf32_enabled()]
    for v in (*args, *(kwargs[k] for k in sorted(kwargs))):
        if isinstance(v, torch.Tensor):
            if not _device_ok(v):
                return None
            key.append(_tensor_key(v))
        else:
            try:
                hash(v)
            except TypeError:
                return None
            key.append(("V", type(v), v))
    key.append(tuple(sorted(kwargs)))
    return tuple(key)


def _device_ok(t: torch.Tensor) -> bool:
    return t.is_cuda


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _clone_out(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(t.clone() for t in out)


def _graphable_out(out) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    return type(out) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in out)


class LivePeak(TorchDispatchMode):
    """The most bytes allocated on ``device`` above what was allocated on
    entry, read after each op run under it: a call's live peak, without
    resetting the allocator's peak statistics (a caller may be reading
    them). A block allocated and freed inside one op is not seen."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.base = self.peak = 0

    def __enter__(self):
        self.base, self.peak = torch.cuda.memory_allocated(self.device), 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        used = torch.cuda.memory_allocated(self.device) - self.base
        if used > self.peak:
            self.peak = used
        return out


def reserve_for(peak: int, factor: float = RESERVE_FACTORS[0]) -> Optional[int]:
    """The bytes a capture reserves up front for a call whose live peak is
    ``peak``: ``factor`` times it (a 16th more: room for the splits),
    rounded as the allocator rounds a large segment, at least RESERVE_MIN;
    None for a peak of small blocks only."""
    if peak + peak // 16 <= SMALL_BLOCK:
        return None
    want = int(peak * factor)
    return max(RESERVE_MIN, -(-want // RESERVE_ROUND) * RESERVE_ROUND)


def reserve_tries(peak: int, kept: int, bound: int) -> list:
    """The reserves a capture tries, smallest first, ending with none (the
    allocator's own segments): for a warm-up call whose live peak was
    ``peak`` bytes, ``kept`` of them still allocated after it, each of
    RESERVE_FACTORS times the peak with and without what was kept; a peak
    over ``bound`` only as it comes."""
    if peak > bound:
        return [None]
    tries = {reserve_for(base, f) for base in (peak - kept, peak) for f in RESERVE_FACTORS}
    return sorted(r for r in tries if r is not None) + [None]


def auto_pool_bytes(device: torch.device) -> int:
    """The bytes of graph pools one module keeps under ``cuda_graphs="auto"``
    on ``device``."""
    total = torch.cuda.get_device_properties(device).total_memory
    return min(AUTO_POOL_BYTES, total // AUTO_POOL_SHARE)


class Captured:
    """One captured call: static inputs the arguments are copied into, the
    graph, its static outputs, and the bytes its private pool reserved
    (``pool_bytes``)."""

    pool_bytes = 0
    # Recorded after a replay's outputs are copied out, on its stream: a
    # replay on another stream waits for it before it overwrites the
    # static buffers.
    done = None
    stream = None
    device = None

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.static = [persistent(torch.empty_strided, t.shape, t.stride(), dtype=t.dtype, device=t.device)
                       for t in _tensors(args, kwargs)]
        self._copy_in(args, kwargs)
        sargs, skwargs = _substitute(args, kwargs, iter(self.static))
        device = self.device = next((t.device for t in self.static if t.is_cuda), None)
        # On the tensors' GPU, whichever is current: the capture records the
        # current device's stream.
        with _on(device):
            live = contextlib.nullcontext() if device is None else LivePeak(device)
            with pack.graph_path(), live:
                # One eager call down the capture's own path first (the pack
                # kernel, the upsample always folded): every kernel the
                # capture records is then compiled and loaded. A Triton
                # kernel's first launch inside the capture invalidated
                # TAEF2's on the H200.
                fn(*sargs, **skwargs)
            if device is None:
                self._record(fn, sargs, skwargs, device, None)
            else:
                # What the warm-up left allocated once its outputs were
                # dropped (packs, buffers kept from a first call) may live
                # outside the pool or be made again inside it: reserves of
                # each factor without it and with it, and none, are tried,
                # smallest first, and the smallest pool kept (the others'
                # pools go with their graphs); a reserve no smaller than
                # the best pool so far cannot beat it (the pool holds the
                # reserve) and is skipped. A few captures of a host-bound
                # block, once per key; at most two pools held at once (the
                # best so far and the last). A peak over the auto bound (a big
                # VAE's, graphed on request) is captured once, without a
                # reserve: its blocks are not the ones the allocator rounds
                # up, and its pools are large.
                kept_bytes = max(0, torch.cuda.memory_allocated(device) - live.base)
                best = None
                for reserve in reserve_tries(live.peak, kept_bytes, auto_pool_bytes(device)):
                    if reserve is not None and best is not None and reserve >= best[2]:
                        continue
                    self._record(fn, sargs, skwargs, device, reserve)
                    if best is None or self.pool_bytes < best[2]:
                        best = (self.graph, self.out, self.pool_bytes)
                self.graph, self.out, self.pool_bytes = best
                self.stream = torch.cuda.current_stream(device)
                self.done = torch.cuda.Event()

    def _record(self, fn, sargs, skwargs, device, reserve: Optional[int]) -> None:
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a UI's preview) neither
        # breaks this capture nor is recorded in it.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            # Read inside: entering empties PyTorch's cache of free blocks,
            # which would hide the pool's growth (an allocator statistic, no
            # CUDA call).
            before = 0 if device is None else torch.cuda.memory_reserved(device)
            if reserve is not None:
                # One segment of the pool, freed at once (the tensor is not
                # kept): the capture's large blocks are split from it
                # (RESERVE_MIN says why).
                torch.empty(reserve, dtype=torch.uint8, device=device)
            self.out = fn(*sargs, **skwargs)
        if device is not None:
            # The private pool's segments (the call's activations and
            # outputs): what keeping this graph costs the device.
            self.pool_bytes = max(0, torch.cuda.memory_reserved(device) - before)

    def _copy_in(self, args, kwargs):
        for s, t in zip(self.static, _tensors(args, kwargs)):
            s.copy_(t)

    def __call__(self, args: tuple, kwargs: dict):
        if self.done is None:
            return self._replay(args, kwargs)
        with _on(self.device):
            stream = torch.cuda.current_stream()
            if stream != self.stream:
                stream.wait_event(self.done)
                self.stream = stream
            out = self._replay(args, kwargs)
            self.done.record()
        return out

    def _replay(self, args, kwargs):
        self._copy_in(args, kwargs)
        self.graph.replay()
        Work.n += 1  # conv-patch's own work (runtime.passthrough reads it)
        return _clone_out(self.out)


def _on(device: Optional[torch.device]):
    """``torch.cuda.device(device)`` where that is not the current device."""
    if device is None or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _tensors(args, kwargs):
    return [v for v in (*args, *(kwargs[k] for k in sorted(kwargs))) if isinstance(v, torch.Tensor)]


def _substitute(args, kwargs, it):
    sargs = tuple(next(it) if isinstance(v, torch.Tensor) else v for v in args)
    skwargs = {k: next(it) if isinstance(kwargs[k], torch.Tensor) else kwargs[k] for k in sorted(kwargs)}
    return sargs, skwargs


class GraphCache:
    """The graphs of one module (kept in its state's ``graphs``), keyed by call."""

    capture_cls = Captured

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS, auto: bool = False):
        self.max_graphs = int(max_graphs)
        # cuda_graphs="auto": the pools kept are bounded in bytes too
        # (auto_pool_bytes of the device captured on).
        self.auto = bool(auto)
        self.graphs: "OrderedDict[tuple, Any]" = OrderedDict()
        self.seen: "OrderedDict[tuple, None]" = OrderedDict()
        self.sig: Optional[list] = None
        self.recaptures = 0
        self.disabled: Optional[str] = None
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "too_large": 0}
        self.lock = threading.Lock()
        # The keys a compiling pass ran down the capture's path (``_ahead``).
        self.ahead: set = set()

    def __reduce__(self):
        # Graphs belong to this process and these tensors: a copy or an
        # unpickled model starts without any.
        return (GraphCache, (self.max_graphs, self.auto))

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()
        self.ahead.clear()

    def held_bytes(self) -> int:
        """Device bytes the kept graphs hold between calls: their pools and
        static inputs."""
        return sum(v.pool_bytes + sum(t.numel() * t.element_size() for t in v.static)
                   for v in self.graphs.values() if v is not _EAGER)

    def _disable(self, why: str) -> None:
        self.disabled = why
        self.clear()
        if not self.auto:
            # (Under "auto" nobody asked for graphs: the module runs as it
            # would without them, and ``disabled`` says why.)
            warnings.warn(f"conv-patch: CUDA graphs off for this module: {why}", RuntimeWarning, stacklevel=4)

    def takes(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call is captured or replayed: its key was graphed,
        or seen once before. (Asked before the call; a call that turns out
        not to be graphed runs eagerly.)"""
        key = self._key(args, kwargs)
        if key is None:
            return False
        entry = self.graphs.get(key)
        return entry is not _EAGER if entry is not None else key in self.seen

    def note(self, args: tuple, kwargs: dict) -> None:
        """A call that runs some other way (a recipe's ``unfused`` rule)
        but would be graphed: its key counts as seen, so that the next call
        with it captures."""
        key = self._key(args, kwargs)
        if key is not None and key not in self.graphs:
            self._note(key)

    def _refuses(self) -> bool:
        """This cache takes no call now: given up, traced, or inside another
        capture."""
        return self.disabled is not None or torch.compiler.is_compiling() or _capturing()

    def _key(self, args: tuple, kwargs: dict) -> Optional[tuple]:
        """The call's key, or None where this cache takes no call now
        (``_refuses``, or a pass compiling ahead)."""
        if self._refuses():
            return None
        if kernels().compiling_ahead():
            # (A pass compiling ahead launches nothing: no graph of it, and
            # its calls count for nothing: the user's second call captures.)
            return None
        return call_key(args, kwargs)

    def _note(self, key: tuple) -> None:
        self.seen[key] = None
        while len(self.seen) > _SEEN_LIMIT:
            self.seen.popitem(last=False)

    def __call__(self, module: nn.Module, fn: Callable, args: tuple, kwargs: dict):
        if kernels().compiling_ahead():
            # (A pass's call: not the user's, not counted.)
            self._ahead(fn, args, kwargs)
            return fn(*args, **kwargs)
        key = self._key(args, kwargs)
        if key is None or not self.lock.acquire(blocking=False):
            # (Locked: another thread is in this module's graphs; its static
            # buffers are not this call's to write.)
            self.stats["eager"] += 1
            return fn(*args, **kwargs)
        try:
            return self._call(module, fn, key, args, kwargs)
        finally:
            self.lock.release()

    def _ahead(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        """In a compiling pass, once per key this cache could capture: the
        call down the capture's own path too (``pack.graph_path``, as
        ``Captured``'s warm-up runs it: the pack kernel, the upsample always
        folded), so that the kernels the capture records compile in the
        pass and not at the user's second call, which captures."""
        if self._refuses():
            return
        key = call_key(args, kwargs)
        if key is None or key in self.ahead:
            return
        self.ahead.add(key)
        with pack.graph_path():
            fn(*args, **kwargs)

    def _call(self, module: nn.Module, fn: Callable, key: tuple, args: tuple, kwargs: dict):
        if torch.is_grad_enabled() and (any(t.requires_grad for t in _tensors(args, kwargs))
                                        or _params_need_grad(module)):
            self.stats["eager"] += 1
            return fn(*args, **kwargs)  # autograd would record it: never captured
        sig = signature(module)
        if sig == self.sig:
            # Stable since the last change: only back-to-back changes count
            # as streaming, an occasional LoRA swap does not.
            self.recaptures = 0
        else:
            if self.graphs:
                self.recaptures += 1
                if self.recaptures > MAX_RECAPTURES:
                    self._disable(f"its weights or structure changed {self.recaptures} times between calls "
                                  "(weights streamed in per call?)")
                    return fn(*args, **kwargs)
            # Keys that were graphed have proved they repeat: recaptured at
            # their next call, not run eagerly once more first.
            for k in self.graphs:
                self.seen[k] = None
            self.graphs.clear()
            self.sig = sig
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                self._note(key)
                self.stats["eager"] += 1
                return fn(*args, **kwargs)
            entry = self._capture(fn, key, args, kwargs)
        if entry is _EAGER:
            self.stats["eager"] += 1
            return fn(*args, **kwargs)
        self.graphs.move_to_end(key)
        self.stats["replays"] += 1
        return entry(args, kwargs)

    def _capture(self, fn, key, args, kwargs):
        try:
            entry = self.capture_cls(fn, args, kwargs)
            if not _graphable_out(entry.out):
                entry = _EAGER
        except Exception as e:  # noqa: BLE001 - a failed capture is reported and that key runs eagerly
            warnings.warn(f"conv-patch: CUDA graph capture failed, this input shape runs eagerly: "
                          f"{type(e).__name__}: {e}"
                          + (" (PatchConfig(cuda_graphs=False) turns graphs off)" if self.auto else ""),
                          RuntimeWarning, stacklevel=4)
            entry = _EAGER
        bound = self._pool_bound(entry)
        if bound is not None and entry.pool_bytes > bound:
            # Under "auto" a graph larger than the bound is not kept: this
            # key runs eagerly, as without graphs.
            self.stats["too_large"] += 1
            entry = _EAGER
        self.stats["captures"] += entry is not _EAGER
        self.seen.pop(key, None)
        self.graphs[key] = entry
        held = [v for v in self.graphs.values() if v is not _EAGER]
        while held and (len(held) > self.max_graphs
                        or (bound is not None and sum(v.pool_bytes for v in held) > bound)):
            old = next(k for k, v in self.graphs.items() if v is held[0])
            del self.graphs[old]
            held.pop(0)
        return entry

    def _pool_bound(self, entry) -> Optional[int]:
        """The bytes of pools this module may keep (None: any)."""
        if not self.auto or entry is _EAGER:
            return None
        return AUTO_POOL_BYTES if entry.device is None else auto_pool_bytes(entry.device)


def outermost(modules, is_candidate: Callable[[nn.Module], bool]):
    """(fqn, module) of each candidate with no candidate above it."""
    out = []

    def walk(m, fqn):
        if is_candidate(m):
            out.append((fqn, m))
            return
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{fqn}.{name}" if fqn else name)

    for prefix, m in modules:
        walk(m, prefix.rstrip("."))
    return out


def install(module: nn.Module, max_graphs: int, auto: bool = False) -> None:
    st = state_of(module)
    if st.graphs is None:
        st.graphs = GraphCache(max_graphs, auto)


def uninstall(module: nn.Module) -> None:
    st = peek(module)
    if st is not None:
        st.graphs = None


def cache_of(module: nn.Module) -> Optional[GraphCache]:
    """The module's graph cache (its captures, replays and eager calls in
    ``.stats``), or None."""
    st = peek(module)
    return None if st is None else st.graphs
