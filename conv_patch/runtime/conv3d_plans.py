"""The dispatch core's Conv3d entry: a call planned per signature like the
2-D convs, the kernel only for shapes the table measured faster (or the
same GEMM with its cached and padded frames traded), else the module's own
forward with the epilogue as PyTorch ops."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from conv_patch.routing import tables, costs
from conv_patch.runtime import pack
from conv_patch.ops import conv2d as conv_op
from conv_patch.ops import conv3d as conv3d_op
from conv_patch.ops.conv2d import kernel_errors, kernels
from conv_patch.activations import eager_epilogue
from conv_patch.routing.select import Route, RouteDecision
from conv_patch.runtime.plans import BUILD_LOCK, UNREGISTERED, kernel_failure, store_plan, tensor_sig


@dataclasses.dataclass(eq=False)
class Conv3dPlan:
    """A Conv3d call's plan: the kernel (kernels/conv3d.py, with ``config``
    its tiles); the cuDNN route (``conv3d.cudnn_conv3d``: PyTorch's conv3d
    with fewer copies than the module's own forward, the bias and epilogue
    as one pass on NDHWC); or the module's own forward, with the epilogue as
    PyTorch ops."""

    kernel: bool
    decision: RouteDecision
    spec: object
    target: Optional[object] = None
    config: Optional[dict] = None


def conv3d_table(m, target):
    """The table a Conv3d module's calls on ``target`` read: PatchConfig's,
    else the architecture's own."""
    table = m.__dict__.get("_cp_table") if m is not None else None
    return table if table is not None else tables.packaged_table(target.arch)


def conv3d_decide(spec, x, weight, bias, cache, residual, cast, table=None, epilogue=0, graph=False) -> tuple:
    """(decision, target, config) for one Conv3d call: the kernel where it
    can run and is known to pay, else PyTorch and why. On a GPU "known to
    pay" means the table's exact entry of the shape (``conv3d.exact``,
    measured against the cuDNN route) says so as called
    (``costs.conv3d_choice``; ``epilogue``: the eager ops the kernel would
    fuse); a shape the table does not have runs PyTorch."""
    problem = spec.problem()
    if problem is None:
        try:
            shape = conv3d_op.output_shape(x, weight, bias, cache, spec.stride, spec.pads, spec.dilation)
        except ValueError as e:
            problem = str(e)  # the module's own forward raises PyTorch's error, or computes
        else:
            conv_op.check_residual(residual, shape)
    if problem is None and cast:
        problem = "autocast: PyTorch's conv3d computes in autocast's dtype"
    if problem is not None:
        return RouteDecision(Route.FALLBACK, problem), None, None
    target = conv3d_op.target_for(x.device)
    table = table if table is not None else tables.packaged_table(target.arch)
    gate = conv3d_gate(target, table)
    if gate is not None:
        return gate, None, None
    target, why = conv3d_op.kernel_target(x, weight, bias, cache, residual, None)
    if target is None:
        return RouteDecision(Route.FALLBACK, why), None, None
    if target.interpreter:
        return RouteDecision(Route.CONV3D_IGEMM, "interpreter", tier="default"), target, None
    keys = tables.conv3d_call_keys(spec, x, cache)
    entry = next((e for e in map(table.conv3d_exact, keys) if e is not None), None)
    # From here the spec describes the call: where the kernel does not take
    # it, the cuDNN route computes it (on a GPU: what the module's own
    # forward computes, with fewer copies), and the reason says why.
    if entry is None:
        return RouteDecision(Route.CUDNN, f"conv3d {keys[0]} not measured on {target.arch}: PyTorch's conv3d "
                                          "(cuDNN)"), None, None
    if tables.route_of(entry) == "cudnn":
        return RouteDecision(Route.CUDNN, f"cuDNN measured faster ({entry['cudnn_ms']:.4g} ms vs "
                                          f"{entry['ours_ms']:.4g} ms)", tier="exact"), None, None
    route = tables.route_of(entry)
    if route == "tma":
        problem = kernels().conv3d_tma_problem(x, cache, None, spec.stride, target.interpreter)
        if problem:
            return RouteDecision(Route.CUDNN, f"the measured tma tile cannot take this call ({problem})",
                                 tier="exact"), None, None
    choice = costs.conv3d_choice(entry["ours_ms"], entry["cudnn_ms"], epilogue, graph,
                                 out_bytes=math.prod(shape) * x.element_size(), repack=route == "tma")
    if not choice.kernel:
        return RouteDecision(Route.CUDNN, choice.why, tier="exact"), None, None
    config = {k: v for k, v in entry.items() if k not in ("ours_ms", "cudnn_ms")}
    return (RouteDecision(Route.CONV3D_TMA if route == "tma" else Route.CONV3D_IGEMM, choice.why, tier="exact"),
            target, config)


