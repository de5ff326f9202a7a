"""The parts of a model call that conv-patch cannot speed up run as the
model's own classes.

A UNet at its usual sizes runs nearly every conv on PyTorch's route and its
norms in PyTorch (they are launch-bound there: ``costs.choose``), so its
wrappers and fused blocks compute exactly what the unpatched modules would,
through more Python. Eagerly, where the host sets the pace, that is slower
than not patching at all. So :func:`install` puts two hooks on each patched
model (the object handed to ``apply``, or each component of a pipeline) and
learns, per call signature of that model (``signature``: its arguments'
shapes, strides, dtypes and devices, flags by value, autograd, autocast,
the training flag), which of its *components* (wrappers and fused blocks)
did any work of conv-patch's own (``work.Work``: a Triton launch, a weight
pack read):

- the first call at a signature runs as patched (the plans get built);
- the second is watched: each outermost component (one no other component
  encloses) by a hook pair of its own for that call, and each fused block
  called as a module inside a busy one by its forward (``Watch.observe``);
- from the third on, the idle outermost components and the idle fused
  blocks called inside busy ones, with everything inside them, take their
  own class for the duration of the call (``obj.__class__ = own``, the way
  recipes fuse a block) and get the patched class back when it returns or
  raises. Their output is the unpatched modules' by construction; what
  stays patched is what ran the kernels.

A part a busy recipe calls directly (not as a module) stays as it is: the
recipe relies on it. A model that is itself a fused block keeps its class
(fixed once its call has begun). Nothing is learned or swapped while
torch.compile traces, on conv-patch's CUDA-graph path, while another call of
this process has components swapped or is watched (threads: a watched call
must see the patched classes), or for a block that can split its call into
row bands (``max_activation_gib``) or replay a CUDA graph. A learned
signature that no longer fits (a call whose components would now do work)
is only slower, never different: both classes compute the same function.

A recipe may also run a call of its block unfused (``run_unfused``: the
block's own forward, the fused blocks under it as their own classes for
that call) where it measured slower than ``recipes=False``; the convs under
it are then watched as the model's own outermost components would be, so
the idle ones pass through as above.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional

import torch
from torch import nn

from conv_patch.runtime import pack
from conv_patch.runtime.state import peek, state_of
from conv_patch.work import Work

# Learned signatures kept per model; a model called at more shapes than this
# starts over (each signature costs one watched call to learn again).
MAX_SIGNATURES = 32
# The first call at a signature builds plans (their build-time launches must
# not count): the second is the one watched.
_SEEN = "seen"


class Passthrough:
    """A model's learned signatures: ``plans[key]`` is ``_SEEN`` or a tuple
    of ``(component, own_class, patched_class)`` to swap for that call."""

    def __init__(self):
        self.plans: Dict[tuple, object] = {}
        self.generation = _Global.generation

    def __getstate__(self):
        # The swap lists name this process's module objects.
        return {"plans": {}, "generation": -1}

    def summary(self) -> List[tuple]:
        """(signature, components swapped) per learned signature."""
        return [(k, len(v)) for k, v in self.plans.items() if v is not _SEEN]


class _Thread(threading.local):
    def __init__(self):
        # One entry per hooked model call open in this thread:
        # (model, key, what) with what None, a Watch or a swap tuple.
        self.calls = []


_THREAD = _Thread()


class _Global:
    swapped = 0   # calls with components swapped, in any thread
    # Bumped when any wrapper's plans are dropped (an attribute, weight or
    # parametrization changed, ``.to()``): every model learns again.
    generation = 0


def changed() -> None:
    """A component changed (``dispatch.clear``): what any model learned may
    no longer hold (a weight that the kernels refused may be one they take
    now), so every model watches a call again."""
    _Global.generation += 1


def component_class(m: nn.Module) -> Optional[type]:
    """The class a conv-patch component runs as when passed through (its
    own, unpatched class), None for a module that is no component or cannot
    be passed through (``cp_own_class``)."""
    own = getattr(type(m), "cp_own_class", None)
    return None if own is None else own(m)


def is_component(m: nn.Module) -> bool:
    return getattr(type(m), "cp_own_class", None) is not None


def _busy_block(m: nn.Module) -> bool:
    st = peek(m)
    return st is not None and (st.bands is not None or st.graphs is not None)


def outermost_components(model: nn.Module) -> List[nn.Module]:
    """The components under ``model`` that no other component encloses."""
    found, seen, todo = [], set(), list(model._modules.values())
    while todo:
        m = todo.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        if is_component(m):
            found.append(m)
        else:
            todo.extend(m._modules.values())
    return found


def _key_of(v, depth: int = 0):
    if isinstance(v, torch.Tensor):
        return (v.shape, v.stride(), v.dtype, v.device)
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, float)):
        return type(v)
    if depth < 3:
        if isinstance(v, (list, tuple)):
            return (type(v), tuple([_key_of(e, depth + 1) for e in v]))
        if isinstance(v, dict):
            return (dict, tuple([(k, _key_of(e, depth + 1)) for k, e in v.items()]))
    return type(v)


def signature(model: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What decides which components of ``model`` do work in a call: the
    arguments' tensors by shape, strides, dtype and device, flags by value,
    numbers by type (a timestep is no reason to learn again), autograd,
    autocast and the model's training flag."""
    cast = tuple([torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in ("cuda", "cpu")])
    return (_key_of(args), _key_of(kwargs), torch.is_grad_enabled(), cast, model.training)


