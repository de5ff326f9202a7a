"""The convolutions as functions, routed like a patched module's call: the
kernels where they take the call, cuDNN where the table measured it faster
(the functional API is not weighed against PyTorch as called: it runs what
it is asked to, so tests, the tuner and benchmarks can time each route).

``conv2d`` / ``conv_transpose2d`` / ``conv3d`` (a given ``config`` picks the
tile and its route) raise ``UnsupportedConv`` with the decision's reason
where a wrapper would fall back; ``upsample_conv2d`` is nearest x2 and a 3x3
conv as four 2x2 convs, ``group_norm_conv2d`` GroupNorm + SiLU + a 3x3 conv
in row bands; ``group_norm``, ``rms_norm``, ``attention`` and ``epilogue``
are the ops themselves (conv_patch/ops/).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.activations import activation_code, eager_epilogue
from conv_patch.ops import conv2d as conv2d_op
from conv_patch.ops import conv3d as conv3d_op
from conv_patch.ops.attention import attention, attention_pays, attention_route, attention_routes  # noqa: F401
from conv_patch.ops.epilogue import check_residual, epilogue  # noqa: F401  (the ops, as functions)
from conv_patch.ops.group_norm import group_norm, group_norm_target, launch_sizes
from conv_patch.ops.loader import kernels
from conv_patch.ops.rms_norm import rms_norm  # noqa: F401
from conv_patch.ops.subpixel import PARITIES, parity_padding, parity_view, parity_weight, subpixel_weights
from conv_patch.routing.decide import decide
from conv_patch.routing.registry import Route
from conv_patch.runtime import pack
from conv_patch.specs import CallDesc, Conv3dSpec, ConvSpec, Pads, needs_grad, pair, resolve_padding
from conv_patch.target import target_for


class UnsupportedConv(RuntimeError):
    """The kernels cannot run this call; the message is the decision's reason."""


def _conv(spec: ConvSpec, x, weight, bias, residual, beta, activation, out_scale, out, force_int64, config,
          table=None):
    activation_code(activation)
    if torch.compiler.is_compiling() and config is None:
        from conv_patch.runtime import compiled
        y = compiled.conv(x, weight, bias, residual, spec.transposed, list(spec.stride), list(spec.pad_begin),
                          list(spec.pad_end), list(spec.dilation), list(spec.output_padding), float(beta),
                          activation, float(out_scale))
        return out.copy_(y) if out is not None else y
    target = target_for(x.device)
    decision = decide(spec, CallDesc.of_call(x, weight, bias, residual), target, table, config=config,
                      as_called=False)
    if decision.route is Route.CUDNN:
        return conv2d_op.cudnn_conv2d(spec, x, weight, bias, residual=residual, beta=beta, activation=activation,
                                      out_scale=out_scale, out=out)
    if not decision.is_kernel:
        raise UnsupportedConv(decision.reason)
    check_residual(residual, conv2d_op.output_shape(spec, tuple(x.shape)))
    w = pack.route_weight(weight, decision.route, spec.transposed)
    return conv2d_op.run_kernel(decision.route, decision.config, target, spec, x, w, bias, residual=residual,
                                beta=beta, activation=activation, out_scale=out_scale, out=out,
                                force_int64=force_int64, memory_format=conv2d_op.output_memory_format(x, weight))


