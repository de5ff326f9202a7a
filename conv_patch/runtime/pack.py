"""Weight packing for the kernels, and why a pack can never be stale.

The kernels read the weight as a [C_out, C_in, KH, KW] view through its
strides. Their preferred storage is ``co, kh, kw, ci`` (the order PyTorch calls
channels_last for a weight): each output channel's reduction over
(kh, kw, ci) is one contiguous row, the K-major B operand of the GEMM. A weight
already stored that way (a model moved to channels_last, any 1x1 conv) is read
directly. Any other weight is copied into a pack buffer of that layout.

The pack buffer is cached per wrapper (its state's ``pack``), keyed on
``(data_ptr, device, shape, stride, dtype, layout)``: a key change (``.to()``,
``.half()``, a new tensor assigned to ``.data``) releases the old buffer and
allocates one of the new shape, so one weight holds at most one pack. The
tensor's ``_version`` is deliberately not trusted to prove the *contents*
unchanged: writes through ``.data`` (``p.data.mul_()``, ``p.data.copy_()``,
PEFT's LoRA merge ``weight.data += delta``) share the storage yet leave
``p._version`` as it was, so a version-keyed cache serves a stale pack. No
check cheaper than reading the weight is sound, so the buffer's contents are
rewritten from the weight on every call.

What that costs (bench.layers on an H200, bf16, FLUX.1 VAE decoder, all 35
convolutions; bench/results/layers-h200-2026-11-29.json): 0.33 ms of
refreshes per decode, against 24.3 ms of conv-patch convolution at 1024^2
(1.4% NHWC, 0.85% NCHW) and 8.8-11.5 ms at 512^2 (2.9-3.7%). The copy is
launch-bound (a 4.7 MB 512x512x3x3 weight refreshes in 13 us); a dedicated
Triton transpose kernel measured 0.28 ms per decode, too little gain to keep
when launched eagerly, where host time is the cost. Inside a CUDA graph only
GPU time counts: there the pack kernel (kernels/weight_prep.py) refreshes a
512x512x3x3 weight in ~2.5 us against PyTorch's 7.4 us strided copy, so
graph captures (and their warm-up call, ``graph_path``) use it. Reading the
NCHW weight in place with no pack at all ran 2.1-3.1x slower.

Grouped refreshes. Eagerly each refresh is a launch and its host time (~10
us on the H200's host), per conv per call. Within one call of a fused block
(a VAE decoder, a TAESD stack, a resnet block: ``grouped``) no weight
changes, so the block's packs are refreshed together at the start of its
call, in one launch (``PackGroup``), and a conv inside finds its pack fresh
(``refresh``). The group learns its members on the block's first call (the
convs whose packs were refreshed one by one during it) and re-checks each at
every call: a member whose weight was replaced (new storage) or that has a
forward hook (which may edit the weight in place before the conv runs)
refreshes its own pack at its call, as outside a group. Only packs read from
a module's registered weight join; a computed weight (the subpixel fold's)
is made during the call and refreshes itself.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from conv_patch.buffers import persistent
from conv_patch.ops.loader import kernels
from conv_patch.routing.registry import Route
from conv_patch.runtime.state import STATE, peek, state_of
from conv_patch.work import Work

PACK_LAYOUT = "co_kh_kw_ci"

_LIVE: "weakref.WeakSet[PackEntry]" = weakref.WeakSet()
# Set by conv_patch.runtime.graphs for the eager warm-up call before a capture, so
# that it takes the capture's path and launches (so compiles and loads)
# every kernel the capture records: a Triton kernel's first launch inside a
# capture can invalidate it. Public to read (the bare fast path reads it
# without a call); set only through ``graph_path``.
GRAPH_PATH = False
_STATS = {"allocations": 0, "refreshes": 0, "group_refreshes": 0}


@dataclass(eq=False)
class PackEntry:
    key: tuple
    buf: torch.Tensor
    # The grouped refresh (epoch) that last wrote ``buf``; 0: none.
    fresh: int = 0


class _Active(threading.local):
    """The fused block call running in this thread that refreshed its
    group's packs (``grouped``), per thread: another thread's block
    neither vouches for nor learns this thread's packs."""

    group = None
    epoch = 0


ACTIVE = _Active()
_EPOCHS = itertools.count(1)


