"""Torch-facing ops besides the convolution's launch (conv_patch/conv.py)
and GroupNorm (conv_patch/norm.py, re-exported here): the functional
convolution API, GroupNorm+conv in bands, attention for wide heads, and the
upsample folded into a conv.

``conv2d`` / ``conv_transpose2d`` are the functional entry points (tests,
the tuner, benchmarks; a given ``config`` picks the tile). They route
through ``select_route`` and raise ``UnsupportedConv`` (with the router's
reason) where the wrappers would fall back. The conv names of
conv_patch/conv.py are re-exported here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.runtime import pack
from conv_patch.activations import ACTIVATIONS, activation_code, eager_epilogue  # noqa: F401  (re-exported)
from conv_patch.routing.select import Route, RouteDecision, select_route, tma_arch
from conv_patch.specs import CallDesc, ConvSpec, _pair, needs_grad, resolve_padding
from conv_patch.target import Target, target_for
from conv_patch.ops.conv2d import (EPILOGUE_BLOCK, check_residual, cudnn_conv2d, epilogue, kernels, nhwc,  # noqa: F401
                                   output_memory_format, output_shape, run_kernel, to_nhwc)
from conv_patch.ops.group_norm import (GN_LAUNCH, group_norm, group_norm_target, launch_sizes)  # noqa: F401  (re-exported)
from conv_patch.ops.rms_norm import rms_norm, rms_norm_target  # noqa: F401  (re-exported)
from conv_patch.ops.subpixel import PARITIES, parity_padding, parity_view, parity_weight
from conv_patch.ops.subpixel import subpixel_weights  # noqa: F401  (re-exported)
from conv_patch.ops.conv3d import conv3d, conv3d_padding  # noqa: F401  (re-exported)


class UnsupportedConv(RuntimeError):
    """The kernels cannot run this call; the message is the router's reason."""


def _functional(spec: ConvSpec, x, weight, bias, residual, beta, activation, out_scale,
                out, force_int64, config, table=None):
    activation_code(activation)
    if torch.compiler.is_compiling() and config is None:
        from conv_patch.runtime import compiled
        y = compiled.conv(x, weight, bias, residual, spec.transposed, list(spec.stride), list(spec.pad_begin),
                          list(spec.pad_end), list(spec.dilation), list(spec.output_padding), float(beta),
                          activation, float(out_scale))
        return out.copy_(y) if out is not None else y
    call = CallDesc.of_call(x, weight, bias, residual)
    target = target_for(x.device)
    decision = select_route(spec, call, target, table)
    if config is not None and decision.route in (Route.CONV2D_IGEMM, Route.CONV2D_TMA, Route.CONV2D_TAPS,
                                                 Route.CONV2D_FLAT, Route.CUDNN):
        # A given config may name its route (tests, the tuner); the router
        # still decides whether the call is eligible for it.
        decision = _given(spec, call, target, config)
    elif config is not None and decision.is_kernel:
        decision = dataclasses.replace(decision, config=config, tier="given", table="")
    if decision.route is Route.CUDNN:
        return cudnn_conv2d(spec, x, weight, bias, residual=residual, beta=beta, activation=activation,
                            out_scale=out_scale, out=out)
    if not decision.is_kernel:
        raise UnsupportedConv(decision.reason)
    check_residual(residual, output_shape(spec, tuple(x.shape)))
    w = weight.transpose(0, 1) if spec.transposed else weight
    return run_kernel(decision, target, spec, x, w, bias, residual=residual, beta=beta,
                      activation=activation, out_scale=out_scale, out=out,
                      force_int64=force_int64, memory_format=output_memory_format(x, weight))


def _given(spec, call, target, config):
    from conv_patch.routing.select import TABLE_ROUTES, route_problem
    name = config.get("route", "igemm")
    if name == "cudnn":
        return RouteDecision(Route.CUDNN, "given config", config=config, tier="given")
    shape = call.shape if len(call.shape) == 4 else (1,) + tuple(call.shape)
    problem = route_problem(name, spec, call, shape, target)
    if problem:
        raise UnsupportedConv(f"{name} route: {problem}")
    return RouteDecision(TABLE_ROUTES.get(("conv2d", name), Route.CONV2D_IGEMM), config=config, tier="given")


