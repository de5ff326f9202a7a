"""How a recipe takes over a block, and the fused steps recipes are made of.

A recipe does not replace the user's block object: it gives the *same object*
a subclass of its own class whose ``forward`` runs the fused computation
(``block.__class__ = Fused<Block>``). ``isinstance``, the state-dict keys, the
parameters, hooks and attributes are untouched, and ``remove()`` puts the
original class back. The fused forward checks at every call that it may run
(eval-mode dropout, no autograd, no hooks on the parts it bypasses, the
arguments it was written for); otherwise it calls the class's own forward.

The steps (``group_norm``, ``conv``, ``upsample_conv``) run conv-patch's
kernels where the module is patched and the kernels can take the call, and
the module's own computation otherwise, so a conv excluded by ``filter_fn`` or
falling back for any reason keeps its exact PyTorch semantics.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from conv_patch import functional
from conv_patch.activations import ChannelSlopes, eager_epilogue, leaky_relu
from conv_patch.ops.conv2d import to_nhwc
from conv_patch.ops.loader import kernel_errors
from conv_patch.routing import costs
from conv_patch.runtime import dispatch, pack, passthrough
from conv_patch.runtime.plans import forward_with_padding, kernel_failure
from conv_patch.runtime.state import peek, state_of
from conv_patch.specs import KERNEL_DTYPES, needs_grad
from conv_patch.target import target_for
from conv_patch.runtime.wrappers import (PatchedCausalConv3d, PatchedConv3d, PatchedConvMixin, comfy_active,
                                         is_comfy_conv_class)
from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)


class Recipe:
    """A named rewrite: ``match(module)`` says whether it applies (by class
    name and structure, never by import path, so copies of a class in other
    packages, like ComfyUI's, are recognised); ``forward(module, *a, **k)``
    is the fused forward, ``base(module, *a, **k)`` the class's own."""

    name = ""
    what = ""
    # Whether the block runs convs whose weight packs its calls refresh as
    # a group (``pack.grouped``); a norm's recipe runs none.
    runs_convs = True

    def match(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def forward(self, module, *args, **kwargs):
        raise NotImplementedError

    # ``unfused(module, args, kwargs)``, where a recipe defines it: for a
    # call the recipe measured slower than its block's own forward with
    # everything under it unpatched-but-for-the-convs (``recipes=False``),
    # the class swaps that make it so (``passthrough.own_class_swaps``);
    # None for a call the recipe runs. Asked at every call of the block,
    # before its pack group is refreshed, except the calls its CUDA graphs
    # capture or replay (``FusedBlock.forward`` asks them first).
    unfused = None

    # ``lean``, where a recipe defines it: a mixin whose ``forward``
    # computes exactly what the block's own class does (the same ops in the
    # same order, the same values) through fewer Python calls and launches,
    # or calls that class's forward where it cannot. Put in front of the
    # block's own class (``lean_class``), it is the class the block runs as
    # when passed through (``cp_own_class``: idle at its call's signature,
    # ``runtime.passthrough``), where the host sets the pace.
    lean = None

    def lean_for(self, cls: type):
        """The ``lean`` mixin for this recipe's blocks of class ``cls``
        (None: they run as ``cls`` itself when passed through). A recipe
        whose lean forward was written from one class's forward (matching
        copies of it by name) says here which classes it holds for."""
        return self.lean

    # From how many input pixels (N·H·W of a 4-D input, at the traced
    # sizes) a traced call of the block is one op running its fused forward
    # eagerly (``runtime.compiled.whole_block``); None: never. For blocks
    # whose eager fused run beats what Inductor makes of the unpatched block
    # at such sizes (the big VAE halves), where tracing the recipe's ops
    # measured slower than that eager run (docs/performance.md).
    whole_from = None

    # ``bands(module)``, where a recipe defines it: the block's layers as
    # ``layers.Layers`` for a call in row bands (conv_patch.parallel runs
    # them; ``layers.UnsupportedModel`` where this block's structure is not
    # the one the recipe knows). None: the block is not run in bands.
    bands = None

    # Whether this recipe's blocks are bound by the host at the sizes they
    # run (narrow convs one after another: each launch's GPU work is
    # shorter than issuing it). A stack of them replays CUDA graphs by
    # default (``auto_graphs``).
    host_bound = False

    def auto_graphs(self, module) -> bool:
        """Whether ``module``, an outermost fused block, replays CUDA graphs
        under ``PatchConfig(cuda_graphs="auto")`` (the default): blocks whose
        eager calls are bound by the host at the sizes they run, so that
        issuing their launches, not the GPU, sets their pace
        (``runtime/graphs.py``)."""
        return False

    def upsample_convs(self, module) -> tuple:
        """The convs this recipe runs on a nearest-x2 upsampled input as
        the four 2x2 convs of ``functional.upsample_conv2d`` (the tuner traces
        those, not the 3x3 conv on the 4x input the unpatched model runs)."""
        return ()


class FusedBlock:
    """Mixed in first: the fused forward; the block's class stays a base."""

    cp_recipe: Recipe = None
    cp_base: type = nn.Module

    def forward(self, *args, **kwargs):
        if not kernels_may_run_on(args, kwargs):
            # No kernel runs on this device (a CPU without the interpreter):
            # the block's own forward, so that a patched model computes
            # exactly what the unpatched one does (a recipe's NHWC layout
            # alone changes the CPU's rounding).
            return self.cp_own_forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Traced, no watch learns, no ``unfused`` rule applies and no
            # pack group is made (each says so itself); not asking them keeps
            # their reads out of the compiled graph's guards. A block whose
            # recipe says so (``whole_from``) is one op running this forward eagerly.
            from conv_patch.runtime import compiled
            y = compiled.traced_block(self, args, kwargs)
            return self.cp_run(*args, **kwargs) if y is None else y
        watch = passthrough.Watch.now
        if watch is not None and watch.observes(self):
            # A passthrough watch is learning which fused blocks do work.
            return watch.observe(self, args, kwargs)
        st = peek(self)
        graphs = None if st is None else st.graphs
        # A call its CUDA graphs capture or replay (PatchConfig.cuda_graphs)
        # runs the recipe inside the graph: no ``unfused`` rule, no group.
        graphed = graphs is not None and graphs.takes(args, kwargs)
        unfused = self.cp_recipe.unfused
        if unfused is not None and not graphed:
            swaps = unfused(self, args, kwargs)
            if swaps is not None:
                if graphs is not None:
                    graphs.note(args, kwargs)  # (its next call with these arguments captures)
                if not swaps and watch is None:
                    # Nothing fused below to swap, no watch to tell: the
                    # block's own forward, without run_unfused's frames.
                    return self.cp_idle_forward(*args, **kwargs)
                return passthrough.run_unfused(self, swaps, functools.partial(self.cp_own_forward, *args,
                                                                              **kwargs))
        if (self.cp_recipe.runs_convs and not graphed and pack.ACTIVE.group is None and not pack.GRAPH_PATH
                and not torch.compiler.is_compiling()):
            # The outermost fused block of this call (no group active in this
            # thread), run eagerly: its convs' weight packs are refreshed
            # together at its start (conv_patch/pack.py says why). (A graph's
            # capture refreshes them inside the graph.)
            return pack.grouped(self, self.cp_run, args, kwargs)
        return self.cp_run(*args, **kwargs)

    def cp_own_forward(self, *args, **kwargs):
        """The block's own class's forward (``cp_base.forward``) on this
        block, reached through ``super()``: torch.compile traces that where
        it cannot trace the class's function called on the block (diffusers'
        ``Attention`` class is one of Dynamo's in-graph callables, and
        ``Attention.forward(block, ...)`` breaks the graph)."""
        return super().forward(*args, **kwargs)

    def cp_idle_forward(self, *args, **kwargs):
        """The block's own forward, for a call its recipe runs unfused with
        nothing below to swap: through the recipe's ``lean`` forward where
        it has one, the block running as the class it is passed through as
        (``cp_own_class``) for the call, as the passthrough would run it (a
        model that is such a block itself, an upscaler, is never passed
        through: its class is fixed once its call has begun)."""
        own = self.cp_own_class()
        if own is self.cp_base:
            return self.cp_own_forward(*args, **kwargs)
        patched = type(self)
        passthrough.store(self, "__class__", own)
        try:
            return own.forward(self, *args, **kwargs)
        finally:
            if type(self) is own:
                passthrough.store(self, "__class__", patched)

    def cp_run(self, *args, **kwargs):
        st = peek(self)
        bands = None if st is None else st.bands
        if bands is not None:
            # PatchConfig(max_activation_gib=...) on a VAE Decoder/Encoder:
            # the call in bands where its activations would not fit.
            y = bands(self, args, kwargs)
            if y is not None:
                return y
        graphs = None if st is None else st.graphs
        if graphs is not None:
            # PatchConfig(cuda_graphs=True) on an outermost fused block.
            return graphs(self, functools.partial(self.cp_recipe.forward, self), args, kwargs)
        return self.cp_recipe.forward(self, *args, **kwargs)

    def cp_own_class(self) -> type:
        """The class this block runs as when ``conv_patch.runtime.passthrough``
        passes it through: its own, with the recipe's ``lean`` forward in
        front where it has one."""
        lean = self.cp_recipe.lean_for(self.cp_base)
        return self.cp_base if lean is None else lean_class(self.cp_base, lean)

    def __reduce_ex__(self, protocol):
        # The dynamic class cannot be found by name when unpickling. (The
        # state's caches do not travel: runtime/state.py.)
        return (_rebuild, (self.cp_base, self.cp_recipe.name), self.__getstate__())


def kernels_may_run_on(args: tuple, kwargs: dict) -> bool:
    """Whether conv-patch's kernels can run on the device of a block call's
    first tensor argument (True where there is none: the recipe decides).
    A CUDA tensor is asked no further: this runs at every fused block's
    call, and a GPU without kernels (older than sm80) runs the recipes'
    steps on PyTorch's ops in the same layout as the GPUs that have them."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.is_cuda or target_for(v.device).kernels
    return True


REGISTRY: Dict[str, Recipe] = {}
_CLASSES: Dict[tuple, type] = {}


def register(recipe: Recipe) -> Recipe:
    REGISTRY[recipe.name] = recipe
    return recipe


def fused_class(cls: type, recipe: Recipe) -> type:
    key = (cls, recipe.name)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Fused{cls.__name__}", (FusedBlock, cls), {
            "cp_recipe": recipe, "cp_base": cls, "__module__": __name__,
            "__qualname__": f"Fused{cls.__name__}",
            "__doc__": f"{cls.__module__}.{cls.__qualname__} with conv-patch's {recipe.name!r} recipe.",
        })
    return _CLASSES[key]


def lean_class(cls: type, lean: type) -> type:
    """``cls`` with the mixin ``lean`` in front (``Recipe.lean``), under
    ``cls``'s own name."""
    key = (cls, lean)
    if key not in _CLASSES:
        _CLASSES[key] = type(cls.__name__, (lean, cls), {
            "__module__": __name__, "__qualname__": cls.__name__,
            "__doc__": f"{cls.__module__}.{cls.__qualname__} run through conv-patch's {lean.__name__}.",
        })
    return _CLASSES[key]


_WRITTEN_OUT: Dict[tuple, bool] = {}


def written_out(cls: type, method: str, params: tuple, module: str) -> bool:
    """Whether ``cls`` defines ``method`` itself, as a plain function of the
    module ``module`` (or a module under it: ``"diffusers."``) taking the
    parameters ``params``: the contract a lean forward written from that
    method relies on. A method replaced at run time (a wrapper some library
    installs, a ``functools.wraps`` decorator) is another function and is
    read again. Cached per class and method object."""
    fn = cls.__dict__.get(method)
    key = (cls, method, fn, params, module)
    ok = _WRITTEN_OUT.get(key)
    if ok is None:
        import inspect
        ok = False
        if (inspect.isfunction(fn) and not hasattr(fn, "__wrapped__")
                and (fn.__module__ == module or module.endswith(".") and fn.__module__.startswith(module))
                and (cls.__module__ == module or module.endswith(".") and cls.__module__.startswith(module))):
            try:
                ok = tuple(inspect.signature(fn, follow_wrapped=False).parameters) == params
            except (TypeError, ValueError):
                ok = False
        _WRITTEN_OUT[key] = ok
    return ok


def forward_names(cls) -> frozenset:
    """The names ``cls.forward`` reads (``co_names``), by which a recipe
    tells a forward it wrote its own from; cached per function (rules
    asked at every call of a block read it)."""
    fn = getattr(cls, "forward", None)
    names = _FORWARD_NAMES.get(fn)
    if names is None:
        code = getattr(fn, "__code__", None)
        names = frozenset(code.co_names) if code is not None else frozenset()
        if fn is not None:
            _FORWARD_NAMES[fn] = names
    return names


_FORWARD_NAMES: dict = {}


def hookless(m: nn.Module) -> bool:
    """No forward hooks on ``m`` (global hooks are the caller's check, made
    once per call)."""
    return not m._forward_hooks and not m._forward_pre_hooks


def bare(m: Optional[nn.Module], cls: type) -> bool:
    """Whether ``m`` is exactly a ``cls`` (no subclass, no conv-patch class,
    no parametrization) with no forward hooks: its forward may then be run
    as the function it calls."""
    return type(m) is cls and hookless(m)


# -- lean steps ----------------------------------------------------------------
# A lean forward (``Recipe.lean``) runs each part inline where it is the
# exact PyTorch class with no hooks, and calls it as a module otherwise (what
# its parent's own forward does: a LoRA layer, a hooked or replaced module
# runs as itself). Each step says whether its output is a tensor made there
# (``mine``), so that a later step may write into it in place: a module
# called as one may hand back a tensor that someone else holds.

def bare_conv(m) -> bool:
    return bare(m, nn.Conv2d) and m.padding_mode == "zeros"


def conv_of(m: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """What a bare ``nn.Conv2d``'s forward computes (``bare_conv``); its
    parameters read from their dictionary (``m.weight`` goes through
    ``nn.Module.__getattr__``)."""
    p = m._parameters
    return F.conv2d(x, p["weight"], p["bias"], m.stride, m.padding, m.dilation, m.groups)


def inline_conv(m, x: torch.Tensor) -> tuple:
    """(output, mine) of the conv ``m`` on ``x``."""
    if bare_conv(m):
        return conv_of(m, x), True
    return m(x), False


def inline_linear(m, x: torch.Tensor) -> tuple:
    """(output, mine) of the linear ``m`` on ``x``."""
    if bare(m, nn.Linear):
        p = m._parameters
        return F.linear(x, p["weight"], p["bias"]), True
    return m(x), False


def inline_norm(m, x: torch.Tensor) -> torch.Tensor:
    """The LayerNorm or GroupNorm ``m`` on ``x`` (always a new tensor)."""
    if bare(m, nn.LayerNorm):
        p = m._parameters
        return F.layer_norm(x, m.normalized_shape, p.get("weight"), p.get("bias"), m.eps)
    if bare(m, nn.GroupNorm):
        p = m._parameters
        return F.group_norm(x, m.num_groups, p.get("weight"), p.get("bias"), m.eps)
    return m(x)


def inline_step(m, h: torch.Tensor, mine: bool) -> tuple:
    """(output, mine) of one module of a conv/activation chain on ``h``
    (``mine``: a tensor made here, which an activation may overwrite, as an
    in-place activation module does anyway): inline where it is a bare
    conv, GroupNorm, ReLU, SiLU, LeakyReLU or PReLU, called as a module
    otherwise."""
    if bare_conv(m):
        return conv_of(m, h), True
    t = type(m)
    if t is nn.GroupNorm and hookless(m):
        return inline_norm(m, h), True
    if t is nn.ReLU and hookless(m):
        return F.relu(h, inplace=mine or m.inplace), mine
    if t is nn.SiLU and hookless(m):
        return F.silu(h, inplace=mine or m.inplace), mine
    if t is nn.LeakyReLU and hookless(m):
        return F.leaky_relu(h, m.negative_slope, inplace=mine or m.inplace), mine
    if t is nn.PReLU and hookless(m):
        return F.prelu(h, m._parameters["weight"]), True
    return m(h), False


def inline_chain(modules, h: torch.Tensor, mine: bool) -> tuple:
    """(output, mine) of ``modules`` applied in order (``inline_step`` each):
    an ``nn.Sequential``'s or ``nn.ModuleList``'s modules, read from its
    ``_modules``."""
    for m in modules:
        h, mine = inline_step(m, h, mine)
    return h, mine


def adds_into(h: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``h.add_(t)`` (``h`` a tensor the caller made and no one else
    holds) gives the tensor ``h + t`` and ``t + h`` give: ``t`` broadcasts
    into ``h``'s shape with the same dtype and device, and as a full-size
    operand has the same strides (so the sum's layout is ``h``'s either way)."""
    return t.dtype == h.dtype and t.device == h.device and (
        t.shape == h.shape and t.stride() == h.stride()
        or t.dim() == 4 and t.shape[2:] == (1, 1) and t.shape[:2] == h.shape[:2])


def sum_into(h: torch.Tensor, mine: bool, t: torch.Tensor) -> torch.Tensor:
    """``h + t``, in place where ``h`` is a tensor made here and that gives
    the same tensor (``adds_into``)."""
    return h.add_(t) if mine and adds_into(h, t) else h + t


def _rebuild(cls: type, name: str):
    klass = fused_class(cls, REGISTRY[name])
    block = klass.__new__(klass)
    if klass.cp_recipe.whole_from is not None:
        from conv_patch.runtime import compiled
        compiled.register_whole(block)
    return block


def is_fused(module: nn.Module) -> bool:
    return isinstance(module, FusedBlock)


def launched_on_gpu(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` is launched eagerly on a GPU, where host time
    is a cost: a CUDA tensor, off the CUDA-graph path (``unfused`` rules)."""
    return x.is_cuda and not pack.GRAPH_PATH


def fused_below(m) -> tuple:
    """The fused blocks under ``m``."""
    return tuple([c for c in m.modules() if c is not m and is_fused(c)])


def swaps_below(m, made_from) -> tuple:
    """``passthrough.own_class_swaps`` of the fused blocks under ``m`` (an
    ``unfused`` rule's answer), kept in ``m``'s state while ``made_from``
    (what the caller built them from: its children, its plan) is unchanged:
    the walk would cost more than the call it saves."""
    st = state_of(m)
    held = st.own_swaps
    if held is None or (held[0] is not made_from and held[0] != made_from):
        held = st.own_swaps = (made_from, passthrough.own_class_swaps(fused_below(m)))
    return held[1]


def base(module, *args, **kwargs):
    """The block's own forward (what it computes unpatched)."""
    return module.cp_own_forward(*args, **kwargs)


# -- call-time guards ---------------------------------------------------------
def global_hooks() -> bool:
    m = torch_module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks
                or getattr(m, "_global_forward_hooks_always_called", None))


def plain(*modules: Optional[nn.Module]) -> bool:
    """No forward hooks on the modules a fused forward calls around (a hook
    there expects to see that module run)."""
    if global_hooks():
        return False
    for m in modules:
        if m is not None and not hookless(m):
            return False
    return True


def parts(m: nn.Module, *names: str) -> tuple:
    """``m``'s submodules (or plain attributes) ``names``, None where
    absent, read from its dictionaries: a fused forward runs at every call,
    and ``m.name`` of a submodule goes through ``nn.Module.__getattr__``
    (about a microsecond each on a GPU host, a dozen per block)."""
    mods, d = m.__dict__["_modules"], m.__dict__
    return tuple([mods[n] if n in mods else d.get(n) for n in names])  # a list: no generator frame


def inference(x: torch.Tensor, *modules: Optional[nn.Module]) -> bool:
    """Nothing needs autograd: the fused steps compute no backward."""
    if not torch.is_grad_enabled():
        return True  # no_grad / inference_mode: nothing is recorded (and no parameter walk per call)
    params = [p for m in modules if m is not None for p in m.parameters(recurse=False)]
    return not needs_grad(x, *params)


def dropout_is_identity(m: Optional[nn.Module]) -> bool:
    return m is None or isinstance(m, nn.Identity) or (
        type(m) is nn.Dropout and (not m.training or m.p == 0.0))


def named(m, name: str) -> bool:
    """``m``'s own class (a fused block's base class) is called ``name``:
    recipes match by class name and structure, never by import path."""
    return getattr(type(m), "cp_base", type(m)).__name__ == name


def matches(recipe: Recipe, m) -> bool:
    """``recipe.match(m)``, False for a module it chokes on."""
    try:
        return bool(recipe.match(m))
    except Exception:  # noqa: BLE001 - an odd module simply does not match
        return False


def is_silu(m) -> bool:
    return type(m) is nn.SiLU


def is_relu(m) -> bool:
    return type(m) is nn.ReLU


# One ChannelSlopes per nn.PReLU, so its kernels' (bias, slope) buffer is
# kept between calls (and freed with the module).
_SLOPES: "weakref.WeakKeyDictionary[nn.PReLU, ChannelSlopes]" = weakref.WeakKeyDictionary()


def epilogue_activation(m):
    """The epilogue activation module ``m`` computes, or None: ``"relu"``,
    ``"silu"``, a LeakyReLU's table name (``activations.leaky_relu``: None
    for a slope the kernels cannot carry), an ``nn.PReLU``'s
    ``ChannelSlopes`` (one per module)."""
    t = type(m)
    if t is nn.ReLU:
        return "relu"
    if t is nn.SiLU:
        return "silu"
    if t is nn.LeakyReLU:
        return leaky_relu(m.negative_slope)
    if t is nn.PReLU:
        act = _SLOPES.get(m)
        if act is None:
            act = _SLOPES[m] = ChannelSlopes(m)
        return act
    return None


def is_conv(m, k: Optional[int] = None, stride: int = 1, padding: Optional[int] = None) -> bool:
    """A plain (or patched) 2-D convolution with square ``k``, ``stride``,
    dilation 1, groups 1, zero padding ``padding``."""
    if not isinstance(m, nn.Conv2d) or isinstance(m, nn.ConvTranspose2d):
        return False
    if m.groups != 1 or tuple(m.dilation) != (1, 1) or m.padding_mode != "zeros":
        return False
    if k is not None and tuple(m.kernel_size) != (k, k):
        return False
    if tuple(m.stride) != (stride, stride):
        return False
    return padding is None or (not isinstance(m.padding, str) and tuple(m.padding) == (padding, padding))


def is_group_norm(m) -> bool:
    """``nn.GroupNorm`` whose forward is the torch one (ComfyUI's GroupNorm
    overrides it with the same contract unless it is casting weights)."""
    if not isinstance(m, nn.GroupNorm):
        return False
    cls = getattr(type(m), "cp_base", type(m))
    return cls.forward is nn.GroupNorm.forward or is_comfy_conv_class(cls)


def spatial_norm_parts(m, name: str, conv_ok: Callable) -> Optional[tuple]:
    """(norm_layer, conv_y, conv_b) of a spatially conditioned norm of class
    ``name`` (``GroupNorm(f) * conv_y(zq) + conv_b(zq)``, ``zq`` resized to
    ``f``: MoVQ's ``SpatialNorm``, CogVideoX's ``CogVideoXSpatialNorm3D``)
    whose two convs pass ``conv_ok``, else None."""
    if not named(m, name):
        return None
    norm, conv_y, conv_b = parts(m, "norm_layer", "conv_y", "conv_b")
    return (norm, conv_y, conv_b) if is_group_norm(norm) and conv_ok(conv_y) and conv_ok(conv_b) else None


def rms_norm_params(m) -> Optional[tuple]:
    """``(weight, bias, scale, eps, False)`` of an RMS norm over channels of the
    Wan family (diffusers' ``WanRMS_norm`` and ``QwenImageRMS_norm``,
    ComfyUI's ``RMS_norm``: ``F.normalize(x, dim=1) * scale * gamma +
    bias``), or None. ``bias`` is None where the module adds nothing (its
    ``0.0`` or ``None``)."""
    cls = getattr(type(m), "cp_base", type(m))
    if not (isinstance(m, nn.Module) and cls.__name__.endswith("RMS_norm")):
        return None
    d, params = m.__dict__, m.__dict__["_parameters"]
    gamma, scale = params.get("gamma"), d.get("scale")
    if d.get("channel_first") is not True or gamma is None or not isinstance(scale, float):
        return None
    c = gamma.shape[0] if gamma.dim() else 0
    if gamma.dim() < 2 or gamma.numel() != c or any(n != 1 for n in gamma.shape[1:]):
        return None
    bias = params["bias"] if "bias" in params else d.get("bias")
    if bias is None or (isinstance(bias, float) and bias == 0.0):
        bias = None
    elif not (isinstance(bias, torch.Tensor) and bias.shape == gamma.shape):
        return None
    return gamma, bias, scale, 1e-12, False


# -- fused steps ---------------------------------------------------------------
def kernel_step(m: nn.Module, fn):
    """``fn()``, a step of conv ``m`` run on the kernels outside its conv
    plans (the subpixel upsample, GroupNorm+conv in bands); None where a
    kernel cannot be built or launched here: warned once
    (``plans.kernel_failure``) and remembered on ``m``, whose later calls
    take its planned path, which has its own fallback."""
    st = state_of(m)
    if st.step_failed:
        return None
    try:
        return fn()
    except kernel_errors() as e:
        st.step_failed = kernel_failure(e)
        return None


def _kernels_may_run(m: nn.Module) -> bool:
    return (isinstance(m, PatchedConvMixin) and not m.cp_comfy_active()
            and hookless(m))


def norm_is_eager(x: torch.Tensor, numel: Optional[int] = None, groups: Optional[int] = None) -> bool:
    """Whether ``group_norm`` runs PyTorch's GroupNorm (below the kernels'
    crossover) on ``x``, or on a tensor of ``numel`` elements of ``x``'s
    batch on its device, in ``groups`` groups (unknown: judged on the size
    alone)."""
    return x.is_cuda and not costs.group_norm_pays(x.numel() if numel is None else numel,
                                                   None if groups is None else x.shape[0] * groups)


def group_norm(norm: nn.GroupNorm, x: torch.Tensor, activation: str = "none",
               out: Optional[torch.Tensor] = None, input_bias: Optional[torch.Tensor] = None,
               modulation: Optional[tuple] = None) -> torch.Tensor:
    """``act(norm(x + input_bias))`` (``input_bias`` per channel, the bias
    of the conv that made ``x``, see ``conv_without_bias``; ``modulation``
    (m, a), tensors of ``x``'s shape: ``act(norm(x) * m + a)``); one pass of
    conv-patch's GroupNorm kernels where they can run, else the norm class's
    own forward and PyTorch's activation. ``out`` (may be ``x``) receives
    the result. Hooks are the caller's business (fused blocks check
    ``plain`` first, the GroupNorm recipe runs inside the module's own
    call)."""
    if norm_is_eager(x, groups=norm.num_groups):
        # PyTorch's GroupNorm is faster at this size:
        # decided here, before any signature is built.
        return dispatch.group_norm_eager(norm, x, activation, out, input_bias, modulation)
    if x.dim() in (4, 5) and not comfy_active(norm):
        if torch.compiler.is_compiling() and out is None:
            # (An ``out`` write would be a copy in a compiled graph: the
            # expression, which Inductor writes where it likes.)
            from conv_patch.runtime import compiled
            y = compiled.traced_group_norm(norm, x, activation, input_bias, modulation)
            if y is not None:
                return y
        return dispatch.group_norm(norm, x, activation, out, input_bias, modulation)
    return dispatch.group_norm_eager(norm, x, activation, out, input_bias, modulation)


def grouped_conv(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` for a grouped conv the patcher left as it is: one launch of
    conv-patch's grouped-conv kernels where they take the call
    (``dispatch.grouped_conv``) and no hook watches ``m``, else its own call."""
    if not plain(m):
        return m(x)
    return dispatch.grouped_conv(m, x)


def rms_norm(norm: nn.Module, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
    """``act(norm(x))`` for an RMS norm ``rms_norm_params`` recognises, on
    ``x`` of one more axis than its gamma (the broadcast the module was
    written for; the caller checks): one pass of conv-patch's kernel where it
    takes the call (``dispatch.rms_norm``), else the norm's own forward and
    PyTorch's activation. Hooks are the caller's business."""
    own = getattr(type(norm), "cp_base", type(norm)).forward
    return dispatch.rms_norm(norm, x, rms_norm_params(norm), lambda: own(norm, x), activation)


def last_axis_rms_norm_params(m) -> Optional[tuple]:
    """``(weight, bias, 1.0, eps, True)`` of diffusers' ``RMSNorm`` (``x *
    rsqrt(mean(x^2) + eps)`` over the last axis, then ``weight`` and
    ``bias`` where it has them), or None."""
    cls = getattr(type(m), "cp_base", type(m))
    if not (isinstance(m, nn.Module) and cls.__name__ == "RMSNorm" and cls.__module__.startswith("diffusers.")):
        return None
    d, params = m.__dict__, m.__dict__["_parameters"]
    eps, weight, bias = d.get("eps"), params.get("weight"), params.get("bias")
    if not isinstance(eps, float) or (weight is not None and weight.dim() != 1) or (
            bias is not None and (weight is None or bias.shape != weight.shape)):
        return None
    return weight, bias, 1.0, eps, True


def channel_rms_norm(norm: nn.Module, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
    """``act(norm(x.movedim(1, -1)).movedim(-1, 1))`` for a diffusers
    ``RMSNorm`` (``last_axis_rms_norm_params``) over the channels of
    [N, C, ...] ``x``, as LTX-Video's VAE calls it: one pass of the RMS-norm
    kernel over the channel axis where it takes the call (no permuted copy),
    else the module's own call and PyTorch's activation. Hooks are the
    caller's business."""
    own = getattr(type(norm), "cp_base", type(norm)).forward
    return dispatch.rms_norm(norm, x, last_axis_rms_norm_params(norm),
                             lambda: own(norm, x.movedim(1, -1)).movedim(-1, 1), activation)


def causal_conv3d(m: nn.Conv3d, x: torch.Tensor, cache_x: Optional[torch.Tensor] = None, *,
                  residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``m(x, cache_x) + residual`` for a causal Conv3d of the Wan family
    (``wrappers.causal_conv3d_problem``): the cached frames read in place and
    the residual in the epilogue where ``m`` is patched and the kernel takes
    the call, the module's own call and a PyTorch add otherwise."""
    if isinstance(m, PatchedCausalConv3d) and hookless(m):
        return m.causal(x, cache_x, residual=residual)
    y = m(x, cache_x)
    return y if residual is None else y + residual


def conv3d(m: nn.Conv3d, x: torch.Tensor, *, cache: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``m(cat([cache, x], 2)) + residual`` for a Conv3d (``cache``: frames
    before ``x`` in time): the cached frames read in place and the residual
    added in the epilogue where ``m`` is patched and unhooked, the module's
    own call on the concatenation and a PyTorch add otherwise."""
    if isinstance(m, PatchedConv3d) and not isinstance(m, PatchedCausalConv3d) and _kernels_may_run(m):
        return m(x, cache=cache, residual=residual)
    y = m(x if cache is None else torch.cat([cache, x], 2))
    return y if residual is None else y + residual


def conv(m: nn.Conv2d, x: torch.Tensor, *, padding=None, residual=None, beta: float = 1.0,
         activation: str = "none", out_scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out_scale * act(m(F.pad(x, padding)) + beta * residual)``; one
    kernel where ``m`` is patched and the kernels take the call. ``padding``
    (F.pad order) is folded into the conv's bounds, in place of the
    module's own padding (``plans.forward_with_padding``: a band of an
    image padded on its image-edge sides only); ``out`` receives the result
    (it may be ``residual``: the epilogue reads each residual element
    before writing it)."""
    if padding is not None and isinstance(m.padding, str):
        raise ValueError(f"conv(padding=...) replaces a numeric padding; {m} pads {m.padding!r}")
    if _kernels_may_run(m):
        # The wrapper's own call (hooks were ruled out), through the one
        # dispatch entry: the folded pad is part of the call's signature.
        return m.call_with_epilogue(x, residual, beta, activation, out_scale, out,
                                    None if padding is None else tuple(padding))
    if padding is not None:
        y = forward_with_padding(m, x, padding, m)
    else:
        y = m(x)
    y = eager_epilogue(y, residual, beta, activation, out_scale)
    return y if out is None else out.copy_(y)


# A normalised conv input of at least BAND_FROM_BYTES is made band by band
# (functional.group_norm_conv2d) in bands of BAND_BYTES: in a 2048^2 FLUX decode the
# first full-resolution block's input is 2 GiB and its normalised copy
# another 2; at 1024^2 no input reaches 1 GiB and every conv stays one launch.
BAND_FROM_BYTES = 1 << 30
BAND_BYTES = 256 << 20


def conv_without_bias(m: nn.Conv2d, x: torch.Tensor):
    """``(y, b)`` with ``y + b`` (``b`` per channel, or None) equal to
    ``m(x)``, for the GroupNorm that reads ``y`` next to add ``b``
    (``PatchedConv2d.forward_without_bias`` says where and why). Only for a
    conv without hooks."""
    if _kernels_may_run(m) and isinstance(m, nn.Conv2d) and not isinstance(m, nn.ConvTranspose2d):
        return m.forward_without_bias(x)
    return m(x), None


def norm_conv(norm: nn.GroupNorm, m: nn.Conv2d, x: torch.Tensor, activation: str = "silu",
              keep_bias: bool = False):
    """``m(act(norm(x)))``: the normalised input made in row bands where it
    would be large (and the kernels take both ops), else whole. With
    ``keep_bias`` the pair ``conv_without_bias`` returns, for a GroupNorm to
    add the bias."""
    if (x.dim() == 4 and x.numel() * x.element_size() >= BAND_FROM_BYTES and _kernels_may_run(m)
            and not comfy_active(norm) and is_conv(m, 3, 1, 1) and not torch.compiler.is_compiling()
            and inference(x, norm, m)):
        try:
            y = kernel_step(m, lambda: functional.group_norm_conv2d(
                x, norm.num_groups, norm.weight, norm.bias, norm.eps, activation,
                pack.packed_weight(m, m.weight, False), m.bias, band_bytes=BAND_BYTES, table=state_of(m).table))
            if y is not None:
                return (y, None) if keep_bias else y
        except functional.UnsupportedConv:
            pass
    if keep_bias:
        return conv_without_bias(m, group_norm(norm, x, activation))
    return conv(m, group_norm(norm, x, activation))


def resnet(x: torch.Tensor, norm1, conv1, norm2, conv2, shortcut=None, out_scale: float = 1.0,
           shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The resnet block, ``(sc(x) + conv2(silu(norm2(conv1(silu(norm1(x))) + shift)))) * out_scale``
    (``shift`` [B, C, 1, 1], a UNet's projected time embedding, added in
    conv1's epilogue): GroupNorm+SiLU passes (the first in bands where
    large), the residual in conv2's epilogue. Where norm2 runs on the
    kernels, intermediates this function made are reused in place (norm2
    over conv1's output, which leaves conv1's bias to norm2; conv2's output
    over the shortcut's), which keeps a 2048^2 block at its input plus two
    outputs; not where a hook on the conv that made them may hold on to
    them. Where norm2 is PyTorch's, that would cost two more ops (the bias
    added, the copy back) than the block's own forward, so it is not. Nor
    under torch.compile, where Inductor plans the memory and an ``out``
    would be one more copy."""
    in_place = not torch.compiler.is_compiling()
    if shift is not None:
        h = conv(conv1, group_norm(norm1, x, "silu"),
                 residual=shift.expand(x.shape[0], conv1.out_channels, x.shape[2], x.shape[3]))
        h = group_norm(norm2, h, "silu", out=h if in_place and plain(conv1) and not norm_is_eager(h) else None)
    elif plain(conv1) and not norm_is_eager(x, x.numel() // max(x.shape[1], 1) * conv1.out_channels):
        h, b = norm_conv(norm1, conv1, x, keep_bias=True)
        h = group_norm(norm2, h, "silu", out=h if in_place else None, input_bias=b)
    else:
        h = norm_conv(norm1, conv1, x)
        h = group_norm(norm2, h, "silu")
    if shortcut is None:
        return like_input(conv(conv2, h, residual=x, out_scale=out_scale), x)
    sc = conv(shortcut, x)
    # Into the shortcut's output where the block runs on the kernels (the
    # memory the large blocks need); where its norms are PyTorch's, its
    # convs are too, and there ``out`` would cost a copy of its own.
    into_sc = in_place and plain(shortcut) and not norm_is_eager(h)
    return like_input(conv(conv2, h, residual=sc, out_scale=out_scale, out=sc if into_sc else None), x)


def upsample_conv(m: nn.Conv2d, x: torch.Tensor, *, residual=None, activation: str = "none") -> torch.Tensor:
    """``act(m(F.interpolate(x, scale_factor=2, mode="nearest")) + residual)``
    for a 3x3, padding-1 conv: folded into four planned 2x2 convs of ``x``
    (``dispatch.upsample_conv``) where ``m`` is patched and the problem is
    large enough for that to pay (``dispatch.subpixel_pays``)."""
    if _kernels_may_run(m) and torch.compiler.is_compiling():
        from conv_patch.runtime import compiled
        if compiled.takes(m, x, residual):
            # One opaque op in the graph, which folds or not as it runs.
            return compiled.upsample_call(m, x, residual, activation)
        return functional.upsample_conv2d(x, m.weight, m.bias, residual=residual, activation=activation)
    if _kernels_may_run(m) and dispatch.subpixel_pays(x, m.weight):
        y = kernel_step(m, lambda: dispatch.upsample_conv(m, x, residual, activation))
        if y is not None:
            return y
    if _kernels_may_run(m):
        # Small: upsample, then one launch with the epilogue fused.
        return m(F.interpolate(x, scale_factor=2.0, mode="nearest"), residual=residual, activation=activation)
    y = m(F.interpolate(x, scale_factor=2.0, mode="nearest"))
    return eager_epilogue(y, residual, 1.0, activation, 1.0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` over [B, N, D] tokens (the VAE
    mid-block's one head): ``functional.attention``, which materialises the scores
    in blocks where PyTorch has no fused kernel for the head width."""
    return functional.attention(q, k, v)


def to_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] as [B, H*W, C] tokens: a view of an NHWC tensor."""
    b, c, h, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(b, h * w, c)


def from_tokens(t: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, H*W, C] tokens back as [B, C, H, W]: an NHWC view of ``t``."""
    return t.view(t.shape[0], h, w, t.shape[2]).permute(0, 3, 1, 2)


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` as dense NHWC: the layout the kernels read natively (NCHW costs
    them a staging copy per conv), reached once at a model's entry."""
    if x.dim() != 4 or x.is_contiguous(memory_format=torch.channels_last):
        return x
    if (x.is_cuda and x.dtype in KERNEL_DTYPES and x.is_contiguous()
            and not torch.compiler.is_compiling()):
        return to_nhwc(x) if target_for(x.device).kernels else x.contiguous(memory_format=torch.channels_last)
    return x.contiguous(memory_format=torch.channels_last)


def like_input(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` in the memory format ``x`` came in, where ``x``'s strides say
    which: recipes may work in NHWC inside (and PyTorch's own GroupNorm may
    hand back NCHW from an NHWC input on the GPU), the block's output keeps
    the caller's layout, as ``x + h`` does in the unpatched block."""
    if y.dim() != 4 or x.dim() != 4:
        return y
    if x.is_contiguous():
        return y if y.is_contiguous() else y.contiguous()
    if x.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous(memory_format=torch.channels_last):
        return y.contiguous(memory_format=torch.channels_last)
    return y