class Watch:
    """The watched call: a hook pair on each outermost component, and
    ``observe`` (called by every fused block's forward while a watch is on)
    on the fused blocks called inside them, note whether ``Work`` moved
    during their calls."""

    # The watch on in this process (one at a time: ``_enter``).
    now: Optional["Watch"] = None

    def __init__(self, model: nn.Module):
        self.busy, self.called, self.inside = set(), set(), set()
        self.start: Dict[int, int] = {}
        self.handles = []
        self.thread = threading.get_ident()
        Watch.now = self
        if is_component(model):
            # A fused block as the model (a TAESD stack): its own class is
            # fixed for this call; only blocks it calls can pass through.
            self.components = [model]
            self.busy.add(id(model))
            self.inside.add(id(model))
            return
        self.components = []
        self._hook(outermost_components(model))

    def _hook(self, components):
        for c in components:
            self.components.append(c)
            self.handles.append(c.register_forward_pre_hook(self._enter))
            self.handles.append(c.register_forward_hook(self._exit, always_call=True))

    def watch_below(self, block: nn.Module) -> None:
        """Watch the outermost components under ``block``, a busy fused
        block running as its own class with everything under it for this
        call (``run_unfused``), as if they were the model's own."""
        hooked = {id(c) for c in self.components}
        self._hook([c for c in outermost_components(block) if id(c) not in hooked])

    def _enter(self, m, args):
        self.start[id(m)] = Work.n
        self.inside.add(id(m))

    def _exit(self, m, args, output):
        self.inside.discard(id(m))
        if Work.n != self.start.pop(id(m), Work.n):
            self.busy.add(id(m))

    def observes(self, block: nn.Module) -> bool:
        """Whether ``block``'s call is one to note (not one already noted
        further up this call stack)."""
        return id(block) not in self.inside

    def observe(self, block: nn.Module, args: tuple, kwargs: dict):
        """``block``'s call, noted."""
        key = id(block)
        self.called.add(key)
        self.inside.add(key)
        n = Work.n
        try:
            return block.forward(*args, **kwargs)
        finally:
            self.inside.discard(key)
            if Work.n != n:
                self.busy.add(key)

    def close(self):
        Watch.now = None
        for h in self.handles:
            h.remove()
        self.handles = []

    def swaps(self) -> tuple:
        """(component, own class, patched class) for every component in an
        idle outermost component, and in an idle fused block called as a
        module inside a busy one (its parent calls it and takes what it
        returns; the parts a recipe calls directly stay as they are)."""
        out, seen = [], set()

        def take(c):
            fresh = [m for m in c.modules() if id(m) not in seen]
            seen.update(id(m) for m in fresh)
            out.extend(own_class_swaps(fresh))

        for c in self.components:
            if _busy_block(c):
                continue
            if id(c) not in self.busy:
                take(c)
                continue
            for m in c.modules():
                if (m is not c and id(m) not in seen and id(m) in self.called and id(m) not in self.busy
                        and not _busy_block(m)):
                    take(m)
        return tuple(out)


# ``m.__class__ = cls`` would go through nn.Module.__setattr__ (and a
# wrapper's, which drops its plans at any public assignment): a microsecond
# or more each, where this is the same store.
store = object.__setattr__


def own_class_swaps(blocks) -> tuple:
    """``(block, own class, patched class)`` for each of ``blocks`` that
    can run as its own class (``run_unfused``): a component, and not one
    that splits its call into bands or replays a CUDA graph."""
    out = []
    for c in blocks:
        own = component_class(c)
        if own is not None and own is not type(c) and not _busy_block(c):
            out.append((c, own, type(c)))
    return tuple(out)


def run_unfused(block: nn.Module, swaps: tuple, fn):
    """``fn()``, a fused block's call made by its own class's forward, with
    the blocks under it in ``swaps`` (``own_class_swaps``, made once by the
    caller: this runs at every call) running as their own classes for its
    duration: what ``recipes=False`` would run, where the recipes measured
    slower than that (a TAESD stack whose GroupNorms are PyTorch's). The
    patched convs under it stay patched, and where this is the watched call
    of the model around it they are watched like the model's own outermost
    components, so the idle ones pass through in its later calls. Off the
    graph path and outside torch.compile only (the caller checks): the swap
    is a class store, undone when ``fn`` returns or raises."""
    mine = []
    for c, own, patched in swaps:
        if type(c) is patched:  # (else changed since, or passed through already)
            store(c, "__class__", own)
            mine.append((c, own, patched))
    watch = Watch.now
    if watch is not None and watch.thread == threading.get_ident():
        watch.watch_below(block)
    try:
        return fn()
    finally:
        for c, own, patched in mine:
            if type(c) is own:
                store(c, "__class__", patched)


