"""The one dispatch entry: every patched convolution call (a wrapper's
forward, a recipe's fused step, ``forward_without_bias``, the torch.compile
op, the folded upsample), every planned norm call and a recipe's grouped
conv run here.

A call is one ``Call`` object. Its *signature* (``plans.conv_key``: the
tensors' shapes, strides, dtypes, devices and alignment, the weight's
identity, the epilogue, aliasing between the arguments, autograd, autocast
and whether conv-patch's own CUDA-graph path is on) selects a cached plan in
the module's state. A miss builds one (``planner``: routed by
``routing.decide``, its kernel launches recorded); a hit is one dictionary
lookup and ``plan.run``: the pack refresh and a replay of the recorded
launches, the cuDNN route, or the original module's forward. A planned
PyTorch-route call whose conv is exactly ``F.conv2d`` is cheaper still: the
bare fast path below.
"""

from __future__ import annotations

from typing import Optional

import torch

from conv_patch.activations import eager_epilogue
from conv_patch.buffers import persistent
from conv_patch.call import Call
from conv_patch.ops import conv2d as conv2d_op
from conv_patch.ops import group_norm as group_norm_op
from conv_patch.ops import grouped_conv as grouped_conv_op
from conv_patch.ops import rms_norm as rms_norm_op
from conv_patch.ops.epilogue import check_residual
from conv_patch.ops.subpixel import PARITIES, parity_padding, parity_view, parity_weight, subpixel_weights
from conv_patch.routing import costs
from conv_patch.routing.decide import decide
from conv_patch.runtime import pack, passthrough, planner
from conv_patch.runtime.plans import UNREGISTERED, KernelSlot, building, conv_key, cudnn_weight, eager, tensor_sig
from conv_patch.runtime.state import STATE, State, peek, state_of
from conv_patch.specs import ConvSpec
from conv_patch.target import target_for

_conv2d = torch.nn.functional.conv2d


# -- 2-D convs -------------------------------------------------------------------
def conv(m, call: Call):
    """``out_scale * act(m(x) + beta * residual)`` for a patched conv ``m``
    (into ``out`` when given); the call's ``padding`` (F.pad order) replaces
    the module's (for an unpadded conv: an F.pad folded in front; for a band
    of an image: zero rows only on the image-edge sides); with ``no_bias``
    the pair ``(y, b)`` with ``y + b`` the result (b None where the bias is
    already in ``y``)."""
    params = m.__dict__["_parameters"]
    try:
        weight, bias = params["weight"], params["bias"]
    except KeyError:
        # Not registered Parameters any more (a parametrization such as
        # weight_norm, or a buffer): the module's own forward computes from
        # whatever ``m.weight`` is now, as apply() leaves such convs alone.
        state_of(m).last = UNREGISTERED
        return eager(m, call, call.padding)
    return conv_with(m, weight, bias, call)


def conv_with(m, weight, bias, call: Call):
    """``conv`` with the weight and bias given: ``m`` holds the plans and the
    pack (a patched conv, or a ``CallSite``)."""
    st = m.__dict__.get(STATE) or state_of(m)
    key = conv_key(call, weight, bias)
    plans = st.plans
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan, y = planner.build(m, key, call, weight, bias)
    elif plan.bare:
        # The cheapest PyTorch route, without even run()'s frame.
        x = call.x
        y = _conv2d(x, cudnn_weight(m, x, weight) if plan.cl_pack else weight, bias, *plan.direct)
    else:
        y = plan.run(m, call, weight, bias)
    st.last = plan.decision
    return y


