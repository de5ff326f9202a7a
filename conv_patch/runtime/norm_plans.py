"""The dispatch core's norm entries: GroupNorm (+ activation, + the conv
bias it folds in) and the Wan family's RMS norm (+ activation), each one
pass of conv-patch's kernels where that pays, else the norm's own forward;
planned per signature in the norm module's ``_cp_plans``."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.routing import costs
from conv_patch.runtime import pack
from conv_patch.ops import group_norm as norm_op
from conv_patch.ops import rms_norm as rms_norm_op
from conv_patch.ops.conv2d import kernel_errors
from conv_patch.activations import eager_epilogue
from conv_patch.target import target_for
from conv_patch.runtime.plans import BUILD_LOCK, kernel_failure, recorded, store_plan, tensor_sig


def _gn_key(norm, x, activation, out, input_bias):
    w, b = norm.weight, norm.bias
    grad = torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad))
    cuda = x.is_cuda  # (device.type costs more than the whole flag)
    # CUDA autocast runs group_norm in float32 (its fp32 list): the plan of a
    # half-precision input under it is PyTorch's own (see group_norm).
    cast = cuda and torch.is_autocast_enabled("cuda")
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, activation, tensor_sig(out),
            out is not None and out is x, tensor_sig(input_bias),
            None if w is None else (w.data_ptr(), w.dtype, w.device), None if b is None else (b.data_ptr(), b.dtype),
            norm.num_groups, norm.eps, grad, cast, pack.graph_flag(x))


@dataclasses.dataclass(eq=False)
class NormPlan:
    """A GroupNorm call's plan: the kernels (``program``: their recorded
    launches) or PyTorch's own GroupNorm and activation."""

    kernel: bool
    why: str
    program: Optional[object] = None


def group_norm_decision(x, num_groups, weight, bias, graph) -> tuple:
    """(kernels?, why) for one GroupNorm call (``costs.group_norm_pays``)."""
    if norm_op.group_norm_target(x, num_groups, weight, bias) is None:
        return False, "the kernels do not take this call"
    if target_for(x.device).interpreter:
        return True, "interpreter"
    if costs.group_norm_pays(x.numel()):
        return True, "large enough to pay"
    return False, f"{x.numel()} elements: PyTorch's GroupNorm is faster at this size"


def group_norm(norm, x, activation="none", out=None, input_bias=None):
    """``act(norm(x + input_bias))`` into ``out`` when given (may be ``x``),
    for a GroupNorm module whose forward is the torch one's: planned per
    signature like the convs (kept in the norm's ``_cp_plans``). Under
    torch.compile tracing, the op's own expression (Inductor fuses it)."""
    if torch.compiler.is_compiling():
        return _gn_kernel(norm, x, activation, out, input_bias)
    key = _gn_key(norm, x, activation, out, input_bias)
    plans = norm.__dict__.get("_cp_plans")
    plan = plans.get(key) if plans is not None else None
    roles = (x, out, norm.weight, norm.bias, input_bias)
    if plan is not None:
        if plan.kernel and plan.program is not None:
            return plan.program(roles)
    else:
        with BUILD_LOCK:
            plans = norm.__dict__.get("_cp_plans")
            plan = plans.get(key) if plans is not None else None
            if plan is None:
                return _gn_build(norm, key, x, activation, out, input_bias, roles)
    if plan.kernel:
        return _gn_kernel(norm, x, activation, out, input_bias)
    return group_norm_eager(norm, x, activation, out, input_bias)


def _gn_build(norm, key, x, activation, out, input_bias, roles):
    """This call's result, its plan built and stored (under BUILD_LOCK)."""
    foreign = pack.foreign_capture(x)  # (not kept: pack.graph_flag says why)
    if key[-2] and x.dtype in (torch.float16, torch.bfloat16):
        ok, why = False, "CUDA autocast computes GroupNorm in float32"
    else:
        ok, why = group_norm_decision(x, norm.num_groups, norm.weight, norm.bias, key[-1] or foreign)
    plan = NormPlan(ok, why)
    if not ok:
        store_plan(norm, key, plan, keep=not foreign)
        return group_norm_eager(norm, x, activation, out, input_bias)
    y, plan.program = recorded(lambda: _gn_kernel(norm, x, activation, out, input_bias), roles)
    # Stored complete: another thread may replay it as soon as it is seen.
    store_plan(norm, key, plan, keep=not foreign)
    return y