def _enter(model, args, kwargs):
    if torch.compiler.is_compiling():
        return None
    calls = _THREAD.calls
    st = peek(model)
    state = None if st is None else st.passthrough
    if calls or state is None or pack.GRAPH_PATH or torch.jit.is_tracing():
        calls.append((model, None, None))
        return None
    if state.generation != _Global.generation:
        state.plans.clear()
        state.generation = _Global.generation
    key = signature(model, args, kwargs)
    plan = state.plans.get(key)
    what = None
    if plan is None:
        if len(state.plans) >= MAX_SIGNATURES:
            state.plans.clear()
        state.plans[key] = _SEEN
    elif plan is _SEEN:
        if not _Global.swapped and Watch.now is None:
            what = Watch(model)
    elif Watch.now is None:
        for m, own, patched in plan:
            if type(m) is patched:  # (else changed since: left as it is)
                store(m, "__class__", own)
        _Global.swapped += 1
        what = plan
    calls.append((model, key, what))
    return None


def _exit(model, args, kwargs, output):
    if torch.compiler.is_compiling():
        return None
    calls = _THREAD.calls
    if not calls or calls[-1][0] is not model:
        return None  # this call's _enter did not run (an earlier hook raised)
    _, key, what = calls.pop()
    if what is None:
        return None
    if isinstance(what, Watch):
        what.close()
        st = peek(model)
        state = None if st is None else st.passthrough
        # A call that raised (no output) teaches nothing: watch the next one.
        if state is not None and output is not None and state.plans.get(key) is _SEEN:
            state.plans[key] = what.swaps()
        return None
    for m, own, patched in what:
        if type(m) is own:
            store(m, "__class__", patched)
    _Global.swapped -= 1
    return None


# A VAE is called through its ``decode``/``encode`` methods (a diffusers
# pipeline's ``vae.decode(latents)``), not its forward, and these call its
# ``decoder``/``encoder``: the parts hooked beside the model itself.
ENTRY_PARTS = (("decode", "decoder"), ("encode", "encoder"))


def entries(model: nn.Module) -> List[nn.Module]:
    """The parts of ``model`` that its other entry points than ``forward``
    call (``ENTRY_PARTS``): hooked too, so that a ``vae.decode`` call learns
    and passes through. Inside a call of the model's own forward their
    hooks do nothing (the outer call decides)."""
    out = []
    for method, part in ENTRY_PARTS:
        m = model._modules.get(part)
        if isinstance(m, nn.Module) and callable(getattr(type(model), method, None)):
            out.append(m)
    return out


def install(model: nn.Module) -> bool:
    """Hook ``model`` (and its ``entries``) for passing through; on a hooked
    model, forget what it learned (its components changed). A model that is
    a fused block itself keeps its class (fixed once its call has begun):
    what it calls can pass through. Whether it is hooked."""
    for m in (model, *entries(model)):
        st = state_of(m)
        if st.passthrough is not None and _hooked(m):
            st.passthrough.plans.clear()
            continue
        st.passthrough = Passthrough()
        m.register_forward_pre_hook(_enter, with_kwargs=True)
        m.register_forward_hook(_exit, with_kwargs=True, always_call=True)
    return True


def _hooked(model: nn.Module) -> bool:
    return carries_hook(model, _enter)


def carries_hook(m: nn.Module, fn) -> bool:
    """Whether ``fn`` is one of ``m``'s forward pre-hooks."""
    return any(h is fn for h in m._forward_pre_hooks.values())


def drop_hooks(m: nn.Module, *fns) -> None:
    """Take ``fns`` off ``m``'s forward hooks and pre-hooks (with their
    kwargs and always-called flags)."""
    for hooks in (m._forward_pre_hooks, m._forward_hooks):
        for k in [k for k, h in hooks.items() if any(h is fn for fn in fns)]:
            del hooks[k]
            m._forward_hooks_with_kwargs.pop(k, None)
            m._forward_pre_hooks_with_kwargs.pop(k, None)
            m._forward_hooks_always_called.pop(k, None)


def other_hooks(m: nn.Module) -> bool:
    """Whether ``m`` carries forward hooks besides the passthrough's and
    others of conv-patch's that expect nothing of how the module runs
    (marked ``cp_transparent``: the hook compiling ahead at a first call)."""
    return (any(h is not _enter and not getattr(h, "cp_transparent", False) for h in m._forward_pre_hooks.values())
            or any(h is not _exit and not getattr(h, "cp_transparent", False) for h in m._forward_hooks.values()))


def uninstall(model: nn.Module) -> None:
    """Take the hooks off ``model`` (and its ``entries``) and forget what it
    learned."""
    for m in (model, *entries(model)):
        st = peek(m)
        if st is not None:
            st.passthrough = None
        drop_hooks(m, _enter, _exit)


def learned(model: nn.Module) -> List[tuple]:
    """(signature, components passed through) per signature ``model`` has
    learned; [] where it is not hooked."""
    st = peek(model)
    return [] if st is None or st.passthrough is None else st.passthrough.summary()