# -- the bare fast path ----------------------------------------------------------
# A plan of PyTorch's route whose conv is exactly ``F.conv2d`` (``direct``)
# followed by the epilogue as eager ops computes what the module and those
# ops compute from the module's current weight, bias and geometry, whatever
# the weight's identity, autograd or autocast. So such a call (no ``out``,
# no padding of its own) whose input was seen before needs none of the
# signature: ``planner.bare_slot`` (the input's geometry, dtype, device and
# alignment, the things that can turn PyTorch's route into a kernel's; the
# residual's layout, dtype and alignment, which decide whether a kernel
# could take it; the epilogue's constants) finds it, and the call costs no
# more host time than the module's own forward and the eager ops: a few
# frames, no ``Call`` and no attribute lookups through
# ``nn.Module.__getattr__``. A UNet's resnet convs (the time embedding and
# the shortcut in their epilogues) run on PyTorch this way. A recorded
# kernel plan of such a call is found here too (``plans.KernelSlot``, which
# checks what else its signature held) and replayed, without the ``Call``,
# the signature and four frames of the full path.
# Only plans made off the graph path are remembered, and a call on it
# (``pack.GRAPH_PATH``: conv-patch's own graph warm-up and capture) does not
# look here: there a launch costs GPU time only and the kernels may win. A
# CUDA graph the caller captures records what this path runs, PyTorch's
# ops, as the unpatched model would: asking CUDA whether the stream is
# capturing would cost every eager call more than a microsecond. A full
# plan cache and ``clear`` drop these with the plans.
def bare_call(m, x, activation="none", residual=None, beta=1.0, out_scale=1.0):
    """``out_scale * act(m(x) + beta * residual)`` by the plan found for
    this call's slot (``planner.bare_slot``), else None (the caller builds a
    ``Call`` for ``conv``). Not while torch.compile traces (a traced call is
    the compiled op's) nor for ComfyUI's classes (the caller checks)."""
    if torch.compiler.is_compiling():
        # First: a traced read of the module's state would add guards on it
        # to every call of the compiled graph.
        return None
    st = m.__dict__.get(STATE)
    bare = None if st is None else st.bare
    if bare is None or pack.GRAPH_PATH:
        return None
    res = None if residual is None else (residual.stride(), residual.dtype, residual.data_ptr() & 15)
    hit = bare.get((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, activation, res, beta, out_scale))
    if hit is None:
        return None
    if type(hit) is KernelSlot:
        return hit.run(m, x, activation, residual)
    params = m.__dict__["_parameters"]
    weight = params.get("weight")
    if weight is None:  # parametrized since (see conv): its own forward computes
        return None
    st.last = hit[1]
    if hit[3] and pack.ACTIVE.group is not None and not (weight.requires_grad and torch.is_grad_enabled()):
        # (The slot holds for any autograd state; the pack only without it.)
        weight = cudnn_weight(m, x, weight)
    y = _conv2d(x, weight, params.get("bias"), *hit[0])
    if residual is None and out_scale == 1.0:
        return y if hit[2] is None else hit[2](y)
    if residual is not None and residual.shape != y.shape:  # the kernels' refusal, without a call
        check_residual(residual, y.shape)
    return eager_epilogue(y, residual, beta, activation, out_scale)


# -- call sites: convs without a patched module ------------------------------------
class CallSite:
    """The plans and the weight pack of a conv call made without a patched
    module (the torch.compile custom op, the folded upsample's 2x2 convs):
    one per geometry and weight, found by ``call_site``, so those calls are
    planned, weighed against PyTorch and replayed like a wrapper's. Its
    PyTorch route is ``ConvSpec.torch_forward`` with the call's weight and
    bias (the call's ``fallback_args``)."""

    def __init__(self, spec: ConvSpec):
        self.spec = spec
        self.cp_torch_class = torch.nn.ConvTranspose2d if spec.transposed else torch.nn.Conv2d
        self.__dict__[STATE] = State()

    def cp_forward(self, x, weight, bias):
        return self.spec.torch_forward(x, weight, bias)


# Call sites kept (a process compiling many models starts over past this).
MAX_SITES = 1024
_SITES: dict = {}


def call_site(spec, weight, bias, geometry: Optional[tuple] = None) -> CallSite:
    """The ``CallSite`` of ``spec`` with this weight and bias (by storage: a
    weight edited in place keeps its site, and its pack is refreshed from it
    at every call as a wrapper's is). ``geometry``: a tuple of plain values
    that determines the spec with the weight's shape (a compiled op's own
    arguments), found without hashing a ``ConvSpec``; ``spec`` is then a
    function making it, called for a new site only."""
    key = (spec if geometry is None else geometry, weight.data_ptr(), weight.shape, weight.device, weight.dtype,
           None if bias is None else bias.data_ptr())
    return _site(key, lambda: CallSite(spec if geometry is None else spec()))


def _site(key, make):
    """The site kept under ``key``, made by ``make()`` where there is none
    (a full table starts over)."""
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) >= MAX_SITES:
            _SITES.clear()
        site = _SITES[key] = make()
    return site