def _spec(transposed, weight, bias, stride, padding, dilation, output_padding=0):
    c_out, c_in = (weight.shape[1], weight.shape[0]) if transposed else (weight.shape[0], weight.shape[1])
    k, d = _pair(tuple(weight.shape[2:])), _pair(dilation)
    if not transposed and isinstance(padding, (tuple, list)) and len(padding) == 4:
        # F.pad's order, (left, right, top, bottom): a folded F.pad.
        left, right, top, bottom = (int(v) for v in padding)
        if min(padding) < 0:
            raise ValueError(f"padding {tuple(padding)}: negative padding")
        begin, end = (top, left), (bottom, right)
    else:
        begin, end = resolve_padding(padding, k, d)
    return ConvSpec(transposed, int(c_in), int(c_out), k, _pair(stride), d, begin, end,
                    _pair(output_padding), 1, "zeros", bias is not None)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, *, residual=None,
           beta=1.0, activation="none", out_scale=1.0, out=None, config=None, force_int64=False,
           table=None):
    """``out_scale * act(F.conv2d(x, weight, bias, ...) + beta * residual)`` in one kernel.

    ``padding`` is anything ``F.conv2d`` takes, or a 4-tuple in ``F.pad``'s
    order (left, right, top, bottom): ``conv2d(x, w, padding=(0, 1, 0, 1))``
    equals ``F.conv2d(F.pad(x, (0, 1, 0, 1)), w)`` without the padded copy.
    The weight is read in place through its strides (no pack). ``out`` may be
    a preallocated output of any layout; ``config`` overrides the table's tile
    choice and ``force_int64`` forces 64-bit offsets (both for tests and
    benchmarks); ``table`` is a user table (``PatchConfig.table``, loaded)."""
    spec = _spec(False, weight, bias, stride, padding, dilation)
    return _functional(spec, x, weight, bias, residual, beta, activation, out_scale, out,
                       force_int64, config, table)


def conv_transpose2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, *,
                     residual=None, beta=1.0, activation="none", out_scale=1.0, out=None,
                     config=None, force_int64=False):
    """Fused ``F.conv_transpose2d`` (groups=1); ``weight`` is [C_in, C_out, KH, KW]."""
    spec = _spec(True, weight, bias, stride, padding, dilation, output_padding)
    return _functional(spec, x, weight, bias, residual, beta, activation, out_scale, out,
                       force_int64, config)


