"""The one routing function.

``select_route(spec, call, target)`` names the kernel family that runs a
convolution, or FALLBACK with the reason; the wrappers, their ``repr``, the
patch report, the benchmarks and ``convpatch info`` all call it, so a label can
never disagree with what actually ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from conv_patch.routing import tables
from conv_patch.routing.registry import (KERNEL_ROUTE_RULES, MAX_FLAT_REDUCTION, MAX_TAP_OUTPUTS, ROUTE_INFO,
                                         TABLE_ROUTES, TMA_ALIGN, Route, flat_problem, route_problem, taps_problem,
                                         tma_arch, tma_layout_problem, tma_problem)  # noqa: F401  (re-exported)
from conv_patch.specs import CallDesc, ConvSpec, Pair
from conv_patch.target import Target

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT32_ROWS = 2**31 - 1


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    reason: str = ""
    config: Optional[dict] = field(default=None, compare=False)
    tier: str = ""
    table: str = ""

    @property
    def is_kernel(self) -> bool:
        return self.route not in (Route.FALLBACK, Route.CUDNN)

    def label(self) -> str:
        if self.route in (Route.FALLBACK, Route.CUDNN):
            return f"{self.route.value} ({self.reason})"
        return self.route.value


def _fallback(reason: str) -> RouteDecision:
    return RouteDecision(Route.FALLBACK, reason)


def static_route(spec: ConvSpec) -> RouteDecision:
    """The part of the decision that depends on the module alone."""
    if spec.groups != 1:
        return _fallback(f"groups={spec.groups}")
    if spec.padding_mode != "zeros":
        return _fallback(f"padding_mode={spec.padding_mode!r}")
    return RouteDecision(Route.CONV_TRANSPOSE2D_IGEMM if spec.transposed else Route.CONV2D_IGEMM)


def _shape_problem(spec: ConvSpec, call: CallDesc, shape: tuple) -> Tuple[Optional[str], Pair]:
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


def select_route(spec: ConvSpec, call: Optional[CallDesc] = None,
                 target: Optional[Target] = None, table=None) -> RouteDecision:
    """Route one convolution.

    With ``call=None`` only the module is judged (what apply() reports and
    what repr shows before the first call). ``table`` (a tables.Table)
    overrides the architecture's own (PatchConfig.table).
    """
    decision = static_route(spec)
    if call is None or not decision.is_kernel:
        return decision
    if call.compiling:
        return _fallback("torch.compile tracing")
    if call.needs_grad:
        return _fallback("autograd needed (grad enabled and an input or parameter requires grad)")
    if target is None or not target.kernels:
        return _fallback(target.reason if target is not None else "no target")
    if call.dtype not in SUPPORTED_DTYPES:
        return _fallback(f"dtype {tables.dtype_name(call.dtype)} unsupported")
    if call.weight_dtype != call.dtype or (call.bias_dtype is not None and call.bias_dtype != call.dtype):
        return _fallback("input, weight and bias dtypes differ")
    if not call.same_device:
        return _fallback("tensors on different devices")
    if len(call.shape) not in (3, 4):
        return _fallback(f"{len(call.shape)}-D input")
    shape = call.shape if len(call.shape) == 4 else (1,) + tuple(call.shape)
    problem, (oh, ow) = _shape_problem(spec, call, shape)
    if problem:
        return _fallback(problem)
    tbl = table if table is not None else tables.packaged_table(target.arch)
    routes = {"igemm"} | {r for r in KERNEL_ROUTE_RULES if route_problem(r, spec, call, shape, target) is None}
    if call.device_type == "cuda":
        routes.add("cudnn")
    cfg, tier = tbl.lookup(spec, shape, call.layout, call.dtype, shape[0] * oh * ow, frozenset(routes))
    name = cfg.get("route", "igemm")
    if name == "cudnn":
        why = "table: cuDNN measured faster"
        if "cudnn_ms" in cfg and "ours_ms" in cfg:
            why += f" ({cfg['cudnn_ms']:.4g} vs {cfg['ours_ms']:.4g} ms)"
        return RouteDecision(Route.CUDNN, why, config=cfg, tier=tier, table=tbl.name)
    return RouteDecision(TABLE_ROUTES[(spec.kind, name)], config=cfg, tier=tier, table=tbl.name)