def forget(modules) -> None:
    """Forget everything calls built or learned on ``modules`` and on every
    call site and norm site (``State.forget``, the modules' graph caches and
    learned passthrough signatures): the next call plans afresh, as a first
    call. For a pass whose launches compiled and ran nothing
    (``kernels.launch.compile_ahead``): its plans replay no launches."""
    for m in modules:
        st = peek(m)
        if st is None:
            continue
        st.forget()
        if st.graphs is not None:
            st.graphs.clear()
        if st.passthrough is not None:
            st.passthrough.plans.clear()
    _SITES.clear()
    passthrough.changed()


def sites() -> dict:
    """The call sites and norm sites made so far (a copy: key -> site)."""
    return dict(_SITES)


def clear(m) -> None:
    """Drop ``m``'s plans (its attributes or parameters changed), and what
    the models learned about passing their parts through."""
    passthrough.changed()
    state_of(m).clear()


class NormSite:
    """The plans of a GroupNorm call made without its module (the
    torch.compile op): one per group count, eps, weight and bias (by
    storage, like ``CallSite``, in the same bounded table), which it holds
    (a weight edited in place is read as it is at each call)."""

    def __init__(self, num_groups: int, weight, bias, eps: float):
        self.num_groups, self.weight, self.bias, self.eps = num_groups, weight, bias, eps
        self.__dict__[STATE] = State()

    def forward(self, x):
        return torch.nn.functional.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def norm_site(num_groups: int, weight, bias, eps: float) -> NormSite:
    """The ``NormSite`` of these parameters."""
    key = ("group_norm", num_groups, eps, None if weight is None else (weight.data_ptr(), weight.device, weight.dtype),
           None if bias is None else (bias.data_ptr(), bias.dtype))
    return _site(key, lambda: NormSite(num_groups, weight, bias, eps))


# -- the folded upsample -------------------------------------------------------------
def subpixel_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the folded upsample (``upsample_conv``) is worth its four
    launches for input ``x`` and 3x3 ``weight`` (``costs.subpixel_pays``;
    always under the interpreter, where the tests exercise it, and while a
    CUDA graph is captured or its warm-up runs, ``pack.on_graph_path``: a
    replay costs no host time per launch)."""
    if target_for(x.device).interpreter:
        return True
    n, _, h, w = x.shape
    # (The size first: the graph question asks CUDA.)
    return costs.subpixel_pays(n * h * w * weight.shape[0] * weight.shape[1]) or pack.on_graph_path(x)


def upsample_conv(m, x, residual=None, activation="none"):
    """``act(m(F.interpolate(x, scale_factor=2, mode="nearest")) + residual)``
    for patched 3x3, padding-1 conv ``m``, as the four 2x2 convs of ``x``
    that ``functional.upsample_conv2d`` describes, each through ``conv_with``
    on a call site of its own (planned, weighed against PyTorch, replayed),
    into the parity-strided views of one output. The folded weights live in
    a buffer kept in ``m``'s state and are folded again from ``m``'s weight
    at every call (one launch), as packs are refreshed (pack.py says why).
    None where the call is not this one (a weight that is no registered
    Parameter any more, or no 3x3 over the input's channels): the caller
    runs the upsample and the conv."""
    params = m.__dict__["_parameters"]
    weight = params.get("weight")
    if weight is None or "bias" not in params or tuple(weight.shape) != (weight.shape[0], x.shape[1], 3, 3):
        return None
    return upsample_conv_with(m, weight, params["bias"], x, residual, activation)


def upsample_conv_with(m, weight, bias, x, residual=None, activation="none"):
    """``upsample_conv`` with the 3x3 weight and bias given: ``m`` (a
    patched conv, or a ``CallSite``) holds the folded weights and the four
    parities' call sites."""
    n, c_in, h, w = x.shape
    c_out = weight.shape[0]
    shape = (n, c_out, 2 * h, 2 * w)
    check_residual(residual, shape)
    key = (weight.shape, weight.dtype, weight.device, bias is not None)
    st = state_of(m)
    held = st.subpixel
    if held is None or held[0] != key:
        # The buffer, and per parity its 2x2 weight (a view of the buffer)
        # and call site: the same from call to call while the buffer is.
        subs = persistent(torch.empty, (2, 2, c_out, 2, 2, c_in), dtype=weight.dtype, device=weight.device)
        spec = ConvSpec(False, c_in, c_out, (2, 2), (1, 1), (1, 1), (0, 0), (0, 0), (0, 0), 1, "zeros",
                        bias is not None)
        parities = [(a, b, parity_weight(subs, a, b)) for a, b in PARITIES]
        parities = [(a, b, w_ab, call_site(spec, w_ab, bias)) for a, b, w_ab in parities]
        held = st.subpixel = (key, subs, parities)
    subpixel_weights(weight, out=held[1])
    out = torch.empty(shape, dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last if conv2d_op.nhwc(x) else torch.contiguous_format)
    for a, b, w_ab, site in held[2]:
        conv_with(site, w_ab, bias, Call(x, None if residual is None else parity_view(residual, a, b),
                                         activation=activation, out=parity_view(out, a, b),
                                         padding=parity_padding(a, b), fallback_args=(w_ab, bias)))
    return out


# -- Conv3d ------------------------------------------------------------------------
def conv3d(m, call: Call):
    """``out_scale * act(conv3d(cat([cache, x], 2)) + beta * residual)`` for
    a patched Conv3d ``m`` (``call.pads``: its (front, back) padding per
    axis for this call, default the module's own; ``call.own()`` the
    module's own computation of it): one kernel where it can run and pays,
    else the cuDNN route or ``own()``, and the epilogue as PyTorch ops.
    Planned per signature like the 2-D convs."""
    st = state_of(m)
    x = call.x
    held = st.gate
    if held is None or held[0] != x.device:
        # Per device, kept with the plans (target_for costs microseconds).
        target = target_for(x.device)
        held = st.gate = (x.device, decide(m.spec, None, target, planner.conv3d_table(m, target)))
    gate = held[1]
    if not gate.is_kernel:
        # Decided by the device alone: no signature to build.
        st.last = gate
        return eager_epilogue(call.own(), call.residual, call.beta, call.activation, call.out_scale)
    params = m.__dict__["_parameters"]
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or "bias" not in params:
        st.last = UNREGISTERED
        return eager_epilogue(call.own(), call.residual, call.beta, call.activation, call.out_scale)
    cache, residual = call.cache, call.residual
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)
                                        or (cache is not None and cache.requires_grad)
                                        or (residual is not None and residual.requires_grad))
    kind = "cuda" if x.is_cuda else x.device.type
    cast = (x.is_cuda or torch.amp.is_autocast_available(kind)) and torch.is_autocast_enabled(kind)
    graph = pack.graph_flag(x)
    # (The module's attributes are not in the key: a wrapper's change of
    # them clears its plans.)
    key = ("conv3d", call.pads, x.shape, x.stride(), x.dtype, x.device, weight.data_ptr(),
           weight.shape, weight.dtype, None if bias is None else bias.data_ptr(), tensor_sig(cache),
           tensor_sig(residual), call.beta, call.activation, call.out_scale, grad, cast, graph)
    plans = st.plans
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan, y = planner.build_conv3d(m, key, call, weight, bias, cast, graph)
    else:
        y = plan.run(m, call, weight, bias)
    st.last = plan.decision
    return y