def group_norm_conv2d(x: torch.Tensor, num_groups: int, norm_weight, norm_bias, eps: float, activation: str,
                      weight: torch.Tensor, bias=None, *, band_bytes: int, table=None) -> torch.Tensor:
    """``conv2d(act(group_norm(x)), weight, bias, padding=1)`` for a 3x3
    ``weight`` and a dense NHWC ``x``, without the normalised tensor ever
    existing whole: the statistics first, then band by band of rows (at most
    ``band_bytes`` of normalised input each, halo rows included) the
    normalised band and the conv of it into its rows of the output. What a
    2048^2 decode's first full-resolution block saves: its 2 GiB input's
    normalised copy. Where the kernels cannot take the call, the unbanded
    expression."""
    n, c, h, w = x.shape
    target = group_norm_target(x, num_groups, norm_weight, norm_bias)
    if (tuple(weight.shape[1:]) != (c, 3, 3) or not x.is_contiguous(memory_format=torch.channels_last)
            or target is None):
        return conv2d(group_norm(x, num_groups, norm_weight, norm_bias, eps, activation), weight, bias,
                      padding=1, table=table)
    k = kernels()
    block, stats_block, programs = launch_sizes(target)
    scale_shift = k.launch_group_norm_stats(x, num_groups, norm_weight, norm_bias, float(eps),
                                                  True, stats_block, programs)
    out = torch.empty((n, weight.shape[0], h, w), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last)
    # Bands of equal height: a short last band is a launch of its own for a
    # few rows (a 2048^2 decode had 8- and 9-row ones).
    most = max(1, band_bytes // (w * c * x.element_size()) - 2)
    rows = -(-h // -(-h // most))
    band = torch.empty((1, c, rows + 2, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    code = activation_code(activation)
    # Every band runs the route and tile the table gives the whole conv: a
    # band's own shape (fewer rows, padding on one side) has no exact entry,
    # and its bucket had put a 2048^2 decode's 512 -> 256 conv on the TMA
    # kernel where cuDNN is 16% faster and its 128 -> 3 conv_out on the TMA
    # kernel at 3x the taps route's time (bench/README.md, 2026-12-01).
    whole = _band_config(x, weight, bias, table)
    for i in range(n):
        for r0 in range(0, h, rows):
            # Output rows r0..r1 read input rows r0-1..r1 (the conv's halo).
            # The band always holds both halo rows, zeros past the image
            # edge (the conv's zero padding), so every band is the same
            # symmetric conv, which cuDNN takes as well as the kernels.
            r1 = min(h, r0 + rows)
            a, b = max(0, r0 - 1), min(h, r1 + 1)
            top = a - (r0 - 1)
            src = band[:, :, :r1 - r0 + 2]
            if top:
                src[:, :, :1].zero_()
            if b < r1 + 1:
                src[:, :, -1:].zero_()
            k.launch_group_norm_apply(x[i:i + 1, :, a:b], src[:, :, top:top + b - a], scale_shift[i:i + 1],
                                            code, True, block)
            dst = out[i:i + 1, :, r0:r1]
            try:
                conv2d(src, weight, bias, padding=(0, 1), out=dst, table=table, config=whole)
            except UnsupportedConv:
                conv2d(src, weight, bias, padding=(0, 1), out=dst, table=table)
    return out


def _band_config(x, weight, bias, table) -> Optional[dict]:
    """The config (route included) the table picks for the unbanded 3x3 conv
    of ``x``, for its bands to run; None where that is no kernel or cuDNN."""
    spec = _spec(False, weight, bias, 1, 1, 1)
    decision = select_route(spec, CallDesc.of_call(x, weight, bias, None), target_for(x.device), table)
    if (decision.route is Route.CUDNN or decision.is_kernel) and decision.config:
        return dict(decision.config)
    return None


# Attention with a head wider than 256 channels (the VAE mid-block's single
# 512-channel head) has no FlashAttention or cuDNN kernel in PyTorch; its
# memory-efficient kernel ran at ~150 TF/s on the H200 (3.6 ms at N = 16384,
# 67 ms at N = 65536). So the scores of a block of query rows are
# materialised. On Hopper (and under the interpreter) two Triton GEMMs do it
# with the softmax folded into them and the scores written once, in the
# input dtype (kernels/attention.py); elsewhere cuBLAS runs both GEMMs
# with fp32 scores and a softmax pass between them (kernels/softmax.py). The
# probabilities are rounded once to the input dtype for the second GEMM, as
# FlashAttention rounds them. Blocks are bounded in bytes so that a 2048^2
# decode stays within its memory budget: its mid-block runs where little
# else is allocated, far below the decode's peak in the last up block.
ATTENTION_BLOCK_BYTES = 256 << 20
FUSED_ATTENTION_BLOCK_BYTES = 1 << 30
# Softmax (block, warps) per program. H200, fp32 scores to bf16: 8192 with 16
# warps ran a 4096 x 16384 block in 0.105 ms against 0.163 with (2048, 8) (the
# second pass reads the row back from L2), and a 1024 x 65536 block at the
# same 4 TB/s as every other choice. Under the interpreter one block per row.
SOFTMAX_LAUNCH = {"gpu": (8192, 16), "interpreter": (1 << 16, 4)}
# Tiles of the fused route: the score tile (its width is the granularity of
# the softmax partials and the P V kernel's K step) and the P V tile. H200,
# bf16, one 512-wide head (bench/results/attention-tiles-h200-2026-12-01.json):
# scores 128x128x64 with 4 warps and 3 stages ran at 494-532 TF/s (8 warps
# 442-480; 128x256 and 256x128 tiles 277-390; 4 stages 424; a persistent,
# flattened loop no faster), P V 128x128 with 8 warps and 3 stages at 560-575
# (whole attention at 65536 tokens 19.0 ms against 23.6 with 2 stages, 21.5
# with 4 warps, 20.1 with 64-row and 21.7 with 128x256 tiles; 4 stages exceed
# shared memory); GROUP_M 32 saved 2% over 8, and 32-row combine programs
# 0.1 ms of 0.45 over 128-row ones (64 programs). Interpreter tiles are small so
# that the tests' awkward sizes span several tiles and K blocks.
FUSED_ATTENTION_TILES = {
    "gpu": {"scores": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 32, "num_warps": 4, "num_stages": 3},
            "combine": {"BLOCK_R": 32, "BLOCK_T": 32, "num_warps": 4},
            "pv": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}},
    "interpreter": {"scores": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2},
                    "combine": {"BLOCK_R": 16, "BLOCK_T": 2},
                    "pv": {"BLOCK_M": 16, "BLOCK_N": 16}},
}


def attention_pays(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``attention`` materialises the scores (a CUDA fp16/bf16 call
    with a head wider than PyTorch's fused kernels take, or any call under
    the interpreter, where the tests exercise it) instead of calling SDPA."""
    return _attention_target(q, k, v) is not None


def attention_route(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """"fused" (kernels/attention.py), "blocked" (cuBLAS + softmax kernel) or
    "sdpa": what ``attention`` runs for these tensors."""
    if _attention_target(q, k, v) is None:
        return "sdpa"
    return "fused" if "fused" in attention_routes(q, k, v) else "blocked"


def attention_routes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """Every route that can compute this call, whether or not it pays: what
    ``attention(..., route=)`` may ask for. "sdpa" always; "blocked" where
    the kernels take the tensors; "fused" where, besides, TMA does (on a
    GPU fp16/bf16 only: Triton's fp32 dot is TF32 there)."""
    target = _attention_target(q, k, v, any_width=True)
    if target is None:
        return ("sdpa",)
    fused = target.interpreter or (tma_arch(target.arch) and q.dtype in (torch.float16, torch.bfloat16))
    return ("blocked", "fused", "sdpa") if fused else ("blocked", "sdpa")


def _attention_target(q, k, v, any_width: bool = False) -> Optional[Target]:
    if torch.compiler.is_compiling() or q.dim() < 2 or needs_grad(q, k, v):
        return None
    target = target_for(q.device)
    if not target.kernels or not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return None
    if target.interpreter or any_width:
        ok = q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    else:
        ok = q.dtype in (torch.float16, torch.bfloat16) and max(q.shape[-1], v.shape[-1]) > 256
    return target if ok else None


def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) as a TMA can describe it: unit column stride, 16-byte
    aligned base and row stride; otherwise a copy with its rows padded to a
    16-byte multiple, returned as a view of the original width."""
    align = 16 // t.element_size()
    if t.stride(1) == 1 and t.stride(0) % align == 0 and t.data_ptr() % 16 == 0:
        return t
    cols = -(-t.shape[1] // align) * align
    out = t.new_zeros((t.shape[0], cols))
    out[:, :t.shape[1]] = t
    return out[:, :t.shape[1]]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None, *,
              route: Optional[str] = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, scale=scale)`` (no mask, no
    dropout) for [..., N, D] queries and [..., M, D] keys and values: scores
    materialised in blocks of query rows where that pays (``attention_pays``;
    ``attention_route`` names the kernels), SDPA otherwise. ``route``
    ("fused", "blocked" or "sdpa"; benchmarks and tests) overrides the choice
    where ``attention_routes`` lists it."""
    if route is None:
        route = attention_route(q, k, v)
    else:
        routes = attention_routes(q, k, v)
        if route not in routes:
            raise ValueError(f"attention route {route!r} is not available for these tensors "
                             f"(available: {', '.join(sorted(routes))})")
    if route == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    interp = target_for(q.device).interpreter
    kern = kernels()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    n, d, m, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q3 = q.expand(*lead, n, d).reshape(-1, n, d)
    k3 = k.expand(*lead, m, d).reshape(-1, m, d)
    v3 = v.expand(*lead, m, dv).reshape(-1, m, dv)
    out = torch.empty((q3.shape[0], n, dv), dtype=q.dtype, device=q.device)
    if route == "fused":
        config = FUSED_ATTENTION_TILES["interpreter" if interp else "gpu"]
        align = 16 // q.element_size()
        m_pad = -(-m // align) * align
        rows = max(1, min(n, FUSED_ATTENTION_BLOCK_BYTES // (m_pad * q.element_size())))
        t = kern.attention_partial_columns(m, config)
        e = torch.empty((rows, m_pad), dtype=q.dtype, device=q.device)
        mx = torch.empty((t, rows), dtype=torch.float32, device=q.device)
        sm = torch.empty_like(mx)
        for b in range(q3.shape[0]):
            qb, kb, vb = _tma_rows(q3[b]), _tma_rows(k3[b]), _tma_rows(v3[b])
            for i in range(0, n, rows):
                r = min(rows, n - i)
                kern.launch_attention_block(qb[i:i + r], kb, vb, out[b, i:i + r], e, mx, sm, scale, config,
                                            interp)
        return out.view(*lead, n, dv)
    rows = max(1, min(n, ATTENTION_BLOCK_BYTES // (4 * max(m, 1))))
    scores = torch.empty((rows, m), dtype=torch.float32, device=q.device)
    probs = torch.empty((rows, m), dtype=q.dtype, device=q.device)
    block, warps = SOFTMAX_LAUNCH["interpreter" if interp else "gpu"]
    for b in range(q3.shape[0]):
        kt = k3[b].t()
        if interp:
            kt = kt.float()
        for i in range(0, n, rows):
            r = min(rows, n - i)
            if interp:
                torch.mm(q3[b, i:i + r].float(), kt, out=scores[:r])
            else:
                torch.mm(q3[b, i:i + r], kt, out_dtype=torch.float32, out=scores[:r])
            kern.launch_softmax_rows(scores[:r], probs[:r], scale, block, warps)
            torch.mm(probs[:r], v3[b], out=out[b, i:i + r])
    return out.view(*lead, n, dv)


# The folded upsample (nearest x2 then a 3x3 conv as four 2x2 convs of the
# source) and its weight fold: conv_patch/subpixel.py.


# Below this many source multiply-adds per tap (N*H*W*C_in*C_out) the four
# 2x2 launches cost more host time than they save GPU time: on the H200 each
# Triton launch costs ~70 us of host time (bench/results/overhead-*.json), so
# four of them (~0.6 ms with the weight folding) only pay once the GPU work
# they replace is larger: 4e9 puts the FLUX VAE's 512-channel 128^2 upsample
# and everything above on the folded path and TAEF2's 64-channel upsamples,
# host-bound at every resolution, on upsample + one conv.
SUBPIXEL_MIN_MACS = 4e9


def subpixel_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``upsample_conv2d``'s folded form is worth its four launches
    here (always under the interpreter, where the tests exercise it, under
    torch.compile, where ``upsample_conv2d`` traces the plain form, and while
    a CUDA graph is captured or its warm-up runs, ``pack.on_graph_path``:
    a replay costs no host time per launch)."""
    if torch.compiler.is_compiling() or target_for(x.device).interpreter:
        return True
    n, _, h, w = x.shape
    # (The size first: the graph question asks CUDA.)
    return n * h * w * weight.shape[0] * weight.shape[1] >= SUBPIXEL_MIN_MACS or pack.on_graph_path(x)


def upsample_conv2d(x, weight, bias=None, *, residual=None, beta=1.0, activation="none",
                    out_scale=1.0, out=None, table=None):
    """``conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), weight, bias,
    padding=1)`` (+ the fused epilogue) for a 3x3 ``weight``, as four 2x2
    convolutions of ``x`` written into the parity-strided views of one
    output (``out``, or a new one in ``x``'s layout). Where the kernels cannot
    run, PyTorch computes the unfused expression."""
    activation_code(activation)
    if tuple(weight.shape[2:]) != (3, 3) or x.dim() != 4:
        raise ValueError(f"upsample_conv2d: needs a 3x3 weight and a 4-D input, got weight "
                         f"{tuple(weight.shape)} and input {tuple(x.shape)}")
    n, _, h, w = x.shape
    shape = (n, weight.shape[0], 2 * h, 2 * w)
    check_residual(residual, shape)
    if not torch.compiler.is_compiling():
        spec = _spec(False, weight.new_empty((weight.shape[0], weight.shape[1], 2, 2), device="meta"),
                     bias, 1, (1, 0, 1, 0), 1)
        call = CallDesc.of_call(x, weight, bias, residual)
        decision = select_route(spec, call, target_for(x.device), table)
        if decision.is_kernel or decision.route is Route.CUDNN:
            if out is None:
                out = torch.empty(shape, dtype=x.dtype, device=x.device,
                                  memory_format=torch.channels_last if nhwc(x) else torch.contiguous_format)
            subs = subpixel_weights(weight)
            for a, b in PARITIES:
                conv2d(x, parity_weight(subs, a, b), bias, padding=parity_padding(a, b),
                       residual=None if residual is None else parity_view(residual, a, b), beta=beta,
                       activation=activation, out_scale=out_scale, out=parity_view(out, a, b), table=table)
            return out
    y = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), weight, bias, 1, 1)
    y = eager_epilogue(y, residual, beta, activation, out_scale)
    return out.copy_(y) if out is not None else y