def _gn_kernel(norm, x, activation, out, input_bias):
    return norm_op.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, activation, out=out,
                             input_bias=input_bias)


def group_norm_eager(norm, x, activation="none", out=None, input_bias=None):
    """The norm's own forward and the activation as PyTorch ops."""
    if input_bias is not None:
        x = x + input_bias.view(-1, *([1] * (x.dim() - 2)))
    y = eager_epilogue(own_group_norm(norm, x), None, 1.0, activation, 1.0)
    return y if out is None else out.copy_(y)


_TORCH_GROUP_NORM = torch.nn.GroupNorm.forward


def own_group_norm(norm, x):
    """``norm``'s own forward on ``x``. Where that is ``nn.GroupNorm``'s, its
    one line, ``F.group_norm``, with the parameters read from the module's
    dictionaries: the small GroupNorms of a UNet run here at every call,
    and each ``norm.weight`` goes through ``nn.Module.__getattr__``."""
    cls = getattr(type(norm), "_cp_base", type(norm))
    d = norm.__dict__
    params = d["_parameters"]
    if cls.forward is not _TORCH_GROUP_NORM or "weight" not in params or "bias" not in params:
        return cls.forward(norm, x)  # (a parametrized weight is no registered Parameter)
    return F.group_norm(x, d["num_groups"], params["weight"], params["bias"], d["eps"])


# -- RMS norm ------------------------------------------------------------------------
def rms_norm(norm, x, params, eager_forward, activation="none"):
    """``act(norm(x))`` for an RMS-norm module over channels (the Wan-family
    VAEs'): ``params`` its (weight, bias, scale, eps) as the recipe read
    them, ``eager_forward()`` the module's own computation of this call.
    One pass of the kernel where it takes the call and pays
    (``costs.rms_norm_pays``), else ``eager_forward()`` and the activation
    as PyTorch ops; planned per signature in the norm's ``_cp_plans``; a
    kernel that fails to build falls back here and the plan remembers it."""
    weight, bias, scale, eps = params
    if torch.compiler.is_compiling():
        return eager_epilogue(eager_forward(), None, 1.0, activation, 1.0)
    cuda = x.is_cuda
    grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                        or (isinstance(bias, torch.Tensor) and bias.requires_grad))
    cast = cuda and torch.is_autocast_enabled("cuda")
    # (The pointer's alignment too: a replayed launch is the kernel compiled
    # for the first call's, which Triton specialises on 16-byte alignment.)
    key = ("rms", x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, activation,
           None if weight is None else (weight.data_ptr(), weight.dtype),
           None if bias is None else (bias.data_ptr(), bias.dtype), scale, eps, grad, cast,
           pack.graph_flag(x))
    plans = norm.__dict__.get("_cp_plans")
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        with BUILD_LOCK:
            foreign = pack.foreign_capture(x)  # (not kept: pack.graph_flag says why)
            ok, why = rms_norm_decision(x, weight, bias, activation, grad or cast, key[-1] or foreign)
            plan = NormPlan(ok, why)
            if ok:
                try:
                    y, plan.program = recorded(lambda: rms_norm_op.rms_norm(x, weight, bias, scale, eps, activation),
                                               (x, weight, bias))
                except kernel_errors() as e:
                    plan.kernel, plan.why = False, kernel_failure(e)
                else:
                    store_plan(norm, key, plan, keep=not foreign)
                    norm.__dict__["_cp_norm_plan"] = plan
                    return y
            store_plan(norm, key, plan, keep=not foreign)
    norm.__dict__["_cp_norm_plan"] = plan
    if not plan.kernel:
        return eager_epilogue(eager_forward(), None, 1.0, activation, 1.0)
    if plan.program is not None:
        return plan.program((x, weight, bias))
    return rms_norm_op.rms_norm(x, weight, bias, scale, eps, activation)


def rms_norm_decision(x, weight, bias, activation, eager_only, graph) -> tuple:
    """(kernel?, why) for one RMS-norm call."""
    if eager_only:
        return False, "autograd or autocast: the module's own computation"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return False, "a bias that is not a tensor"
    if rms_norm_op.rms_norm_target(x, weight, bias) is None:
        return False, "the kernel does not take this call"
    if target_for(x.device).interpreter:
        return True, "interpreter"
    if costs.rms_norm_pays(x.numel(), x.element_size(), activation != "none", graph):
        return True, "one pass against PyTorch's eight or more (costs.rms_norm_pays)"
    return False, "PyTorch's passes are predicted faster at this size"
