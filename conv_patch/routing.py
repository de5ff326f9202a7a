"""The one routing function.

``select_route(spec, call, target)`` names the kernel family that runs a
convolution, or FALLBACK with the reason; the wrappers, their ``repr``, the
patch report, the benchmarks and ``convpatch info`` all call it, so a label can
never disagree with what actually ran.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from . import config_tables
from .specs import CallDesc, ConvSpec, Pair
from .target import Target

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT32_ROWS = 2**31 - 1


class Route(enum.Enum):
    CONV2D_IGEMM = "conv2d_igemm"
    CONV_TRANSPOSE2D_IGEMM = "conv_transpose2d_igemm"
    CONV2D_TMA = "conv2d_tma"
    CONV2D_TAPS = "conv2d_taps"
    CONV2D_FLAT = "conv2d_flat"
    CUDNN = "cudnn"
    FALLBACK = "fallback"

    def __str__(self) -> str:
        return self.value


# What each route accepts; printed by `convpatch info`.
ROUTE_INFO = {
    Route.CONV2D_IGEMM: (
        "portable implicit-GEMM conv2d: any kernel size, stride, padding (per axis, 'same'/'valid'), "
        "dilation; groups=1, zero padding; NCHW, NHWC or strided input read in place; fp16/bf16 "
        "(fp32 accumulate), fp32 (TF32 when PyTorch allows it); fused bias, residual*beta, activation, scale"
    ),
    Route.CONV_TRANSPOSE2D_IGEMM: (
        "portable implicit-GEMM conv_transpose2d (gather form, split by output phase): stride, padding, "
        "output_padding, dilation; groups=1, zero padding; same layouts, dtypes and epilogue as conv2d"
    ),
    Route.CONV2D_TMA: (
        "Hopper (sm90+) conv2d: TMA tensor descriptors (their zero fill is the padding) feeding wgmma, "
        "multi-stage pipeline; stride 1, kernels larger than 1x1, any padding and dilation; fp16/bf16; "
        "C_in a multiple of 8; "
        "NHWC read in place, NCHW through one NHWC staging copy (output written NCHW directly), "
        "except 1x1 and Kx1 convs without column padding under one-pixel-row tiles, whose NCHW input "
        "is read in place; "
        "same fused epilogue as the portable kernels"
    ),
    Route.CONV2D_TAPS: (
        "few output channels (C_out*KH*KW <= 64, e.g. a VAE's conv_out): the input read once by a 1x1 "
        "GEMM against every tap's weights (fp32 partials), then each output pixel's taps summed; any "
        "stride, padding, dilation; same layouts, dtypes and fused epilogue as conv2d"
    ),
    Route.CONV2D_FLAT: (
        "few input channels (C_in*KH*KW <= 64, e.g. a VAE encoder's conv_in on an RGB image): the "
        "implicit GEMM with its reduction over (c_in, kh, kw) flattened into one dimension, so 3x3x3 "
        "is one K = 32 block instead of nine of K = 16; any stride, padding, dilation; same layouts, "
        "dtypes and fused epilogue as conv2d"
    ),
    Route.CUDNN: (
        "the original module, chosen because the architecture's table records cuDNN measured faster for "
        "this exact shape (convpatch tune): cuDNN computes the convolution, then bias and the fused "
        "epilogue run as one pass (conv_patch.ops.epilogue) on NHWC outputs, as PyTorch ops otherwise"
    ),
    Route.FALLBACK: "the original PyTorch module (cuDNN/ATen): every case the kernels do not take",
}

# Table "route" values and the kernel-family routes they name, per conv kind.
TABLE_ROUTES = {
    ("conv2d", "igemm"): Route.CONV2D_IGEMM,
    ("conv2d", "tma"): Route.CONV2D_TMA,
    ("conv2d", "taps"): Route.CONV2D_TAPS,
    ("conv2d", "flat"): Route.CONV2D_FLAT,
    ("conv_transpose2d", "igemm"): Route.CONV_TRANSPOSE2D_IGEMM,
}


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


def tma_arch(arch: str) -> bool:
    """TMA and wgmma exist from sm90 on."""
    return arch.startswith("sm") and arch[2:].isdigit() and int(arch[2:]) >= 90


def tma_problem(spec: ConvSpec, call: CallDesc, shape: tuple, target: Target) -> Optional[str]:
    """Why the Hopper TMA kernel cannot take this call, or None."""
    if spec.transposed:
        return "conv_transpose2d"
    if not (tma_arch(target.arch) or target.interpreter):
        return f"{target.arch} has no TMA"
    sh, sw = spec.stride
    if (sh, sw) != (1, 1):
        # A box of the [N, H/S, S, W/S, S*C] view (kernels/conv2d_tma.py).
        if shape[2] % sh or shape[3] % sw:
            return f"stride {spec.stride} does not divide the input's {shape[2]}x{shape[3]}"
        if spec.in_channels % 16:
            return f"stride {spec.stride} with C_in={spec.in_channels}, not a multiple of 16"
    if not call.aligned16:
        return "input or weight not 16-byte aligned"
    return tma_layout_problem(shape, call.layout, call.dtype.itemsize, spec.in_channels)


# The largest C_out * KH * KW (the first GEMM's N) the taps route takes:
# beyond it the implicit GEMM's column tile is no longer mostly waste.
MAX_TAP_OUTPUTS = 64


def taps_problem(spec: ConvSpec) -> Optional[str]:
    """Why the few-output-channel route cannot take this conv, or None."""
    if spec.transposed:
        return "conv_transpose2d"
    taps = spec.kernel[0] * spec.kernel[1]
    if taps == 1:
        return "1x1 (already a single GEMM)"
    if spec.out_channels * taps > MAX_TAP_OUTPUTS:
        return f"C_out*KH*KW = {spec.out_channels * taps} > {MAX_TAP_OUTPUTS}"
    return None


# The largest C_in * KH * KW the flat route takes: one or two K blocks; past
# it the per-tap reduction wastes little and reads whole pixel rows.
MAX_FLAT_REDUCTION = 64


def flat_problem(spec: ConvSpec) -> Optional[str]:
    """Why the few-input-channel route cannot take this conv, or None."""
    if spec.transposed:
        return "conv_transpose2d"
    k = spec.in_channels * spec.kernel[0] * spec.kernel[1]
    if k > MAX_FLAT_REDUCTION:
        return f"C_in*KH*KW = {k} > {MAX_FLAT_REDUCTION}"
    return None


# Table routes with eligibility rules of their own ("igemm" takes every
# conv2d; "cudnn" is a matter of device, not of the conv).
KERNEL_ROUTE_RULES = ("tma", "taps", "flat")


def route_problem(route: str, spec: ConvSpec, call: CallDesc, shape: tuple, target: Target) -> Optional[str]:
    """Why the table route ``route`` (``KERNEL_ROUTE_RULES``) cannot take this
    call, or None; the one place the router, a given config (``ops``) and
    the tuner ask."""
    if route == "tma":
        return tma_problem(spec, call, shape, target)
    if route == "taps":
        return taps_problem(spec)
    if route == "flat":
        return flat_problem(spec)
    return None


# TMA needs 16-byte aligned base addresses and strides.
TMA_ALIGN = 16


def tma_layout_problem(shape, layout: str, elem_bytes: int, c_in: int) -> Optional[str]:
    """Why a dense input of this shape and layout cannot be described by a TMA
    descriptor (plus the [C_out, KH*KW, C_in] weight pack), or None. NCHW is
    staged through one NHWC copy or, for 1x1 and Kx1 convs under one-row
    tiles, boxed in place where its rows are 16-byte aligned (see
    kernels/conv2d_tma.py), so only the channel count matters."""
    if elem_bytes != 2:
        return "the TMA route takes fp16/bf16"
    if layout not in ("nhwc", "nchw"):
        return f"{layout} input (TMA needs dense NCHW or NHWC)"
    if (c_in * elem_bytes) % TMA_ALIGN:
        return f"C_in={c_in} is not a multiple of {TMA_ALIGN // elem_bytes} (TMA stride alignment)"
    return None


def select_route(spec: ConvSpec, call: Optional[CallDesc] = None,
                 target: Optional[Target] = None, table=None) -> RouteDecision:
    """Route one convolution.

    With ``call=None`` only the module is judged (what apply() reports and
    what repr shows before the first call). ``table`` (a config_tables.Table)
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
        return _fallback(f"dtype {config_tables.dtype_name(call.dtype)} unsupported")
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
    tbl = table if table is not None else config_tables.packaged_table(target.arch)
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
