"""apply / remove / patched: swap a model's convolutions for wrappers and back.

Shaped like torchao's ``quantize_(model, config, filter_fn=...)`` and PEFT's
inject/unload: one call in, one call out, the original objects restored.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from conv_patch.api import warmup as first_pass
from conv_patch.ops.loader import load_in_background
from conv_patch.routing import tables
from conv_patch.runtime import passthrough
from conv_patch.routing.decide import static_route
from conv_patch.runtime.state import peek, state_of
from conv_patch.specs import Conv3dSpec, ConvSpec
from conv_patch.target import Target, default_target, what_runs
from conv_patch.runtime.wrappers import (PatchedConvMixin, causal_conv3d_problem, comfy_conv_forward,
                                         is_comfy_conv_class, plain_comfy_conv3d, safe_conv3d_problem,
                                         wrapper_class_for)

FilterFn = Callable[[nn.Module, str], bool]
# PatchConfig.cuda_graphs: graphs where the recipe says the block is host-bound.
AUTO = "auto"


@dataclass
class PatchConfig:
    """Options of :func:`apply`.

    ``table``: a kernel config table (dict, or path to a JSON file in the
    ``configs/`` schema) used instead of the GPU architecture's own table.

    ``cuda_graphs``: ``True`` replays each outermost fused block (a VAE's
    encoder and decoder, a TAESD stack) from a CUDA graph per input shape,
    captured on the second call with that shape; it takes the host's launch
    cost out of a decode. Each cached graph holds the memory of that call's
    activations; ``max_graphs`` bounds them per block.
    ``conv_patch/runtime/graphs.py`` lists what invalidates a graph and what
    runs eagerly. Needs ``recipes``. ``"auto"`` (the default) does so for
    the blocks whose eager calls are bound by the host at the sizes they
    run (``Recipe.auto_graphs``: the tiny autoencoders' stacks and
    Real-ESRGAN's compact net), keeping at most a 32nd of the GPU's memory
    (at most 1 GiB) of graphs per block; ``False`` never.

    ``max_activation_gib``: the activation memory a VAE decode or encode
    may use; where the plain forward's estimate exceeds it, the recognised
    Decoder/Encoder runs in row bands, layer by layer over all bands, on the
    device where they fit and staged to pinned host memory where not, with
    the same result (``conv_patch.parallel``; ``parallel.last_report(vae)``
    says what ran). None: derived from free memory on CUDA at each call,
    never on the CPU; ``float("inf")``: never. Needs ``recipes``.

    ``passthrough``: learn, per call signature of the patched model, which
    convs and fused blocks do no work of conv-patch's own (PyTorch's route
    and norms, as a UNet at its usual sizes), and run those as their own
    classes from then on, at the unpatched model's host cost
    (``conv_patch/passthrough.py``). Not with ``cuda_graphs=True``.

    ``compile_ahead``: before the patched model's first call in the process
    (and its VAE decoder's and encoder's), one pass compiles the kernels
    that call needs side by side on worker threads, rather than one after
    another as its launches reach them: seconds instead of tens of seconds
    on a cold kernel cache (``conv_patch.warmup``'s pass, made at that
    call). Only where nobody can tell the model was called three times more
    (``conv_patch/api/warmup.py`` lists what rules it out: forward hooks,
    list or generator arguments, autograd, ...). A model with Conv3d layers
    is hooked only where its family names the methods to hook (a Wan VAE's
    ``decode`` and ``encode``; diffusers' CogVideoX, Mochi, HunyuanVideo and
    LTX-Video VAEs' too), whose pass runs on the clip's first frames;
    ``conv_patch.warmup`` compiles other video models' kernels on request.
    """

    table: Optional[Union[dict, str, os.PathLike]] = None
    cuda_graphs: Union[bool, str] = "auto"
    max_graphs: int = 4
    max_activation_gib: Optional[float] = None
    passthrough: bool = True
    compile_ahead: bool = True


@dataclass
class PatchReport:
    """What :func:`apply` did: ``patched`` maps each swapped module's path to
    its kernel route and shape, ``skipped`` each convolution left alone to the
    reason, ``already_patched`` lists wrappers found from an earlier call."""

    patched: Dict[str, str] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    already_patched: List[str] = field(default_factory=list)
    fused: Dict[str, str] = field(default_factory=dict)
    graphed: List[str] = field(default_factory=list)
    # The models hooked to pass through what does no work (PatchConfig.passthrough).
    passthrough: List[str] = field(default_factory=list)
    # The models hooked to compile ahead at their first call (PatchConfig.compile_ahead).
    compile_ahead: List[str] = field(default_factory=list)
    # Where no kernel runs on this machine (no usable GPU) or they run only
    # under the Triton interpreter: what the patched model runs here.
    here: str = ""

    def __str__(self) -> str:
        lines = [f"conv-patch: {len(self.patched)} patched, {len(self.skipped)} skipped, "
                 f"{len(self.already_patched)} already patched, {len(self.fused)} blocks fused"]
        if self.here:
            lines.append(f"  here: {self.here}")
        lines += [f"  fused    {fqn or '<root>'}: {what}" for fqn, what in self.fused.items()]
        lines += [f"  graphed  {fqn or '<root>'}: CUDA graph per input shape" for fqn in self.graphed]
        lines += [f"  passthrough {fqn or '<root>'}: what does no kernel work at a call signature runs "
                  f"unpatched (learned on its second call)" for fqn in self.passthrough]
        lines += [f"  compile ahead {fqn or '<root>'}: its first call's kernels compiled side by side before it"
                  for fqn in self.compile_ahead]
        lines += [f"  patched  {fqn or '<root>'}: {what}" for fqn, what in self.patched.items()]
        lines += [f"  skipped  {fqn or '<root>'}: {why}" for fqn, why in self.skipped.items()]
        return "\n".join(lines)


def _conv_base(m: nn.Module):
    if isinstance(m, nn.Conv3d):
        return nn.Conv3d, wrapper_class_for(type(m))
    if isinstance(m, nn.ConvTranspose2d):
        return nn.ConvTranspose2d, wrapper_class_for(type(m))
    if isinstance(m, nn.Conv2d):
        return nn.Conv2d, wrapper_class_for(type(m))
    return None, None


def ineligible_reason(m: nn.Module) -> Optional[str]:
    """Why ``m`` (a Conv2d / ConvTranspose2d / Conv3d) cannot be wrapped, or None."""
    base = (nn.Conv3d if isinstance(m, nn.Conv3d) else
            nn.ConvTranspose2d if isinstance(m, nn.ConvTranspose2d) else nn.Conv2d)
    cls = type(m)
    if (getattr(cls, "_conv_forward", None) is not getattr(base, "_conv_forward", None)
            and not (base is nn.Conv3d and comfy_conv_forward(cls))):
        return f"{cls.__qualname__} overrides _conv_forward; its contract is unknown"
    if base is nn.Conv3d and cls is not nn.Conv3d:
        # A causal or a time-chunked video-VAE conv has a known contract (its
        # own forward), as has ComfyUI's own Conv3d; any other Conv3d
        # subclass's is unknown.
        causal, safe = causal_conv3d_problem(m), safe_conv3d_problem(cls)
        if causal is not None and safe is not None and not plain_comfy_conv3d(cls):
            return f"{cls.__qualname__}: {causal}, {safe}; its contract is unknown"
    elif cls.forward is not base.forward and not is_comfy_conv_class(cls):
        return f"{cls.__qualname__} overrides forward; its contract is unknown"
    if "forward" in m.__dict__:
        return "forward replaced on the instance (a hook library wraps it)"
    if parametrize.is_parametrized(m):
        return "parametrized weight"
    w = m._parameters.get("weight")
    if not isinstance(w, nn.Parameter):
        return "weight is not a registered Parameter (weight_norm or similar)"
    if isinstance(w, nn.parameter.UninitializedParameter):
        return "lazy module not initialized yet"
    if base is nn.Conv3d:
        return Conv3dSpec.from_module(m).problem()
    decision = static_route(ConvSpec.from_module(m))
    return None if decision.is_kernel else decision.reason


def _slots(model: nn.Module):
    """(parent, name, child, fqn) for every child slot, shared modules at each
    of their paths."""
    for pfqn, parent in model.named_modules(remove_duplicate=False):
        for name, child in parent._modules.items():
            if child is not None:
                yield parent, name, child, f"{pfqn}.{name}" if pfqn else name


def _modules_of(target) -> List:
    """(prefix, module) pairs: the module itself, or every ``nn.Module``
    component of a pipeline (anything with a ``components`` dict, like a
    diffusers ``DiffusionPipeline``), prefixed with the component's name."""
    if isinstance(target, nn.Module):
        return [("", target)]
    comps = getattr(target, "components", None)
    if isinstance(comps, dict):
        mods = [(f"{name}.", m) for name, m in comps.items() if isinstance(m, nn.Module)]
        if mods:
            return mods
        raise TypeError(f"{type(target).__name__} has no nn.Module components to patch")
    raise TypeError(f"apply() needs an nn.Module or a pipeline with nn.Module components, "
                    f"got {type(target).__name__}")


def _plan(model: nn.Module, prefix: str, filter_fn, table, report: "PatchReport", wrappers: Dict[int, nn.Module],
          here: Target):
    if isinstance(model, PatchedConvMixin):
        report.already_patched.append(prefix.rstrip("."))
        return []
    if _conv_base(model)[0] is not None:
        report.skipped[prefix.rstrip(".")] = ("the model itself is a convolution; apply() swaps modules inside "
                                              "a model (wrap it, e.g. nn.Sequential(conv))")
        return []
    plan = []
    for parent, name, child, fqn in _slots(model):
        fqn = prefix + fqn
        if isinstance(child, PatchedConvMixin):
            report.already_patched.append(fqn)
            continue
        base, wrapper_cls = _conv_base(child)
        if base is None:
            if isinstance(child, nn.modules.conv._ConvNd):
                report.skipped[fqn] = f"{type(child).__name__}: only 2-D convolutions and Conv3d are patched"
            continue
        if filter_fn is not None and not filter_fn(child, fqn):
            report.skipped[fqn] = "excluded by filter_fn"
            continue
        reason = ineligible_reason(child)
        if reason:
            report.skipped[fqn] = reason
            continue
        if id(child) not in wrappers:
            wrappers[id(child)] = wrapper_cls.wrap(child, table)
        wrapper = wrappers[id(child)]
        plan.append((parent, name, wrapper))
        route = wrapper.route().route.value
        report.patched[fqn] = (f"{route}  " if here.kernels else f"pytorch here ({route} on a GPU)  ") \
            + wrapper.spec.describe()
    return plan


def apply(model, *, filter_fn: Optional[FilterFn] = None,
          config: Optional[PatchConfig] = None, recipes: bool = True) -> PatchReport:
    """Swap every eligible ``nn.Conv2d`` / ``nn.ConvTranspose2d`` in ``model``
    for a Triton-backed wrapper, in place; return what was done and why.

    ``model`` is an ``nn.Module`` or a pipeline (``conv_patch.apply(pipe)``
    patches every ``nn.Module`` component: VAE, UNet/transformer, text
    encoders; report paths start with the component's name).
    ``filter_fn(module, fqn) -> bool`` narrows the selection. Idempotent:
    wrappers already present are left as they are. Everything is validated and
    every wrapper built before the model is touched, so an error leaves the
    model as it was.
    """
    targets = _modules_of(model)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError("filter_fn must be callable as filter_fn(module, fqn) -> bool")
    if config is not None and not isinstance(config, PatchConfig):
        raise TypeError(f"config must be a conv_patch.PatchConfig, got {type(config).__name__}")
    table = None
    if config is not None and config.table is not None:
        table = tables.load_user_table(config.table)
    graphs = _graph_option(config, recipes)
    budget = _budget_option(config)
    watch, ahead = _bool_option(config, "passthrough"), _bool_option(config, "compile_ahead")

    report = PatchReport()
    here = default_target()
    if not here.kernels or here.interpreter:
        report.here = what_runs()
    wrappers: Dict[int, nn.Module] = {}
    plan = [step for prefix, m in targets for step in _plan(m, prefix, filter_fn, table, report, wrappers, here)]
    fusions = []
    if recipes:
        from conv_patch.recipes import catalog as rc
        fusions = [step for prefix, m in targets for step in rc.plan(m, prefix)]
        for fqn, _, recipe in fusions:
            report.fused[fqn] = f"{recipe.name}  {recipe.what}"
    for parent, name, wrapper in plan:
        parent._modules[name] = wrapper
    for _, module, recipe in fusions:
        rc.fuse(module, recipe)
    if fusions and budget != float("inf"):
        from conv_patch.parallel import BandHook
        for _, module, recipe in fusions:
            if recipe.bands is not None:
                state_of(module).bands = BandHook(budget)
    if watch and graphs is not True:
        for prefix, m in targets:
            if passthrough.install(m):
                report.passthrough.append(prefix.rstrip("."))
    if ahead:
        for prefix, m in targets:
            if passthrough.outermost_components(m) and first_pass.install_first_pass(m):
                report.compile_ahead.append(prefix.rstrip("."))
        if plan and torch.cuda.is_available():
            load_in_background()
    if graphs:
        from conv_patch.runtime import graphs as cg
        auto = graphs == AUTO
        for fqn, module in cg.outermost(targets, rc.is_fused):
            if auto and not module.cp_recipe.auto_graphs(module):
                continue
            cg.install(module, (config or PatchConfig()).max_graphs, auto)
            report.graphed.append(fqn)
    return report


def _budget_option(config: Optional[PatchConfig]) -> Optional[float]:
    v = None if config is None else config.max_activation_gib
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        raise ValueError(f"PatchConfig.max_activation_gib must be a number of GiB > 0 (or None), got {v!r}")
    return None if v is None else float(v)


def _bool_option(config: Optional[PatchConfig], name: str) -> bool:
    if config is None:
        return True
    v = getattr(config, name)
    if not isinstance(v, bool):
        raise TypeError(f"PatchConfig.{name} must be a bool, got {v!r}")
    return v


def _graph_option(config: Optional[PatchConfig], recipes: bool) -> Union[bool, str]:
    """True, False or ``AUTO``: which fused blocks replay CUDA graphs."""
    if config is None:
        return AUTO if recipes else False
    v = config.cuda_graphs
    if not isinstance(v, bool) and v != AUTO:
        raise TypeError(f"PatchConfig.cuda_graphs must be True, False or {AUTO!r}, got {v!r}")
    if isinstance(config.max_graphs, bool) or not isinstance(config.max_graphs, int) or config.max_graphs < 1:
        raise ValueError(f"PatchConfig.max_graphs must be an int >= 1, got {config.max_graphs!r}")
    if v is True and not recipes:
        raise ValueError("PatchConfig(cuda_graphs=True) graphs the fused blocks; it needs recipes=True")
    # ("auto" without recipes: no fused block, nothing to graph.)
    return v if recipes else False


def remove(model, _only: Optional[set] = None) -> List[str]:
    """Put the original module objects back (holding the current weights)
    and fused blocks' own classes; return the paths restored. ``model`` as
    for :func:`apply`."""
    from conv_patch.recipes import catalog as rc
    restored = []
    for prefix, m in _modules_of(model):
        for fqn, mod in m.named_modules():
            if rc.is_fused(mod) and (_only is None or id(mod) in _only):
                rc.unfuse(mod)
                restored.append((prefix + fqn).rstrip("."))
        for parent, name, child, fqn in list(_slots(m)):
            if isinstance(child, PatchedConvMixin) and (_only is None or id(child) in _only):
                parent._modules[name] = child.unwrap()
                restored.append(prefix + fqn)
        passthrough.uninstall(m)
        first_pass.uninstall_first_pass(m)
        if _only is not None and passthrough.outermost_components(m):
            passthrough.install(m)  # what an enclosing apply() patched stays, its signatures forgotten
    return restored


@contextlib.contextmanager
def patched(model: nn.Module, *, filter_fn: Optional[FilterFn] = None,
            config: Optional[PatchConfig] = None, recipes: bool = True):
    """``with conv_patch.patched(model) as report:`` apply on enter; on exit
    remove what this block patched (wrappers from earlier calls stay)."""
    report = apply(model, filter_fn=filter_fn, config=config, recipes=recipes)
    mine = {id(child) for prefix, m in _modules_of(model) for _, _, child, fqn in _slots(m)
            if prefix + fqn in report.patched}
    mine |= {id(mod) for prefix, m in _modules_of(model) for fqn, mod in m.named_modules(prefix=prefix.rstrip("."))
             if fqn in report.fused}
    try:
        yield report
    finally:
        remove(model, _only=mine)


def is_patched(module: nn.Module) -> bool:
    return isinstance(module, PatchedConvMixin)


def last_route(module: nn.Module):
    """The route (a ``routing.decide.RouteDecision``: the route, why, the
    tile) a patched conv's last call ran, or None before its first call or
    for a module conv-patch did not patch."""
    st = peek(module)
    return None if st is None else st.last