def conv3d_gate(target, table) -> Optional[RouteDecision]:
    """PyTorch for every Conv3d call on ``target``, whatever the call, or
    None (the call is planned). The never-slower rule: on a GPU whose table
    has no measured conv3d entry nothing says the kernel beats cuDNN, so
    such a call needs no signature; under the interpreter the kernel runs
    (that is where it is tested)."""
    if target.interpreter and target.kernels:
        return None
    if target.kernels:
        if table.has_conv3d:
            return None
        return RouteDecision(Route.FALLBACK, f"no measured conv3d entries for {target.arch}: PyTorch's conv3d "
                                             "(cuDNN)")
    return RouteDecision(Route.FALLBACK, target.reason or "no kernels here")


def conv3d(m, x, eager_forward, cache=None, pads=None, residual=None, beta=1.0, activation="none",
           out_scale=1.0):
    """``out_scale * act(conv3d(cat([cache, x], 2)) + beta * residual)`` for a
    patched Conv3d ``m`` (``pads``: its (front, back) padding per axis for
    this call, default the module's own): one kernel where it can run and
    pays, else ``eager_forward()`` (the module's own computation of this
    call) and the epilogue as PyTorch ops. Planned per signature in
    ``m._cp_plans`` like the 2-D convs; a kernel that fails to build falls
    back here and the plan remembers it."""
    held = m.__dict__.get("_cp_gate")
    if held is None or held[0] != x.device:
        # Per device, kept with the plans (target_for costs microseconds).
        target = conv3d_op.target_for(x.device)
        held = m.__dict__["_cp_gate"] = (x.device, conv3d_gate(target, conv3d_table(m, target)))
    gate = held[1]
    if gate is not None:
        # Decided by the device alone: no signature to build.
        m.__dict__["_cp_last"] = gate
        return eager_epilogue(eager_forward(), residual, beta, activation, out_scale)
    params = m.__dict__["_parameters"]
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or "bias" not in params:
        m.__dict__["_cp_last"] = UNREGISTERED
        return eager_epilogue(eager_forward(), residual, beta, activation, out_scale)
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)
                                        or (cache is not None and cache.requires_grad)
                                        or (residual is not None and residual.requires_grad))
    kind = "cuda" if x.is_cuda else x.device.type
    cast = (x.is_cuda or torch.amp.is_autocast_available(kind)) and torch.is_autocast_enabled(kind)
    graph = pack.graph_flag(x)
    # (The module's attributes are not in the key: a wrapper's change of
    # them clears its plans.)
    key = ("conv3d", pads, x.shape, x.stride(), x.dtype, x.device, weight.data_ptr(),
           weight.shape, weight.dtype, None if bias is None else bias.data_ptr(), tensor_sig(cache),
           tensor_sig(residual), beta, activation, out_scale, grad, cast, graph)
    plans = m.__dict__.get("_cp_plans")
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        with BUILD_LOCK:
            foreign = pack.foreign_capture(x)  # (not kept: pack.graph_flag says why)
            spec = m.spec if pads is None else dataclasses.replace(m.spec, pads=pads)
            target = conv3d_op.target_for(x.device)
            decision, target, config = conv3d_decide(
                spec, x, weight, bias, cache, residual, cast, conv3d_table(m, target),
                costs.epilogue_ops(residual is not None, beta, activation, out_scale), graph or foreign)
            if decision.route is Route.CUDNN and grad:
                # (autograd: the module's own forward, whose backward PyTorch records as it always does)
                decision = RouteDecision(Route.FALLBACK, decision.reason, tier=decision.tier)
            plan = Conv3dPlan(target is not None, decision, spec, target, config)
            if plan.kernel:
                try:
                    y = _conv3d_kernel(plan, x, weight, bias, cache, residual, beta, activation, out_scale)
                except kernel_errors() as e:
                    plan = Conv3dPlan(False, RouteDecision(Route.FALLBACK, kernel_failure(e, stacklevel=4)), spec)
                else:
                    store_plan(m, key, plan, keep=not foreign)
                    m.__dict__["_cp_last"] = plan.decision
                    return y
            store_plan(m, key, plan, keep=not foreign)
    m.__dict__["_cp_last"] = plan.decision
    if plan.kernel:
        return _conv3d_kernel(plan, x, weight, bias, cache, residual, beta, activation, out_scale)
    if plan.decision.route is Route.CUDNN:
        s = plan.spec
        return conv3d_op.cudnn_conv3d(x, weight, bias, cache, s.pads, s.stride, s.dilation, residual=residual,
                                      beta=beta, activation=activation, out_scale=out_scale)
    return eager_epilogue(eager_forward(), residual, beta, activation, out_scale)


def _conv3d_kernel(plan, x, weight, bias, cache, residual, beta, activation, out_scale):
    s = plan.spec
    return conv3d_op.run_kernel(x, weight.detach(), None if bias is None else bias.detach(), cache, s.pads,
                                s.stride, s.dilation, plan.target, residual=residual, beta=beta,
                                activation=activation, out_scale=out_scale, config=plan.config)
