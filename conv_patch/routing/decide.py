"""The one decision: which route runs a convolution call, 2-D or 3-D.

``decide(spec, call, target, table)`` names the route (a kernel, the cuDNN
route with the fused epilogue, or the original module) and why; with
``call=None`` only the module is judged (what ``apply``'s report and
``repr`` show before the first call). Every caller asks it: the dispatch
core when it plans a call, the functional API, the tuner's eligibility
checks, the benchmarks and ``convpatch info``; so a label never disagrees
with what ran.

A 2-D call is taken by the table's config among the kernel routes that can
take it (the registry's ``problem`` rules), then, ``as_called``, weighed
against PyTorch as the call is made (``costs``: host time included, CUDA
graph or not): the kernel only where it wins. A Conv3d call takes the
kernel only for a shape its table measured faster than the cuDNN route.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

from conv_patch.routing import costs, tables
from conv_patch.routing.registry import (BY_ROUTE, CUDNN_TABLE_ROUTE, DEFAULT_TABLE_ROUTE, REGISTRY, TABLE_ROUTES,
                                         Route, RouteEntry, route_of_table, route_problem)
from conv_patch.specs import KERNEL_DTYPES, CallDesc, Pair, dtype_name
from conv_patch.target import Target

INT32_ROWS = 2**31 - 1
# The lean route (a decision's ``tier``): the portable kernel reading the
# input and the weight in place, one launch and nothing else, for calls whose
# GPU work is smaller than the host time around it (costs.choose_lean).
LEAN = "lean"


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    reason: str = ""
    config: Optional[dict] = field(default=None, compare=False)
    tier: str = ""
    table: str = ""

    @property
    def entry(self) -> RouteEntry:
        return BY_ROUTE[self.route]

    @property
    def is_kernel(self) -> bool:
        return self.entry.is_kernel

    def label(self) -> str:
        if not self.is_kernel:
            return f"{self.route.value} ({self.reason})"
        return self.route.value


def fallback(reason: str) -> RouteDecision:
    return RouteDecision(Route.FALLBACK, reason)


# The lean route's config: its tile, the cost model's (costs.LEAN_TILE).
LEAN_CONFIG = {"route": DEFAULT_TABLE_ROUTE, "BLOCK_M": costs.LEAN_TILE[0], "BLOCK_N": costs.LEAN_TILE[1],
               "BLOCK_K": costs.LEAN_TILE[2], "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def table_for(target: Target, table=None):
    """``table`` (a user's), else ``target``'s packaged one."""
    return table if table is not None else tables.packaged_table(target.arch)


def static_route(spec) -> RouteDecision:
    """The part of the decision that depends on the module alone: its
    kind's default kernel route, or why no kernel ever takes it."""
    if spec.groups != 1:
        return fallback(f"groups={spec.groups}")
    if spec.padding_mode != "zeros":
        return fallback(f"padding_mode={spec.padding_mode!r}")
    return RouteDecision(route_of_table(spec.kind, DEFAULT_TABLE_ROUTE))


def decide(spec, call: Optional[CallDesc] = None, target: Optional[Target] = None, table=None, *,
           config: Optional[dict] = None, as_called: bool = True) -> RouteDecision:
    """Route one convolution call (``spec`` a ``ConvSpec`` or
    ``Conv3dSpec``, ``call`` its ``CallDesc``). ``table`` (a
    ``tables.Table``) overrides the architecture's own (PatchConfig.table);
    ``config`` is a given tile (tests, the tuner, the functional API's
    ``config=``): the route it names if that can take the call. Without
    ``as_called`` the call is not weighed against PyTorch: the kernel runs
    wherever it can (the functional API). With ``call=None`` the module
    alone is judged; given a ``target``, a Conv3d is also judged by its
    device (PyTorch for every call where nothing says the kernel pays
    there: ``conv3d_gate``)."""
    decision = static_route(spec)
    if call is None:
        if decision.is_kernel and spec.kind == "conv3d" and target is not None and as_called:
            # A Conv3d whose device decides every call (conv3d_gate): the
            # dispatch core asks this once per device, before any signature.
            gate = conv3d_gate(target, table_for(target, table))
            if gate is not None:
                return gate
        return decision
    if not decision.is_kernel:
        return decision
    problem = _call_problem(spec, call, target)
    if problem:
        return fallback(problem)
    if spec.kind == "conv3d":
        return _conv3d(spec, call, target, table, config, as_called)
    shape = call.shape if len(call.shape) == 4 else (1,) + tuple(call.shape)
    problem, (oh, ow) = _shape_problem(spec, call, shape)
    if problem:
        return fallback(problem)
    tbl = table_for(target, table)
    if config is not None:
        decision = _given(spec, call, shape, target, config)
    else:
        routes = {DEFAULT_TABLE_ROUTE} | {e.table for e in REGISTRY if e.kind == spec.kind and e.problem
                                          and e.problem(spec, call, shape, target) is None}
        if call.device_type == "cuda":
            routes.add(CUDNN_TABLE_ROUTE)
        cfg, tier = tbl.lookup(spec, shape, call.layout, call.dtype, shape[0] * oh * ow, frozenset(routes))
        name = tables.route_of(cfg)
        if name == CUDNN_TABLE_ROUTE:
            why = "table: cuDNN measured faster"
            if "cudnn_ms" in cfg and "ours_ms" in cfg:
                why += f" ({cfg['cudnn_ms']:.4g} vs {cfg['ours_ms']:.4g} ms)"
            decision = RouteDecision(Route.CUDNN, why, config=cfg, tier=tier, table=tbl.name)
        else:
            decision = RouteDecision(route_of_table(spec.kind, name), config=cfg, tier=tier, table=tbl.name)
    if decision.route is Route.CUDNN and spec.transposed:
        decision = fallback(decision.reason)
    if as_called:
        decision = _weigh(decision, spec, call, shape, (oh, ow), target, table, tbl)
    return decision


def _call_problem(spec, call: CallDesc, target: Optional[Target]) -> Optional[str]:
    """Why no kernel may take this call, whatever its shape: tracing,
    autograd, where it runs, its dtypes and devices."""
    if call.compiling:
        return "torch.compile tracing"
    if call.needs_grad:
        return "autograd needed (grad enabled and an input or parameter requires grad)"
    if target is None or not target.kernels:
        return target.reason if target is not None else "no target"
    if call.dtype not in KERNEL_DTYPES:
        return f"dtype {dtype_name(call.dtype)} unsupported"
    if call.weight_dtype != call.dtype or (call.bias_dtype is not None and call.bias_dtype != call.dtype):
        return "input, weight and bias dtypes differ"
    if not call.same_device:
        return "tensors on different devices"
    if len(call.shape) not in ((5,) if spec.kind == "conv3d" else (3, 4)):
        return f"{len(call.shape)}-D input"
    return None


def _shape_problem(spec, call: CallDesc, shape: tuple) -> Tuple[Optional[str], Pair]:
    """(problem, output size): calls PyTorch itself rejects, or that the
    kernels do not take; the fallback then raises PyTorch's own error or
    computes the answer."""
    n, c, h, w = shape
    if c != spec.in_channels:
        return f"input has {c} channels, weight expects {spec.in_channels}", (0, 0)
    if n == 0 or h == 0 or w == 0:
        return "empty input", (0, 0)
    op = call.output_padding if call.output_padding is not None else spec.output_padding
    if spec.transposed:
        for i in range(2):
            if op[i] < 0 or (op[i] >= spec.stride[i] and op[i] >= spec.dilation[i]):
                return f"output_padding {tuple(op)} invalid for stride {spec.stride}", (0, 0)
    oh, ow = spec.output_hw(h, w, op)
    if oh <= 0 or ow <= 0:
        return f"output size {oh}x{ow} is not positive", (oh, ow)
    if n * oh * ow > INT32_ROWS:
        return "more than 2**31 output pixels", (oh, ow)
    return None, (oh, ow)


def _given(spec, call: CallDesc, shape, target: Target, config: Optional[dict]) -> RouteDecision:
    """A given config: the route it names, where that can take the call
    (None: the kind's default route with its default tile)."""
    name = DEFAULT_TABLE_ROUTE if config is None else tables.route_of(config)
    if name == CUDNN_TABLE_ROUTE:
        return RouteDecision(Route.CUDNN, "given config", config=config, tier="given")
    if (spec.kind, name) not in TABLE_ROUTES:
        name = DEFAULT_TABLE_ROUTE  # (a kind with one kernel route: the config's tiles on it)
    problem = route_problem(name, spec, call, shape, target)
    if problem:
        return RouteDecision(Route.FALLBACK, f"{name} route: {problem}", tier="given")
    return RouteDecision(route_of_table(spec.kind, name), config=config, tier="given")


def _weigh(decision: RouteDecision, spec, call: CallDesc, shape, out_hw, target: Target, user_table,
           tbl) -> RouteDecision:
    """``decision`` kept where it beats PyTorch as called (``costs.choose``),
    else the original module (or the table's cuDNN route with the fused
    epilogue, where that pays over eager ops)."""
    if target.interpreter or not (decision.is_kernel or decision.route is Route.CUDNN):
        return decision  # under the interpreter the kernels always run: that is how they are tested
    layout = "nhwc" if call.layout == "nhwc" else "nchw"
    p = costs.Problem.of(shape[0], spec.in_channels, shape[2], shape[3], spec.out_channels, spec.kernel[0],
                         spec.kernel[1], out_hw[0], out_hw[1], call.dtype.itemsize, layout)
    cal = tbl.calibration
    exact = None if spec.transposed else tbl.exact(tables.shape_key(spec, shape, layout, call.dtype))
    fitted = costs.fit_of(tbl)
    # PyTorch's own route: the original module, or cuDNN without the bias
    # and the fused epilogue as one pass (the table's cuDNN route), where
    # that one pass beats the eager ops and PyTorch's bias pass.
    fused = (call.device_type == "cuda" and not spec.transposed
             and costs.fused_epilogue_pays(p, call.epilogue, call.bias_dtype is not None and layout == "nhwc",
                                           call.graph, cal=cal, gpu_conv=costs.gpu_times(p, fitted, exact)[0] or 0.0))
    if decision.route is Route.CUDNN:
        if fused:
            return decision
        return dataclasses.replace(decision, route=Route.FALLBACK)
    if user_table is not None and exact is None:
        return decision  # a user's table without this shape measured: the user's choice
    entry = decision.entry
    if not (call.graph or entry.launched):
        choice = costs.Choice(False, f"{entry.table} route: on the graph path only (launched, its host time costs "
                                     "a model more than its GPU time saves)")
    else:
        choice = costs.choose(p, fitted, exact, launches=entry.launches(call), ops=call.epilogue, graph=call.graph,
                              packed=call.packed and not entry.weight_in_place, descriptors=entry.descriptors,
                              cal=cal, config=decision.config, sms=target.sms)
    if not call.graph:
        lean = costs.choose_lean(p, fitted, exact, ops=call.epilogue, cal=cal, sms=target.sms)
        if lean.kernel and (not choice.kernel or lean.cost < choice.cost):
            return RouteDecision(route_of_table(spec.kind, DEFAULT_TABLE_ROUTE), lean.why, config=LEAN_CONFIG,
                                 tier=LEAN, table=decision.table)
    if choice.kernel:
        return decision
    return RouteDecision(Route.CUDNN if fused else Route.FALLBACK, choice.why, config=decision.config,
                         tier=decision.tier, table=decision.table)


# -- Conv3d ------------------------------------------------------------------------
def conv3d_gate(target: Target, table) -> Optional[RouteDecision]:
    """PyTorch for every Conv3d call on ``target``, whatever the call, or
    None (the call is decided by ``decide``). The never-slower rule: on a GPU
    whose table has no measured conv3d entry nothing says the kernel beats
    cuDNN, so such a call needs no signature; under the interpreter the
    kernel runs (that is where it is tested)."""
    if target.interpreter and target.kernels:
        return None
    if target.kernels:
        if table.has_conv3d:
            return None
        return fallback(f"no measured conv3d entries for {target.arch}: PyTorch's conv3d (cuDNN)")
    return fallback(target.reason or "no kernels here")


def _conv3d(spec, call: CallDesc, target: Target, table, config: Optional[dict], as_called: bool) -> RouteDecision:
    """A Conv3d call: the kernel where it can run and is known to pay. On a
    GPU "known to pay" means the table's exact entry of the shape (measured
    against the cuDNN route, or the same GEMM with its cached and padded
    frames traded) says so as called (``costs.conv3d_choice``); a shape the
    table does not have runs the cuDNN route."""
    if call.cast:
        return fallback("autocast: PyTorch's conv3d computes in autocast's dtype")
    if math.prod(call.shape) == 0:
        return fallback("empty input")
    if any(d is not None and d != call.dtype for d in (call.cache_dtype, call.residual_dtype)):
        return fallback("the weight, bias, cache, residual or output differ from the input in device or dtype")
    if config is not None or not as_called:
        # The functional API: the kernel wherever it can run, the route a
        # given config names.
        return _given(spec, call, call.shape, target, config)
    tbl = table_for(target, table)
    gate = conv3d_gate(target, tbl)
    if gate is not None:
        return gate
    if target.interpreter:
        return RouteDecision(route_of_table("conv3d", DEFAULT_TABLE_ROUTE), "interpreter", tier="default")
    keys = tables.conv3d_keys(spec, call.shape, call.cache_frames, call.layout, call.dtype)
    entry = next((e for e in map(tbl.conv3d_exact, keys) if e is not None), None)
    # From here the spec describes the call: where the kernel does not take
    # it, the cuDNN route computes it (on a GPU: what the module's own
    # forward computes, with fewer copies), and the reason says why.
    if entry is None:
        return RouteDecision(Route.CUDNN, f"conv3d {keys[0]} not measured on {target.arch}: PyTorch's conv3d "
                                          "(cuDNN)")
    name = tables.route_of(entry)
    if name == CUDNN_TABLE_ROUTE:
        return RouteDecision(Route.CUDNN, f"cuDNN measured faster ({entry['cudnn_ms']:.4g} ms vs "
                                          f"{entry['ours_ms']:.4g} ms)", tier="exact")
    route = route_of_table("conv3d", name)
    rule = BY_ROUTE[route].problem
    problem = rule(spec, call, call.shape, target) if rule else None
    if problem:
        return RouteDecision(Route.CUDNN, f"the measured {name} tile cannot take this call ({problem})",
                             tier="exact")
    choice = costs.conv3d_choice(entry["ours_ms"], entry["cudnn_ms"], call.epilogue, call.graph, cal=tbl.calibration,
                                 out_bytes=call.out_numel * call.dtype.itemsize,
                                 repack=BY_ROUTE[route].repacks)
    if not choice.kernel:
        return RouteDecision(Route.CUDNN, choice.why, tier="exact")
    config = {k: v for k, v in entry.items() if k not in ("ours_ms", "cudnn_ms")}
    return RouteDecision(route, choice.why, config=config, tier="exact")