def kernel_view(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight as the kernels index it: [C_out, C_in, KH, KW]."""
    return weight.transpose(0, 1) if transposed else weight


def route_weight(weight: torch.Tensor, route: Route, transposed: bool = False) -> torch.Tensor:
    """The weight of one call as route ``route``'s launcher reads it, where
    no pack is kept for it (the functional API, a Conv3d call): the 2-D TMA
    kernels' and the Conv3d TMA kernel's dense co,(kt,)kh,kw,ci box source,
    a copy where the weight is not already stored so (the Conv3d one is
    measured with its call: a copy of the weight, small beside a video
    conv's activations); the im2col route's dense [C_out, C_in, KH, KW]
    weight (a copy only where it is not dense); the portable kernels read any
    strides in place."""
    view = kernel_view(weight, transposed)
    if route in (Route.CONV2D_TMA, Route.CONV2D_TMA_PADDED):
        return kernel_layout(view)
    if route is Route.CONV2D_IM2COL:
        return view.contiguous()
    if route is Route.CONV3D_TMA and not view.is_contiguous(memory_format=torch.channels_last_3d):
        return view.contiguous(memory_format=torch.channels_last_3d)
    return view


def kernel_layout(view: torch.Tensor) -> torch.Tensor:
    """``view`` ([C_out, C_in, KH, KW], ``kernel_view``'s) stored as a pack
    holds it, co, kh, kw, ci densely: itself where it is already, else a
    copy (a pack's layout without a pack: the functional API's TMA calls,
    the tuner's probes)."""
    return view if is_kernel_layout(view) else view.contiguous(memory_format=torch.channels_last)


def is_kernel_layout(w: torch.Tensor) -> bool:
    """True when ``w`` ([C_out, C_in, KH, KW]) is stored co, kh, kw, ci densely."""
    return w.is_contiguous(memory_format=torch.channels_last)


def pack_key(weight: torch.Tensor) -> tuple:
    return (weight.data_ptr(), weight.device, tuple(weight.shape), weight.stride(),
            weight.dtype, PACK_LAYOUT)


def _allocate(view: torch.Tensor) -> torch.Tensor:
    return persistent(torch.empty, view.shape, dtype=view.dtype, device=view.device,
                      memory_format=torch.channels_last)


def packed_weight(holder, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight in the kernels' layout, read from ``weight`` during this call.

    ``holder`` (the wrapper, or a call site) keeps at most one ``PackEntry``
    (its state's ``pack``).
    """
    Work.n += 1
    st = state_of(holder)
    entry: Optional[PackEntry] = st.pack
    if entry is not None and entry.fresh and entry.fresh == ACTIVE.epoch and entry.key[0] == weight.data_ptr():
        # Refreshed from this storage at the start of this thread's fused
        # block call (``PackGroup`` checked the rest of the key then).
        return entry.buf
    view = kernel_view(weight.detach(), transposed)
    if is_kernel_layout(view):
        release(holder)
        return view
    key = pack_key(weight)
    if entry is None or entry.key != key:
        # Shape, dtype, device or storage changed: the old buffer is dropped
        # here, before the new one is allocated.
        release(holder)
        entry = st.pack = PackEntry(key, _allocate(view))
        _LIVE.add(entry)
        _STATS["allocations"] += 1
    return refresh(holder, entry, view, transposed)


def refresh(holder, entry: PackEntry, view: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``entry.buf`` holding ``view`` (the weight as the kernels index it)
    now: already, where this thread's fused block call refreshed it at its
    start (module docstring), else copied here, and learnt by that block's
    group."""
    if entry.fresh and entry.fresh == ACTIVE.epoch:
        return entry.buf
    if on_graph_path(view):
        # Inside a CUDA graph (PatchConfig(cuda_graphs=True)) the refresh is
        # GPU time at every replay, and a launch costs no host time: the
        # pack kernel moves a 512x512x3x3 weight in a fraction of the 7.4 us
        # PyTorch's strided copy took on the H200 (kernels/weight_prep.py).
        # Eagerly the copy stays: there the launch's host time is the cost.
        kernels().launch_weight_pack(view, entry.buf)
    else:
        entry.buf.copy_(view)
    _STATS["refreshes"] += 1
    group = ACTIVE.group
    if group is not None:
        group.learn(holder, entry, transposed)
    return entry.buf


class PackGroup:
    """The packs one fused block's convs read, refreshed together at the
    start of each of its calls (module docstring): one launch per (device,
    dtype), its arguments rebuilt only when a member's weight or pack moved."""

    def __init__(self):
        self.members = {}  # id(holder) -> (weakref to holder, transposed)
        self.args = None  # (signature, [launch arguments]) of the last launch
        self.broken = None  # why grouped refreshes stopped (a failed launch)

    def learn(self, holder, entry: PackEntry, transposed: bool) -> None:
        params = holder.__dict__.get("_parameters")
        if params is None or self.broken or id(holder) in self.members:
            return
        w = params.get("weight")
        if w is None or w.data_ptr() != entry.key[0]:
            return  # not the module's registered weight (a computed one)
        self.members[id(holder)] = (weakref.ref(holder), transposed)

    def _current(self) -> list:
        """(entry, weight, transposed) of each member whose pack still holds
        its registered weight, with no forward hooks; members gone are
        dropped."""
        out, gone = [], []
        for k, (ref, transposed) in list(self.members.items()):
            m = ref()
            if m is None:
                gone.append(k)
                continue
            d = m.__dict__
            st = d.get(STATE)
            entry, w = None if st is None else st.pack, d["_parameters"].get("weight")
            if (entry is None or w is None or d["_forward_pre_hooks"] or d["_forward_hooks"]
                    or w.data_ptr() != entry.key[0] or w.stride() != entry.key[3]):
                continue
            out.append((entry, w, transposed))
        for k in gone:
            del self.members[k]
        return out

    def refresh(self) -> int:
        """Every current member's pack rewritten from its weight; the epoch
        that marks them fresh (0: nothing refreshed)."""
        if not self.members or self.broken:
            return 0
        current = self._current()
        if not current:
            return 0
        # (Each member's weight was checked against its pack's key above:
        # the addresses and strides the launch's arguments hold.)
        sig = tuple([(e.buf.data_ptr(), e.key[0], e.key[3]) for e, _, _ in current])
        k = kernels()
        try:
            if self.args is None or self.args[0] != sig:
                if foreign_capture(current[0][1]):
                    return 0  # building the arguments copies to the device: not inside someone's capture
                groups = {}
                for e, w, transposed in current:
                    view = w.detach().transpose(0, 1) if transposed else w.detach()
                    groups.setdefault((view.device, view.dtype), []).append((view, e.buf))
                self.args = (sig, [persistent(k.grouped_pack_args, pairs) for pairs in groups.values()])
            for args in self.args[1]:
                k.launch_grouped_weight_pack(args)
        except Exception as e:
            # Nothing was marked fresh: each pack refreshes itself at its
            # conv's call, from now on (a launch that failed here fails again).
            self.broken = f"{type(e).__name__}: {str(e).strip()[:160]}"
            self.args = None
            return 0
        epoch = next(_EPOCHS)
        for e, _, _ in current:
            e.fresh = epoch
        _STATS["group_refreshes"] += 1
        return epoch


def grouped(block, fn, args, kwargs):
    """``fn(*args, **kwargs)``, the call of fused block ``block``, with its
    group's packs refreshed in one launch at the start (module docstring).
    For the outermost fused block of a call, off the graph path
    (``FusedBlock.forward`` checks): a block called inside it runs
    plainly, and this block's group learns and refreshes its packs."""
    st = state_of(block)
    group = st.packs
    if group is None:
        group = st.packs = PackGroup()
    ACTIVE.epoch = group.refresh()
    ACTIVE.group = group
    try:
        return fn(*args, **kwargs)
    finally:
        ACTIVE.group = None
        ACTIVE.epoch = 0


@contextlib.contextmanager
def graph_path():
    """Calls inside run as inside a CUDA graph capture (``on_graph_path``)."""
    global GRAPH_PATH
    before, GRAPH_PATH = GRAPH_PATH, True
    try:
        yield
    finally:
        GRAPH_PATH = before


def on_graph_path(t: torch.Tensor) -> bool:
    """Whether work on ``t`` is being captured into a CUDA graph (or is the
    eager warm-up of that capture): launches then cost no host time at
    replay, only GPU time."""
    return t.is_cuda and (GRAPH_PATH or torch.cuda.is_current_stream_capturing())


def graph_flag(t: torch.Tensor) -> bool:
    """The graph flag of a plan's signature: conv-patch's own graph path
    (``graph_path``: the warm-up and capture of ``PatchConfig(cuda_graphs=True)``).
    A capture made by someone else (a user's ``torch.cuda.graph``,
    torch.compile's cudagraphs) is not in the signature: asking CUDA whether
    the stream is capturing cost every planned call microseconds of host
    time. A plan built during such a capture is weighed as on the graph
    path and not kept (``foreign_capture``); a plan built eagerly and
    replayed inside one records the same launches, its kernels loaded by
    the eager call that built it."""
    return GRAPH_PATH and t.is_cuda


def foreign_capture(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on ``t``'s device outside
    conv-patch's graph path (asked only where a plan is built)."""
    return t.is_cuda and not GRAPH_PATH and torch.cuda.is_current_stream_capturing()


def release(holder) -> None:
    st = peek(holder)
    if st is not None:
        st.pack = None


def stats() -> dict:
    """Live pack buffers and their bytes, plus allocation/refresh counters
    (``refreshes``: one pack at a time; ``group_refreshes``: grouped
    launches)."""
    live = list(_LIVE)
    return {
        "live": len(live),
        "bytes": sum(e.buf.numel() * e.buf.element_size() for e in live),
        **_STATS,
    }