def _spec(transposed, weight, bias, stride, padding, dilation, output_padding=0):
    c_out, c_in = (weight.shape[1], weight.shape[0]) if transposed else (weight.shape[0], weight.shape[1])
    k, d = pair(tuple(weight.shape[2:])), pair(dilation)
    if not transposed and isinstance(padding, (tuple, list)) and len(padding) == 4:
        # F.pad's order, (left, right, top, bottom): a folded F.pad.
        left, right, top, bottom = (int(v) for v in padding)
        if min(padding) < 0:
            raise ValueError(f"padding {tuple(padding)}: negative padding")
        begin, end = (top, left), (bottom, right)
    else:
        begin, end = resolve_padding(padding, k, d)
    return ConvSpec(transposed, int(c_in), int(c_out), k, pair(stride), d, begin, end,
                    pair(output_padding), 1, "zeros", bias is not None)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, *, residual=None,
           beta=1.0, activation="none", out_scale=1.0, out=None, config=None, force_int64=False,
           table=None):
    """``out_scale * act(F.conv2d(x, weight, bias, ...) + beta * residual)`` in one kernel.

    ``padding`` is anything ``F.conv2d`` takes, or a 4-tuple in ``F.pad``'s
    order (left, right, top, bottom): ``conv2d(x, w, padding=(0, 1, 0, 1))``
    equals ``F.conv2d(F.pad(x, (0, 1, 0, 1)), w)`` without the padded copy.
    The weight is read in place through its strides (the TMA route packs a
    copy). ``out`` may be a preallocated output of any layout; ``config``
    overrides the table's tile choice and ``force_int64`` forces 64-bit
    offsets (both for tests and benchmarks); ``table`` is a user table
    (``PatchConfig.table``, loaded)."""
    spec = _spec(False, weight, bias, stride, padding, dilation)
    return _conv(spec, x, weight, bias, residual, beta, activation, out_scale, out, force_int64, config, table)


def conv_transpose2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, *,
                     residual=None, beta=1.0, activation="none", out_scale=1.0, out=None,
                     config=None, force_int64=False):
    """Fused ``F.conv_transpose2d`` (groups=1); ``weight`` is [C_in, C_out, KH, KW]."""
    spec = _spec(True, weight, bias, stride, padding, dilation, output_padding)
    return _conv(spec, x, weight, bias, residual, beta, activation, out_scale, out, force_int64, config)


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
    decision = decide(spec, CallDesc.of_call(x, weight, bias, None), target_for(x.device), table, as_called=False)
    if (decision.route is Route.CUDNN or decision.is_kernel) and decision.config:
        return dict(decision.config)
    return None


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
        decision = decide(spec, call, target_for(x.device), table, as_called=False)
        if decision.is_kernel or decision.route is Route.CUDNN:
            if out is None:
                out = torch.empty(shape, dtype=x.dtype, device=x.device,
                                  memory_format=torch.channels_last if conv2d_op.nhwc(x) else torch.contiguous_format)
            subs = subpixel_weights(weight)
            for a, b in PARITIES:
                conv2d(x, parity_weight(subs, a, b), bias, padding=parity_padding(a, b),
                       residual=None if residual is None else parity_view(residual, a, b), beta=beta,
                       activation=activation, out_scale=out_scale, out=parity_view(out, a, b), table=table)
            return out
    y = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), weight, bias, 1, 1)
    y = eager_epilogue(y, residual, beta, activation, out_scale)
    return out.copy_(y) if out is not None else y


# -- Conv3d ------------------------------------------------------------------------
def _triple(value, name: str) -> tuple:
    if isinstance(value, int):
        value = (value,) * 3
    if not (isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(v, int) for v in value)):
        raise ValueError(f"conv3d: {name} {value!r}: expected an int or 3 ints (t, h, w)")
    if min(value) < 1:
        raise ValueError(f"conv3d: {name} {tuple(value)}: must be >= 1")
    return tuple(int(v) for v in value)


def _front_back(value, what: str) -> tuple:
    if isinstance(value, int):
        value = (value, value)
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise ValueError(f"conv3d: {what} {value!r}: expected an int or a (front, back) pair")
    if min(value) < 0:
        raise ValueError(f"conv3d: {what} {tuple(value)}: negative padding")
    return int(value[0]), int(value[1])


def conv3d_padding(padding, time_padding=None) -> Pads:
    """``((front, back),) * 3`` per axis (t, h, w) from ``conv3d``'s
    ``padding`` and ``time_padding`` arguments."""
    if isinstance(padding, int):
        padding = (padding,) * 3
    if not (isinstance(padding, (tuple, list)) and len(padding) == 3):
        raise ValueError(f"conv3d: padding {padding!r}: expected an int or 3 entries (t, h, w)")
    pads = [_front_back(p, "padding") for p in padding]
    if time_padding is not None:
        pads[0] = _front_back(time_padding, "time_padding")
    return tuple(pads)



