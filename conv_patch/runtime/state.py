"""What conv-patch keeps on a module between its calls: one typed object.

Every object conv-patch keeps something on (a patched conv, a fused block, a
norm whose calls are planned, a module a recipe caches an index on, a model
hooked for passthrough, a call site of the torch.compile op) holds at most
one ``State``, in its ``__dict__`` under ``STATE``. Its fields fall in two
kinds:

* options, set by ``apply`` and kept by ``copy.deepcopy`` and pickling (the
  original module, the user's table, the band hook, the graph cache and the
  passthrough state: the last three reduce to empty ones of their own);
* caches of this process (plans, packs, the last decision, the learned
  passthrough swaps...), rebuilt on demand: ``clear`` drops what a change
  of the module's attributes or parameters invalidates, and a copy or an
  unpickled model starts without any.
"""

from __future__ import annotations

STATE = "_cp"


class State:
    __slots__ = (
        # -- options (kept through copies and pickles) --
        "original",     # a wrapper's original module (its fallback class and ``unwrap``'s object)
        "table",        # PatchConfig.table, loaded (None: the architecture's own)
        "bands",        # parallel.BandHook of a fused Decoder/Encoder (PatchConfig.max_activation_gib)
        "graphs",       # graphs.GraphCache of an outermost fused block (PatchConfig.cuda_graphs)
        "passthrough",  # passthrough.Passthrough of a hooked model
        # -- caches --
        "spec",         # a wrapper's ConvSpec / Conv3dSpec, rebuilt after any attribute change
        "plans",        # call signature -> plan (a conv's, a norm's, a call site's)
        "bare",         # the bare fast path's slots -> (F.conv2d arguments, decision, activation, pack)
        "last",         # the RouteDecision of the last call (``conv_patch.last_route``)
        "pack",         # pack.PackEntry: the weight in the kernels' layout
        "subpixel",     # the folded upsample's weight buffer and its call sites
        "gate",         # (device, decision) of a Conv3d whose device decides every call
        "step_failed",  # why a kernel step outside the plans failed here (not tried again)
        "norm_plan",    # the RMS norm's plan of the last call
        "chain",        # a Sequential stack's plan of steps and layout facts
        "packs",        # pack.PackGroup of a fused block's convs
        "own_swaps",    # the class swaps of a stack that runs unfused
        "band_report",  # the BandReport of the last call through ``bands``
        "dup_index",    # Wan 2.2's DupUp3D shortcut: its gather index per device
    )
    OPTIONS = ("original", "table", "bands", "graphs", "passthrough")

    def __init__(self, **fields):
        for name in self.__slots__:
            object.__setattr__(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"State has no field {sorted(fields)[0]!r}")

    def clear(self) -> None:
        """Drop what the module's attributes or parameters decide (they
        changed): plans, the bare path's slots, the folded weights, the
        Conv3d gate, the spec."""
        self.plans = self.bare = self.subpixel = self.gate = self.spec = None

    def forget(self) -> None:
        """Drop every cache, keeping the options: what the calls so far
        built or learned, none of which may be used again (a pass whose
        launches only compiled: ``conv_patch.warmup``)."""
        for name in self.__slots__:
            if name not in self.OPTIONS:
                object.__setattr__(self, name, None)

    def drop_block(self) -> None:
        """Drop everything a fused block kept (``recipes.unfuse``)."""
        self.plans = self.norm_plan = self.chain = self.packs = self.own_swaps = None
        self.bands = self.band_report = self.graphs = None

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.OPTIONS if getattr(self, name) is not None}

    def __setstate__(self, fields):
        self.__init__(**fields)

    def __repr__(self) -> str:
        held = ", ".join(name for name in self.__slots__ if getattr(self, name) is not None)
        return f"State({held})"


def state_of(obj) -> State:
    """``obj``'s state, made on the first call."""
    d = obj.__dict__
    st = d.get(STATE)
    if st is None:
        st = d[STATE] = State()
    return st


def peek(obj):
    """``obj``'s state, or None where it has none (nothing is made)."""
    return obj.__dict__.get(STATE)
