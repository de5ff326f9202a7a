"""How a plan is made: the first call of a signature is routed
(``routing.decide``: the registry's rules, the table, the cost model), its
plan built, its kernel launches recorded for replay (``plans.recorded``),
and the call run. Here for the 2-D convs (autocast included), the Conv3d
calls and the norms; every later call of the signature is the dispatch
core's lookup and ``plan.run``. A kernel that fails to build or launch here
falls back in this one place, for every caller, and the plan remembers it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from conv_patch.activations import activation_fn
from conv_patch.ops import conv2d as conv2d_op
from conv_patch.ops import conv3d as conv3d_op
from conv_patch.ops import group_norm as group_norm_op
from conv_patch.ops import rms_norm as rms_norm_op
from conv_patch.ops.epilogue import check_residual
from conv_patch.ops.loader import kernel_errors
from conv_patch.routing import costs, tables
from conv_patch.routing.decide import LEAN, RouteDecision, decide, fallback, table_for
from conv_patch.routing.registry import Route
from conv_patch.runtime import pack
from conv_patch.runtime.plans import (CUDNN, KERNEL, MODULE, AutocastPlan, Conv3dPlan, ConvPlan, KernelSlot, NormPlan,
                                      autocast_in_kernels, building, eager, kernel_failure, recorded, store_plan)
from conv_patch.runtime.state import state_of
from conv_patch.specs import CallDesc, HALF_DTYPES
from conv_patch.target import target_for


# -- 2-D convs -------------------------------------------------------------------
def build(m, key, call, weight, bias):
    """(plan, result of this call): the plan of ``key`` (``plans.conv_key``),
    built and stored, and the call run through it."""
    with building(call.x, lambda: f"{type(m).__name__} {m.spec.describe()} on {tuple(call.x.shape)}"):
        plans = state_of(m).plans
        plan = plans.get(key) if plans is not None else None
        if plan is not None:  # built by another thread while this one waited
            return plan, plan.run(m, call, weight, bias)
        grad, cast, graph = key[-3], key[-2], key[-1]
        # Built inside someone else's CUDA graph capture: weighed for it, not kept.
        foreign = not graph and pack.foreign_capture(call.x)
        graph = graph or foreign
        if cast is None:
            plan, y = _build(m, graph, call, weight, bias, packable=not grad)
        else:
            plan = AutocastPlan(cast, call.x.device.type, call.padding)
            if autocast_in_kernels(plan, call, grad):
                plan.inner, y = _build(m, graph, plan.cast_call(call), plan.cast(weight), plan.cast(bias),
                                       slot=False)
            else:
                y = plan.run(m, call, weight, bias)
        store_plan(m, key, plan, keep=not foreign)
        return plan, y


def decide_call(m, call, weight, bias, graph: bool) -> tuple:
    """(decision, spec) for one call of patched conv ``m`` (or a call site):
    ``routing.decide`` on the module's spec with the call's own padding."""
    spec, problem = spec_for_call(m, weight, call.padding)
    if problem:
        return fallback(problem), spec
    x = call.x
    desc = CallDesc.of_call(x, weight, bias, call.residual, call.output_padding,
                            epilogue=costs.epilogue_ops(call.residual is not None, call.beta, call.activation,
                                                        call.out_scale),
                            graph=graph, packed=not pack.is_kernel_layout(pack.kernel_view(weight, spec.transposed)),
                            out=call.out)
    return decide(spec, desc, target_for(x.device), state_of(m).table), spec


def spec_for_call(m, weight, padding) -> tuple:
    """(spec, problem): the module's spec, with a call's own padding (F.pad
    order) where given; problem is why the kernels must not take the
    module's call at all (its weight no longer matches its attributes:
    PyTorch computes from the weight, or raises its own error)."""
    spec = m.spec
    kernel = tuple(weight.shape[2:])
    c_out, c_in = (weight.shape[1], weight.shape[0]) if spec.transposed else (weight.shape[0], weight.shape[1])
    if weight.dim() != 4 or kernel != spec.kernel or (c_in, c_out) != (spec.in_channels, spec.out_channels):
        return spec, (f"weight {tuple(weight.shape)} does not match the module's "
                      f"{spec.in_channels}->{spec.out_channels} k{spec.kernel[0]}x{spec.kernel[1]}")
    if padding is not None:
        left, right, top, bottom = (int(v) for v in padding)
        spec = dataclasses.replace(spec, pad_begin=(top, left), pad_end=(bottom, right))
    return spec, None


# Recorded kernel plans also found on the bare fast path (``bench.ab``'s
# ``full-path`` variant turns it off to measure it).
KERNEL_SLOTS = True


def _build(m, graph, call, weight, bias, packable=False, slot=True):
    """(plan, result of this call) for a call without autocast; ``packable``:
    without autograd (a PyTorch-route call on an NHWC input may then read
    the weight's pack, ``ConvPlan.cl_pack``). ``slot``: a recorded KERNEL
    plan of a plain call is also found on the bare fast path
    (``plans.KernelSlot``); not for autocast's cast call, whose weight is a
    temporary."""
    x = call.x
    decision, spec = decide_call(m, call, weight, bias, graph)
    plan = ConvPlan(MODULE, decision, spec, graph=graph, direct=direct_args(m, spec, call.padding, call.fallback_args),
                    padding=call.padding)
    plan.cl_pack = packable and plan.direct is not None and x.is_cuda and x.dim() == 4 and conv2d_op.nhwc(x)
    if decision.route is Route.CUDNN:
        plan.kind = CUDNN
    elif decision.is_kernel:
        if call.residual is not None:
            check_residual(call.residual, conv2d_op.output_shape(spec, tuple(x.shape), call.output_padding))
        plan.kind = KERNEL
        plan.memory_format = conv2d_op.output_memory_format(x, weight)
        if decision.tier == LEAN or decision.entry.weight_in_place:
            w = pack.kernel_view(weight.detach(), spec.transposed)
        else:
            w = pack.packed_weight(m, weight, spec.transposed)
            if not pack.is_kernel_layout(pack.kernel_view(weight.detach(), spec.transposed)):
                plan.pack_entry = state_of(m).pack
        b = None if call.no_bias else conv2d_op.kernel_bias(bias, call.activation, spec.out_channels, x.device)
        try:
            y, plan.program = recorded(lambda: plan.launch(call, w, b), (x, w, b, call.residual, call.out))
        except kernel_errors() as e:
            # Raised while compiling or launching, before anything ran.
            plan = ConvPlan(MODULE, fallback(kernel_failure(e, stacklevel=6)), spec, graph=graph,
                            padding=call.padding)
        else:
            if (slot and KERNEL_SLOTS and plan.program is not None and call.out is None and not call.no_bias
                    and call.padding is None and call.output_padding is None and not call.fallback_args
                    and not graph and call.residual is not x):
                st = state_of(m)
                if st.bare is None:
                    st.bare = {}
                st.bare[bare_slot(x, call.residual, call.activation, call.beta, call.out_scale)] = \
                    KernelSlot(plan, weight, bias, call.residual)
            return plan, ((y, bias) if call.no_bias else y)
    eager_only = plan.kind == MODULE and plan.direct is not None and call.out is None and not call.no_bias
    plan.bare = eager_only and call.plain_epilogue
    if eager_only and call.padding is None and call.output_padding is None and not call.fallback_args and not graph:
        remember_bare(m, call, plan)
    return plan, plan.run(m, call, weight, bias)


def direct_args(m, spec, padding, fallback_args):
    """F.conv2d's arguments where the module's forward is nn.Conv2d's own
    on zero padding (so calling F.conv2d is that forward, minus its Python)."""
    orig = state_of(m).original
    cls = type(orig) if orig is not None else m.cp_torch_class
    if (spec.transposed or fallback_args or cls.forward is not torch.nn.Conv2d.forward
            or cls._conv_forward is not torch.nn.Conv2d._conv_forward or m.padding_mode != "zeros"):
        return None
    if padding is not None:
        # The call's own padding, where F.conv2d can take it without an F.pad
        # (the same on both sides of each axis: a band inside the image).
        left, right, top, bottom = (int(v) for v in padding)
        return (m.stride, (top, left), m.dilation, m.groups) if (left, top) == (right, bottom) else None
    return (m.stride, m.padding, m.dilation, m.groups)


def bare_slot(x, residual, activation, beta, out_scale) -> tuple:
    """The slot a plan of the bare path is remembered under
    (``remember_bare``). ``dispatch.bare_call`` builds the same tuple
    inline, one Python frame less per call of every conv; were the two to
    differ, every call would build its plan again, which the bare-path tests
    count (``conv_key`` calls)."""
    res = None if residual is None else (residual.stride(), residual.dtype, residual.data_ptr() & 15)
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, activation, res, beta, out_scale)


def remember_bare(m, call, plan):
    st = state_of(m)
    if st.bare is None:
        st.bare = {}
    st.bare[bare_slot(call.x, call.residual, call.activation, call.beta, call.out_scale)] = (
        plan.direct, plan.decision, activation_fn(call.activation), plan.cl_pack)


# -- Conv3d ------------------------------------------------------------------------
def build_conv3d(m, key, call, weight, bias, cast: bool, graph: bool):
    """(plan, result of this call) for a Conv3d call: routed, built, stored."""
    with building(call.x, lambda: f"{type(m).__name__} {m.spec.describe()} on {tuple(call.x.shape)}"):
        x = call.x
        foreign = pack.foreign_capture(x)  # (not kept: pack.graph_flag says why)
        spec = m.spec if call.pads is None else dataclasses.replace(m.spec, pads=call.pads)
        target = target_for(x.device)
        decision = decide_conv3d(m, spec, call, weight, bias, cast, graph or foreign, target)
        plan = Conv3dPlan(decision, spec, target if decision.is_kernel else None)
        if decision.is_kernel:
            try:
                y = plan.run(m, call, weight, bias)
            except kernel_errors() as e:
                plan = Conv3dPlan(fallback(kernel_failure(e, stacklevel=4)), spec)
            else:
                store_plan(m, key, plan, keep=not foreign)
                return plan, y
        store_plan(m, key, plan, keep=not foreign)
        return plan, plan.run(m, call, weight, bias)


def decide_conv3d(m, spec, call, weight, bias, cast: bool, graph: bool, target) -> RouteDecision:
    """A Conv3d call's decision (``routing.decide``): the call's shape
    checked first (the module's own forward raises PyTorch's error for a
    call PyTorch rejects, or computes it)."""
    problem = spec.problem()
    if problem is not None:
        return fallback(problem)
    try:
        shape = conv3d_op.output_shape(call.x, weight, bias, call.cache, spec.stride, spec.pads, spec.dilation)
    except ValueError as e:
        return fallback(str(e))
    check_residual(call.residual, shape)
    desc = CallDesc.of_call(call.x, weight, bias, call.residual, cache=call.cache,
                            epilogue=costs.epilogue_ops(call.residual is not None, call.beta, call.activation,
                                                        call.out_scale),
                            graph=graph, cast=cast, out_numel=math.prod(shape))
    return decide(spec, desc, target, state_of(m).table)


def conv3d_table(m, target):
    """The table a Conv3d module's calls on ``target`` read: PatchConfig's,
    else the architecture's own."""
    return table_for(target, None if m is None else state_of(m).table)


# -- norms -------------------------------------------------------------------------
def group_norm_decision(x, num_groups, weight, bias, graph) -> tuple:
    """(kernels?, why) for one GroupNorm call (``costs.group_norm_pays``)."""
    if group_norm_op.group_norm_target(x, num_groups, weight, bias) is None:
        return False, "the kernels do not take this call"
    if target_for(x.device).interpreter:
        return True, "interpreter"
    if costs.group_norm_pays(x.numel(), x.shape[0] * num_groups):
        return True, "large enough to pay"
    return False, f"{x.numel()} elements: PyTorch's GroupNorm is faster at this size"


def build_group_norm(norm, key, x, activation, out, input_bias, roles, run_kernels, run_eager):
    """This GroupNorm call's result, its plan built and stored (under
    ``plans.building``): ``run_kernels()`` / ``run_eager()`` compute it either way."""
    foreign = pack.foreign_capture(x)  # (not kept: pack.graph_flag says why)
    if key[-2] and x.dtype in HALF_DTYPES:
        ok, why = False, "CUDA autocast computes GroupNorm in float32"
    else:
        ok, why = group_norm_decision(x, norm.num_groups, norm.weight, norm.bias, key[-1] or foreign)
    plan = NormPlan(ok, why)
    if not ok:
        store_plan(norm, key, plan, keep=not foreign)
        return run_eager()
    y, plan.program = recorded(run_kernels, roles)
    # Stored complete: another thread may replay it as soon as it is seen.
    store_plan(norm, key, plan, keep=not foreign)
    return y


def rms_norm_decision(x, weight, bias, activation, eager_only, graph) -> tuple:
    """(kernel?, why) for one RMS-norm call."""
    if eager_only:
        return False, "autograd or autocast: the module's own computation"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return False, "a bias that is not a tensor"
    if rms_norm_op.rms_norm_target(x, weight, bias) is None:
        return False, "the kernel does not take this call"
    target = target_for(x.device)
    if target.interpreter:
        return True, "interpreter"
    if costs.rms_norm_pays(x.numel(), x.element_size(), activation != "none", graph,
                           tables.packaged_table(target.arch).calibration):
        return True, "one pass against PyTorch's eight or more (costs.rms_norm_pays)"
    return False, "PyTorch's passes are predicted faster at this size"


def build_rms_norm(norm, key, x, params, activation, grad_or_cast, graph):
    """(plan, result or None) of an RMS-norm call: its plan built and
    stored; the result where the kernel ran (None: the caller runs the
    module's own computation)."""
    weight, bias, scale, eps, eps_added = params
    foreign = pack.foreign_capture(x)  # (not kept: pack.graph_flag says why)
    ok, why = rms_norm_decision(x, weight, bias, activation, grad_or_cast, graph or foreign)
    plan = NormPlan(ok, why)
    y = None
    if ok:
        try:
            y, plan.program = recorded(lambda: rms_norm_op.rms_norm(x, weight, bias, scale, eps, activation,
                                                                    eps_added=eps_added),
                                       (x, weight, bias))
        except kernel_errors() as e:
            plan.kernel, plan.why = False, kernel_failure(e)
    store_plan(norm, key, plan, keep=not foreign)
    return plan, y


__all__ = ["build", "decide_call", "spec_for_call", "direct_args", "bare_slot", "remember_bare", "build_conv3d",
           "decide_conv3d", "conv3d_table", "group_norm_decision", "build_group_norm", "rms_norm_decision",
           "build_rms_norm", "eager", "KERNEL", "CUDNN", "MODULE"]