def conv3d_decision(x, weight, bias, stride, pads, dilation, *, cache=None, residual=None, config=None,
                    shape=None):
    """The decision ``conv3d(..., route="kernel")`` takes for these tensors
    (``stride``/``dilation`` triples, ``pads`` per axis as
    ``conv3d_padding`` gives them; ``shape``, the output's, where the caller
    has it): ``decide``'s, not weighed against PyTorch."""
    spec = Conv3dSpec(weight.shape[1], weight.shape[0], tuple(weight.shape[2:]), tuple(stride), tuple(dilation),
                      tuple(pads), 1, "zeros", bias is not None)
    if shape is None:
        shape = conv3d_op.output_shape(x, weight, bias, cache, stride, pads, dilation)
    desc = CallDesc.of_call(x, weight, bias, residual, cache=cache, out_numel=math.prod(shape))
    return decide(spec, desc, target_for(x.device), config=config, as_called=False)


def conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1, *, cache=None, time_padding=None,
           residual=None, beta=1.0, activation="none", out_scale=1.0, out=None, route=None, config=None,
           force_int64=False):
    """``out_scale * act(F.conv3d(pad(cat([cache, x], 2)), weight, bias, stride, 0, dilation) + beta * residual)``
    in one kernel, groups = 1, the concatenation and the padding never written.

    ``x`` is [N, C, T, H, W] in any strides (NCDHW and channels_last_3d
    alike); ``cache`` (optional) [N, C, Tc, H, W], the frames that precede
    ``x`` in time (a causal video VAE's cached frames), read in place.
    ``padding`` is, per axis (t, h, w), an int (both ends) or a
    ``(front, back)`` pair; a single int pads every axis at both ends, as
    F.conv3d does. ``time_padding=(front, back)`` replaces padding's time
    entry: a causal conv is ``padding=(0, 1, 1), time_padding=(2, 0)``
    (front only) for a 3x3x3 kernel. The output size follows from the padded,
    concatenated input. ``out`` may be a preallocated output of any
    strides. Where no kernel runs (no GPU and no interpreter, float64,
    autograd, mixed devices or dtypes) PyTorch computes the same expression.
    ``route``: None (the kernel under the interpreter; PyTorch on a GPU,
    where only the dispatch core's measured table entries say when the
    kernel beats cuDNN), "kernel" (the kernel wherever it can run) or
    "pytorch". ``config`` overrides the tile; with ``"route": "tma"`` it runs
    the sm90 TMA kernel (kernels/conv3d_tma.py: fp16/bf16, dense NDHWC input
    and cache, H and W at stride 1; ValueError otherwise). ``force_int64``
    forces 64-bit offsets (tests). Raises ValueError for groups > 1 and ill-shaped
    arguments."""
    if route not in (None, "kernel", "pytorch"):
        raise ValueError(f"conv3d: route {route!r}: expected None, 'kernel' or 'pytorch'")
    activation_code(activation)
    stride, dilation = _triple(stride, "stride"), _triple(dilation, "dilation")
    pads = conv3d_padding(padding, time_padding)
    shape = conv3d_op.output_shape(x, weight, bias, cache, stride, pads, dilation)
    check_residual(residual, shape)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"conv3d: out has shape {tuple(out.shape)}, the convolution's output is {shape}")
    target = target_for(x.device)
    decision = None
    if route == "kernel" or (route is None and target.interpreter):
        decision = conv3d_decision(x, weight, bias, stride, pads, dilation, cache=cache, residual=residual,
                                   config=config, shape=shape)
        if decision.tier == "given" and not decision.is_kernel:
            raise ValueError(f"conv3d: {decision.reason}")
        if out is not None and (out.dtype != x.dtype or out.device != x.device):
            decision = None
    if decision is None or not decision.is_kernel:
        y = eager_epilogue(conv3d_op.torch_conv3d(x, weight, bias, cache, pads, stride, dilation), residual, beta,
                           activation, out_scale)
        return out.copy_(y) if out is not None else y
    return conv3d_op.run_kernel(decision.route, decision.config, target, x, pack.route_weight(weight, decision.route),
                                bias, cache, pads, stride, dilation, residual=residual, beta=beta,
                                activation=activation, out_scale=out_scale, out=out, force_int64=force_int64)