# -- grouped convs ----------------------------------------------------------------
def grouped_conv(m, x):
    """``m(x)`` for a grouped conv ``apply`` leaves as it is (an
    ``nn.Conv2d`` of groups > 1): one launch of conv-patch's grouped-conv
    kernels where ``ops.grouped_conv`` takes the call (a grouped 1x1 or a
    large depthwise conv, channels-last, no autograd), else the module's own
    call. Hooks are the caller's business."""
    if grouped_conv_op.problem(m, x) is None:
        return grouped_conv_op.grouped_conv(m, x)
    return m(x)


# -- GroupNorm ---------------------------------------------------------------------
def _gn_key(norm, x, activation, out, input_bias, modulation):
    w, b = norm.weight, norm.bias
    grad = torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad))
    cuda = x.is_cuda  # (device.type costs more than the whole flag)
    # CUDA autocast runs group_norm in float32 (its fp32 list): the plan of a
    # half-precision input under it is PyTorch's own (see group_norm).
    cast = cuda and torch.is_autocast_enabled("cuda")
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, activation, tensor_sig(out),
            out is not None and out is x, tensor_sig(input_bias),
            None if w is None else (w.data_ptr(), w.dtype, w.device), None if b is None else (b.data_ptr(), b.dtype),
            norm.num_groups, norm.eps,
            None if modulation is None else (tensor_sig(modulation[0]), tensor_sig(modulation[1])),
            grad, cast, pack.graph_flag(x))


def group_norm(norm, x, activation="none", out=None, input_bias=None, modulation=None):
    """``act(norm(x + input_bias) * m + a)`` (``modulation`` (m, a), else
    ``act(norm(x + input_bias))``) into ``out`` when given (may be ``x``),
    for a GroupNorm module whose forward is the torch one's, or a
    ``NormSite``: planned per signature like the convs (kept in the norm's
    state). Under torch.compile tracing the op's own expression (Inductor
    fuses it; ``compiled.traced_group_norm`` is the op where the kernels
    would take the call)."""
    def run_kernels():
        return group_norm_op.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, activation,
                                        out=out, input_bias=input_bias, modulation=modulation)
    if torch.compiler.is_compiling():
        return run_kernels()  # (traced: group_norm_target is None, the expression)
    key = _gn_key(norm, x, activation, out, input_bias, modulation)
    st = state_of(norm)
    plan = st.plans.get(key) if st.plans is not None else None
    roles = (x, out, norm.weight, norm.bias, input_bias) + (() if modulation is None else tuple(modulation))
    if plan is not None:
        if plan.kernel and plan.program is not None:
            return plan.program(roles)
    else:
        with building(x, lambda: f"GroupNorm({norm.num_groups}, {norm.num_channels}) on {tuple(x.shape)}"):
            plan = st.plans.get(key) if st.plans is not None else None
            if plan is None:
                return planner.build_group_norm(
                    norm, key, x, activation, out, input_bias, roles, run_kernels,
                    lambda: group_norm_eager(norm, x, activation, out, input_bias, modulation))
    if plan.kernel:
        return run_kernels()
    return group_norm_eager(norm, x, activation, out, input_bias, modulation)


def group_norm_eager(norm, x, activation="none", out=None, input_bias=None, modulation=None):
    """The norm's own forward, the modulation and the activation as PyTorch ops."""
    if input_bias is not None:
        x = x + input_bias.view(-1, *([1] * (x.dim() - 2)))
    y = eager_epilogue(group_norm_op.modulated(own_group_norm(norm, x), modulation), None, 1.0, activation, 1.0)
    return y if out is None else out.copy_(y)


_TORCH_GROUP_NORM = torch.nn.GroupNorm.forward


def own_group_norm(norm, x):
    """``norm``'s own forward on ``x``. Where that is ``nn.GroupNorm``'s, its
    one line, ``F.group_norm``, with the parameters read from the module's
    dictionaries: the small GroupNorms of a UNet run here at every call,
    and each ``norm.weight`` goes through ``nn.Module.__getattr__``."""
    cls = getattr(type(norm), "cp_base", type(norm))
    if cls.forward is not _TORCH_GROUP_NORM:
        return cls.forward(norm, x)  # (a subclass's, or a ``NormSite``'s)
    d = norm.__dict__
    params = d["_parameters"]
    if "weight" not in params or "bias" not in params:
        return cls.forward(norm, x)  # (a parametrized weight is no registered Parameter)
    return torch.nn.functional.group_norm(x, d["num_groups"], params["weight"], params["bias"], d["eps"])


# -- RMS norm ------------------------------------------------------------------------
def rms_norm(norm, x, params, eager_forward, activation="none"):
    """``act(norm(x))`` for an RMS-norm module over channels (the Wan-family
    VAEs', LTX-Video's): ``params`` its (weight, bias, scale, eps,
    eps_added) as the recipe read them (``ops.rms_norm.rms_norm``),
    ``eager_forward()`` the module's own computation of this call.
    One pass of the kernel where it takes the call and pays
    (``costs.rms_norm_pays``), else ``eager_forward()`` and the activation
    as PyTorch ops; planned per signature in the norm's state; a kernel that
    fails to build falls back here and the plan remembers it."""
    weight, bias, scale, eps, eps_added = params
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
           None if bias is None else (bias.data_ptr(), bias.dtype), scale, eps, eps_added, grad, cast,
           pack.graph_flag(x))
    st = state_of(norm)
    plan = st.plans.get(key) if st.plans is not None else None
    if plan is None:
        with building(x, lambda: f"{type(norm).__name__} on {tuple(x.shape)}"):
            plan, y = planner.build_rms_norm(norm, key, x, params, activation, grad or cast, key[-1])
        st.norm_plan = plan
        if y is not None:
            return y
    st.norm_plan = plan
    if not plan.kernel:
        return eager_epilogue(eager_forward(), None, 1.0, activation, 1.0)
    if plan.program is not None:
        return plan.program((x, weight, bias))
    return rms_norm_op.rms_norm(x, weight, bias, scale, eps, activation, eps_added=eps_added)
