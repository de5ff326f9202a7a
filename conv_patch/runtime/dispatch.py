"""The one dispatch entry: every patched convolution call, from a wrapper's
forward, a recipe's fused step or ``forward_without_bias``, runs here.

A call's *signature* (``conv_key``: the tensors' shapes, strides, dtypes,
devices and alignment, the weight's identity, the epilogue, aliasing between
the arguments, autograd and whether conv-patch's own CUDA-graph path is on) selects a
cached ``ConvPlan``. Building the plan is the slow, tested part: route the
call (``routing.select_route``), weigh the route against PyTorch as called
(``costs.choose``), launch the kernels once while recording the launches
(``kernels.recording``). Later calls with the same signature are one
dictionary lookup, the pack refresh and a replay of the recorded launches
(``kernels.Program``), or the original module's forward where PyTorch is
the faster route. A kernel that fails to build or launch here falls back in
this one place, for every caller, and the plan remembers it.

Here the 2-D convs (plans, the bare fast path, call sites, the folded
upsample); ``conv3d_plans`` the Conv3d entry, ``norm_plans`` the GroupNorm
and RMS-norm entries, ``plans`` what they all share (failure reports, plan
storage, the build lock, recorded launches). Callers reach every entry here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from conv_patch.routing import tables, costs
from conv_patch.runtime import pack, passthrough
from conv_patch.ops import conv2d as conv_op
from conv_patch.ops.conv2d import kernel_errors
from conv_patch.activations import ACTIVATIONS, eager_epilogue
from conv_patch.routing.select import Route, RouteDecision, select_route
from conv_patch.specs import CallDesc, ConvSpec, resolve_padding
from conv_patch.ops.subpixel import PARITIES, parity_padding, parity_view, parity_weight, subpixel_weights
from conv_patch.target import gpu_sms, target_for
# Every entry is reached as ``dispatch.<name>``, the Conv3d and norm ones too:
# the one place callers (wrappers, recipes, benchmarks) look.
from conv_patch.runtime.conv3d_plans import Conv3dPlan, conv3d, conv3d_decide, conv3d_gate, conv3d_table  # noqa: F401
from conv_patch.runtime.norm_plans import (NormPlan, group_norm, group_norm_decision, group_norm_eager,  # noqa: F401
                                           own_group_norm, rms_norm, rms_norm_decision)
from conv_patch.runtime.plans import (BUILD_LOCK, MAX_PLANS, UNREGISTERED, KernelFailureWarning, kernel_failure,  # noqa: F401
                                      recorded, store_plan, tensor_sig)


# Plan kinds.
KERNEL, CUDNN, MODULE = "kernel", "cudnn", "module"
# The lean route (a decision's ``tier``): the portable kernel reading the
# input and the weight in place, one launch and nothing else, for calls whose
# GPU work is smaller than the host time around it (costs.choose_lean).
LEAN = "lean"
LEAN_CONFIG = {"route": "igemm", "BLOCK_M": costs.LEAN_TILE[0], "BLOCK_N": costs.LEAN_TILE[1],
               "BLOCK_K": costs.LEAN_TILE[2], "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def conv_key(x, weight, bias, residual, out, beta, activation, out_scale, output_padding, padding, no_bias):
    """Everything a plan depends on besides the module's attributes (a change
    of those clears the module's plans)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)
                                        or (residual is not None and residual.requires_grad))
    device = x.device
    cuda = x.is_cuda  # (device.type costs more than the whole flag)
    graph = cuda and pack.GRAPH_PATH  # (pack.graph_flag, without its call)
    # The dtype torch.autocast casts the convolution to (None: autocast is
    # off for this device type), read here once so that the plan, not every
    # call, decides what that cast means (AutocastPlan).
    kind = "cuda" if cuda else device.type
    # (A meta tensor, shapes only, has no autocast to ask about.)
    cast = None
    if (cuda or torch.amp.is_autocast_available(kind)) and torch.is_autocast_enabled(kind):
        cast = torch.get_autocast_dtype(kind)
    alias = None
    if residual is not None or out is not None:
        alias = (residual is x, out is x, out is not None and out is residual)
    # A weight or bias replaced, moved, re-typed or re-laid-out gets a new
    # storage address; with the shape that identifies it (an in-place edit
    # keeps both, and the pack is refreshed from it at every call).
    # build() reads the last two entries: the autocast dtype and the graph flag.
    return (x.shape, x.stride(), x.dtype, device, x.data_ptr() & 15, weight.data_ptr(), weight.shape,
            None if bias is None else bias.data_ptr(), tensor_sig(residual), tensor_sig(out), alias, beta,
            activation, out_scale, output_padding, padding, no_bias, grad, cast, graph)


@dataclasses.dataclass(eq=False)
class ConvPlan:
    """How calls of one signature run. ``decision`` is what the report and
    ``repr`` show; ``program`` the recorded launches (None: call the
    launchers each time)."""

    kind: str
    decision: RouteDecision
    spec: ConvSpec
    program: Optional[object] = None
    pack_entry: Optional[object] = None
    graph: bool = False
    # (stride, padding, dilation, groups) where the module's own forward is
    # exactly ``F.conv2d`` with them: the MODULE plan calls it directly.
    direct: Optional[tuple] = None
    # A folded F.pad (F.pad order) the MODULE plan applies before the module.
    padding: Optional[tuple] = None
    # The KERNEL plan's output format: PyTorch's for the input and the
    # caller's weight (the kernels read a pack whose layout must not count).
    memory_format: Optional[torch.memory_format] = None
    # A MODULE plan whose whole call is ``F.conv2d(x, weight, bias, *direct)``
    # (no epilogue, no ``out``): ``conv`` calls that itself.
    bare: bool = False
    # A ``direct`` call on an NHWC CUDA input, without autograd or autocast:
    # F.conv2d gets the weight's channels_last pack (``_cudnn_weight``).
    cl_pack: bool = False

    def run(self, m, x, weight, bias, residual, out, beta, activation, out_scale, output_padding,
            fallback_args, no_bias):
        if self.kind == KERNEL:
            w = self._weight(m, weight)
            b = None if no_bias else bias
            if self.program is not None:
                y = self.program((x, w, b, residual, out))
            else:
                y = _run_kernel(self, x, w, b, residual, out, beta, activation, out_scale, output_padding)
            return (y, bias) if no_bias else y
        if self.kind == CUDNN:
            y = conv_op.cudnn_conv2d(self.spec, x, _cudnn_weight(m, x, weight), None if no_bias else bias,
                                    residual=residual, beta=beta, activation=activation, out_scale=out_scale,
                                    out=out)
            return (y, bias) if no_bias else y
        y = None
        if self.direct is not None:
            y = _conv2d(x, _cudnn_weight(m, x, weight) if self.cl_pack else weight, bias, *self.direct)
        return eager(m, x, residual, beta, activation, out_scale, fallback_args, out, self.padding, no_bias, y)

    def _weight(self, m, weight):
        """The kernels' weight, read from ``weight`` during this call (see
        conv_patch/pack.py: a pack is rewritten at every call)."""
        entry = self.pack_entry
        if entry is None:
            # In the kernels' layout already, or read in place (the lean route).
            return pack.kernel_view(weight.detach(), self.spec.transposed)
        if self.graph or m.__dict__.get("_cp_pack") is not entry:
            return pack.packed_weight(m, weight, self.spec.transposed)
        # Kernel plans run without autograd, so the copy records nothing.
        transposed = self.spec.transposed
        return pack.refresh(m, entry, weight.transpose(0, 1) if transposed else weight, transposed)


def eager(m, x, residual, beta, activation, out_scale, fallback_args, out, padding, no_bias, y=None):
    """The call as PyTorch computes it: the original module's forward (after
    the folded ``F.pad`` where ``padding`` is given; ``y`` when the caller
    already has the module's output), then the epilogue as eager ops, into
    ``out`` when given. With ``no_bias`` the pair ``(y, None)``: the bias is
    in ``y``."""
    if y is None:
        if padding is not None:
            y = forward_with_padding(m, x, padding, lambda t: m._cp_fallback_forward(m, t, *fallback_args))
        else:
            y = m._cp_fallback_forward(m, x, *fallback_args)
    if no_bias:
        return y, None
    if residual is None and activation == "none" and out_scale == 1.0:
        return y if out is None else out.copy_(y)
    conv_op.check_residual(residual, y.shape)
    y = eager_epilogue(y, residual, beta, activation, out_scale)
    return y if out is None else out.copy_(y)


def forward_with_padding(m, x, padding, forward):
    """``forward`` (the conv ``m``'s own computation) on ``x`` with
    ``padding`` (F.pad order) in place of ``m``'s own padding, as the
    kernels compute a call's padding (``spec_for_call``): for a module
    without padding of its own, ``forward(F.pad(x, padding))``. A module
    that pads itself (a 3x3 conv computing one band of an image, with zero
    rows only on the image-edge sides) pads the F.pad'ed input again, and
    the output rows and columns that extra padding made are cut away."""
    x = torch.nn.functional.pad(x, tuple(int(v) for v in padding))
    if isinstance(m, torch.nn.Module):
        (pt, pl), (pb, pr) = resolve_padding(m.padding, tuple(m.kernel_size), tuple(m.dilation))
        (sh, sw), transposed = m.stride, getattr(m, "transposed", False)
    else:
        # A CallSite: its forward is its spec's (conv_patch.runtime.compiled, the folded upsample).
        (pt, pl), (pb, pr) = m.spec.pad_begin, m.spec.pad_end
        (sh, sw), transposed = m.spec.stride, m.spec.transposed
    if not (pt or pl or pb or pr):
        return forward(x)
    if pt % sh or pb % sh or pl % sw or pr % sw or transposed:
        raise ValueError(f"a call's own padding replaces {m}'s only where the stride divides that padding")
    y = forward(x)
    h, w = y.shape[-2:]
    return y[..., pt // sh:h - pb // sh, pl // sw:w - pr // sw]


def _cudnn_weight(m, x, weight):
    """The weight handed to cuDNN: for an NHWC input its channels_last pack
    (cuDNN would convert an NCHW weight itself at every call, a strided copy
    and an allocation of its own, where the pack is refreshed in place or,
    inside a fused block's call, not at all: conv_patch/pack.py); an NCHW
    input keeps the weight as it is, since a channels_last weight would make
    PyTorch return a channels_last output. Only for calls without autograd
    (the pack is no function of the weight for it): the callers check."""
    if x.dim() == 4 and x.is_cuda and conv_op.nhwc(x):
        return pack.packed_weight(m, weight, False)
    return weight


def _run_kernel(plan, x, w, bias, residual, out, beta, activation, out_scale, output_padding):
    return conv_op.run_kernel(plan.decision, target_for(x.device), plan.spec, x, w, bias, residual=residual,
                             beta=beta, activation=activation, out_scale=out_scale,
                             output_padding=output_padding, out=out, memory_format=plan.memory_format)


def spec_for_call(m, weight, padding) -> tuple:
    """(spec, problem): the module's spec, with a folded F.pad's padding
    (F.pad order) where given; problem is why the kernels must not take
    the module's call at all (its weight no longer matches its attributes:
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


def _launches(decision, spec, x) -> int:
    if decision.route is Route.CONV2D_TAPS:
        return 2
    if decision.route is Route.CONV2D_TMA and not conv_op.nhwc(x):
        return 2  # the NHWC staging copy, except where NCHW is read in place
    return 1


def weigh(decision: RouteDecision, spec: ConvSpec, x, weight, table, has_bias, residual, beta, activation,
          out_scale, graph: bool) -> RouteDecision:
    """``decision`` kept where it beats PyTorch as called (``costs.choose``),
    else the original module (or the table's cuDNN route with the fused
    epilogue, where that pays over eager ops)."""
    target = target_for(x.device)
    if target.interpreter or not (decision.is_kernel or decision.route is Route.CUDNN):
        return decision  # under the interpreter the kernels always run: that is how they are tested
    shape = tuple(x.shape) if x.dim() == 4 else (1,) + tuple(x.shape)
    oh, ow = spec.output_hw(shape[2], shape[3])
    layout = "nhwc" if conv_op.nhwc(x) else "nchw"
    p = costs.Problem.of(shape[0], spec.in_channels, shape[2], shape[3], spec.out_channels, spec.kernel[0],
                         spec.kernel[1], oh, ow, x.element_size(), layout)
    tbl = table if table is not None else tables.packaged_table(target.arch)
    exact = None
    if not spec.transposed:
        key = tables.shape_key(spec, shape, layout, x.dtype)
        exact = tbl.exact(key)
    ops = costs.epilogue_ops(residual is not None, beta, activation, out_scale)
    # PyTorch's own route: the original module, or cuDNN without the bias
    # and the fused epilogue as one pass (the table's cuDNN route), where
    # that one pass beats the eager ops and PyTorch's bias pass.
    fitted = costs.fit_of(tbl)
    fused = (x.is_cuda and not spec.transposed
             and costs.fused_epilogue_pays(p, ops, has_bias and layout == "nhwc", graph,
                                           gpu_conv=costs.gpu_times(p, fitted, exact)[0] or 0.0))
    if decision.route is Route.CUDNN:
        if fused:
            return decision
        return RouteDecision(Route.FALLBACK, decision.reason, config=decision.config, tier=decision.tier,
                             table=decision.table)
    if table is not None and exact is None:
        return decision  # a user's table without this shape measured: the user's choice
    sms = (gpu_sms(x.device.index if x.device.index is not None else torch.cuda.current_device()) if x.is_cuda
           else costs.DEFAULT_SMS)
    choice = costs.choose(p, fitted, exact, launches=_launches(decision, spec, x), ops=ops, graph=graph,
                          packed=not pack.is_kernel_layout(pack.kernel_view(weight, spec.transposed)),
                          descriptors=3 if decision.route is Route.CONV2D_TMA else 0, config=decision.config,
                          sms=sms)
    if not graph:
        lean = costs.choose_lean(p, fitted, exact, ops=ops, sms=sms)
        if lean.kernel and (not choice.kernel or lean.cost < choice.cost):
            route = Route.CONV_TRANSPOSE2D_IGEMM if spec.transposed else Route.CONV2D_IGEMM
            return RouteDecision(route, lean.why, config=LEAN_CONFIG, tier=LEAN, table=decision.table)
    if choice.kernel:
        return decision
    route = Route.CUDNN if fused else Route.FALLBACK
    return RouteDecision(route, choice.why, config=decision.config, tier=decision.tier, table=decision.table)


def decide(m, x, weight, bias, residual, beta, activation, out_scale, output_padding, padding, graph):
    """(decision, spec) for one call of patched conv ``m``: the router's
    route (``select_route``), weighed against PyTorch as called (``weigh``)."""
    spec, problem = spec_for_call(m, weight, padding)
    if problem:
        return RouteDecision(Route.FALLBACK, problem), spec
    call = CallDesc.of_call(x, weight, bias, residual, output_padding)
    table = m.__dict__.get("_cp_table")
    decision = select_route(spec, call, target_for(x.device), table)
    if decision.route is Route.CUDNN and spec.transposed:
        decision = RouteDecision(Route.FALLBACK, decision.reason)
    return weigh(decision, spec, x, weight, table, bias is not None, residual, beta, activation, out_scale,
                 graph), spec


def build(m, key, x, weight, bias, residual, out, beta, activation, out_scale, output_padding,
          fallback_args, padding, no_bias):
    """(plan, result of this call): the plan of ``key``, built and stored,
    and the call run through it."""
    with BUILD_LOCK:
        plans = m.__dict__.get("_cp_plans")
        plan = plans.get(key) if plans is not None else None
        if plan is not None:  # built by another thread while this one waited
            return plan, plan.run(m, x, weight, bias, residual, out, beta, activation, out_scale,
                                  output_padding, fallback_args, no_bias)
        cast, graph = key[-2], key[-1]
        # Built inside someone else's CUDA graph capture: weighed for it, not kept.
        foreign = not graph and pack.foreign_capture(x)
        graph = graph or foreign
        if cast is None:
            plan, y = _build(m, graph, x, weight, bias, residual, out, beta, activation, out_scale,
                             output_padding, fallback_args, padding, no_bias, packable=not key[-3])
        else:
            plan = AutocastPlan(cast, x.device.type, padding)
            if _autocast_in_kernels(plan, x, weight, bias, residual, out, key[-3]):
                a = plan.cast_args(x, weight, bias)
                plan.inner, y = _build(m, graph, *a, residual, out, beta, activation, out_scale, output_padding,
                                       fallback_args, padding, no_bias)
            else:
                y = plan.run(m, x, weight, bias, residual, out, beta, activation, out_scale, output_padding,
                             fallback_args, no_bias)
        store_plan(m, key, plan, keep=not foreign)
        return plan, y


def _build(m, graph, x, weight, bias, residual, out, beta, activation, out_scale, output_padding,
           fallback_args, padding, no_bias, packable=False):
    """(plan, result of this call) for a call without autocast; ``packable``:
    without autograd (a PyTorch-route call on an NHWC input may then read
    the weight's pack, ``ConvPlan.cl_pack``)."""
    decision, spec = decide(m, x, weight, bias, residual, beta, activation, out_scale, output_padding, padding,
                            graph)
    plan = ConvPlan(MODULE, decision, spec, graph=graph, direct=_direct(m, spec, padding, fallback_args),
                    padding=padding)
    plan.cl_pack = packable and plan.direct is not None and x.is_cuda and x.dim() == 4 and conv_op.nhwc(x)
    if decision.route is Route.CUDNN:
        plan.kind = CUDNN
    elif decision.is_kernel:
        if residual is not None:
            conv_op.check_residual(residual, conv_op.output_shape(spec, tuple(x.shape), output_padding))
        plan.kind = KERNEL
        plan.memory_format = conv_op.output_memory_format(x, weight)
        if decision.tier == LEAN:
            w = pack.kernel_view(weight.detach(), spec.transposed)
        else:
            w = pack.packed_weight(m, weight, spec.transposed)
            if not pack.is_kernel_layout(pack.kernel_view(weight.detach(), spec.transposed)):
                plan.pack_entry = m.__dict__.get("_cp_pack")
        b = None if no_bias else bias
        try:
            y, plan.program = recorded(
                lambda: _run_kernel(plan, x, w, b, residual, out, beta, activation, out_scale, output_padding),
                (x, w, b, residual, out))
        except kernel_errors() as e:
            # Raised while compiling or launching, before anything ran.
            reason = kernel_failure(e, stacklevel=6)
            plan = ConvPlan(MODULE, RouteDecision(Route.FALLBACK, reason), spec, graph=graph, padding=padding)
        else:
            return plan, ((y, bias) if no_bias else y)
    eager_only = plan.kind == MODULE and plan.direct is not None and out is None and not no_bias
    plan.bare = eager_only and residual is None and out_scale == 1.0 and activation == "none"
    if eager_only and padding is None and output_padding is None and not fallback_args and not graph:
        _remember_bare(m, x, plan, residual, activation, beta, out_scale)
    return plan, plan.run(m, x, weight, bias, residual, out, beta, activation, out_scale, output_padding,
                          fallback_args, no_bias)


@dataclasses.dataclass(eq=False)
class AutocastPlan:
    """Calls under ``torch.autocast``. Autocast's lower-precision list holds
    conv2d and conv_transpose2d (CUDA and CPU): each floating input
    (input, weight, bias) of its device type, float64 excepted, is cast to
    the autocast dtype and the op computes in it. ``inner`` is the plan of
    that cast call, built like any other; where the kernels cannot give
    autocast's answer (see ``_autocast_in_kernels``) it is None and the call
    is the module's own forward, under autocast."""

    bare = False  # (never the one-F.conv2d PyTorch route: the cast comes first)

    dtype: torch.dtype
    device_type: str
    padding: Optional[tuple] = None
    inner: Optional[ConvPlan] = None

    @property
    def decision(self) -> RouteDecision:
        if self.inner is None:
            return RouteDecision(Route.FALLBACK, "autocast: the epilogue's dtypes follow PyTorch's promotion")
        return self.inner.decision

    def cast_args(self, x, weight, bias) -> tuple:
        dtype, kind = self.dtype, self.device_type

        def cast(t):
            if (t is None or t.dtype == dtype or t.dtype == torch.float64 or not t.is_floating_point()
                    or t.device.type != kind):
                return t
            return t.to(dtype)

        return cast(x), cast(weight), cast(bias)

    def run(self, m, x, weight, bias, residual, out, beta, activation, out_scale, output_padding,
            fallback_args, no_bias):
        if self.inner is None:
            return eager(m, x, residual, beta, activation, out_scale, fallback_args, out, self.padding, no_bias)
        return self.inner.run(m, *self.cast_args(x, weight, bias), residual, out, beta, activation, out_scale,
                              output_padding, fallback_args, no_bias)


def _autocast_in_kernels(plan, x, weight, bias, residual, out, grad) -> bool:
    """Whether the cast call's plan gives autocast's answer: the fused
    epilogue computes in the conv's dtype, while PyTorch adds a residual of
    another dtype (or writes into an ``out`` of another) with type
    promotion; and autograd must see autocast's own casts."""
    if grad:
        return False
    return all(t is None or t.dtype == plan.dtype for t in (residual, out))


def _direct(m, spec, padding, fallback_args):
    """F.conv2d's arguments where the module's forward is nn.Conv2d's own
    on zero padding (so calling F.conv2d is that forward, minus its Python)."""
    orig = m.__dict__.get("_cp_original")
    cls = type(orig) if orig is not None else m._cp_torch_class
    if (spec.transposed or fallback_args or cls.forward is not torch.nn.Conv2d.forward
            or cls._conv_forward is not torch.nn.Conv2d._conv_forward or m.padding_mode != "zeros"):
        return None
    if padding is not None:
        # The call's own padding, where F.conv2d can take it without an F.pad
        # (the same on both sides of each axis: a band inside the image).
        left, right, top, bottom = (int(v) for v in padding)
        return (m.stride, (top, left), m.dilation, m.groups) if (left, top) == (right, bottom) else None
    return (m.stride, m.padding, m.dilation, m.groups)


# -- the bare fast path ----------------------------------------------------------
# A plan of PyTorch's route whose conv is exactly ``F.conv2d`` (``direct``)
# followed by the epilogue as eager ops computes what the module and those
# ops compute from the module's current weight, bias and geometry, whatever
# the weight's identity, autograd or autocast. So such a call (no ``out``,
# no padding of its own) whose input was seen before needs none of
# ``conv_key``: ``bare_slot`` (the input's geometry, dtype, device and
# alignment, the things that can turn PyTorch's route into a kernel's; the
# residual's layout, dtype and alignment, which decide whether a kernel
# could take it; the epilogue's constants) finds it, and the call costs no
# more host time than the module's own forward and the eager ops: a few
# frames and no attribute lookups through ``nn.Module.__getattr__``. A
# UNet's resnet convs (the time embedding and the shortcut in their
# epilogues) run on PyTorch this way.
# Only plans made off the graph path are remembered, and a call on it
# (``pack.GRAPH_PATH``: conv-patch's own graph warm-up and capture) does not
# look here: there a launch costs GPU time only and the kernels may win. A
# CUDA graph the caller captures records what this path runs, PyTorch's
# ops, as the unpatched model would: asking CUDA whether the stream is
# capturing would cost every eager call more than a microsecond.
# ``clear`` and a full plan cache drop these with the plans.
def bare_slot(x, residual, activation, beta, out_scale) -> tuple:
    """The slot a plan of the bare path is remembered under (``_remember_bare``).
    ``bare_call`` builds the same tuple inline, one Python frame less per
    call of every conv; were the two to differ, every call would build its
    plan again, which the bare-path tests count (``conv_key`` calls)."""
    res = None if residual is None else (residual.stride(), residual.dtype, residual.data_ptr() & 15)
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, activation, res, beta, out_scale)


def bare_call(m, x, activation="none", residual=None, beta=1.0, out_scale=1.0):
    """``out_scale * act(m(x) + beta * residual)`` by the plan found for
    this call's slot (``bare_slot``), else None (the caller takes
    ``conv``). Not while torch.compile traces (a traced call is the
    compiled op's) nor for ComfyUI's classes (the caller checks).
    The one body a wrapper's forward runs for a planned PyTorch-route call:
    it enters no more Python functions than ``nn.Conv2d``'s own forward."""
    bare = m.__dict__.get("_cp_bare")
    if bare is None or pack.GRAPH_PATH or torch.compiler.is_compiling():
        return None
    res = None if residual is None else (residual.stride(), residual.dtype, residual.data_ptr() & 15)
    hit = bare.get((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, activation, res, beta, out_scale))
    if hit is None:
        return None
    params = m.__dict__["_parameters"]
    weight = params.get("weight")
    if weight is None:  # parametrized since (see conv): its own forward computes
        return None
    m.__dict__["_cp_last"] = hit[1]
    if hit[3] and not (weight.requires_grad and torch.is_grad_enabled()):
        # (The slot holds for any autograd state; the pack only without it.)
        weight = _cudnn_weight(m, x, weight)
    y = _conv2d(x, weight, params.get("bias"), *hit[0])
    if residual is None and out_scale == 1.0:
        return y if hit[2] is None else hit[2](y)
    if residual is not None and residual.shape != y.shape:  # the kernels' refusal, without a call
        conv_op.check_residual(residual, y.shape)
    return eager_epilogue(y, residual, beta, activation, out_scale)


def _remember_bare(m, x, plan, residual, activation, beta, out_scale):
    bare = m.__dict__.get("_cp_bare")
    if bare is None:
        bare = m.__dict__["_cp_bare"] = {}
    bare[bare_slot(x, residual, activation, beta, out_scale)] = (plan.direct, plan.decision,
                                                                ACTIVATIONS[activation][1], plan.cl_pack)


def conv(m, x, residual=None, beta=1.0, activation="none", out_scale=1.0, output_padding=None,
         fallback_args=(), out=None, padding=None, no_bias=False):
    """``out_scale * act(m(x) + beta * residual)`` for a patched conv ``m``
    (into ``out`` when given); ``padding`` (F.pad order) is the call's own
    padding and replaces the module's (for an unpadded conv: an F.pad folded
    in front; for a band of an image: zero rows only on the image-edge
    sides); with ``no_bias`` the pair ``(y, b)`` with ``y + b`` the result
    (b None where the bias is already in ``y``)."""
    params = m.__dict__["_parameters"]
    try:
        weight, bias = params["weight"], params["bias"]
    except KeyError:
        # Not registered Parameters any more (a parametrization such as
        # weight_norm, or a buffer): the module's own forward computes from
        # whatever ``m.weight`` is now, as apply() leaves such convs alone.
        m.__dict__["_cp_last"] = UNREGISTERED
        return eager(m, x, residual, beta, activation, out_scale, fallback_args, out, padding, no_bias)
    return conv_with(m, weight, bias, x, residual, beta, activation, out_scale, output_padding, fallback_args,
                     out, padding, no_bias)


def conv_with(m, weight, bias, x, residual=None, beta=1.0, activation="none", out_scale=1.0,
              output_padding=None, fallback_args=(), out=None, padding=None, no_bias=False):
    """``conv`` with the weight and bias given: ``m`` holds the plans and the
    pack (a patched conv, or a ``CallSite``)."""
    key = conv_key(x, weight, bias, residual, out, beta, activation, out_scale, output_padding, padding, no_bias)
    plans = m.__dict__.get("_cp_plans")
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan, y = build(m, key, x, weight, bias, residual, out, beta, activation, out_scale, output_padding,
                        fallback_args, padding, no_bias)
    elif plan.bare:
        # The cheapest PyTorch route, without even run()'s argument list.
        y = _conv2d(x, _cudnn_weight(m, x, weight) if plan.cl_pack else weight, bias, *plan.direct)
    else:
        y = plan.run(m, x, weight, bias, residual, out, beta, activation, out_scale, output_padding,
                     fallback_args, no_bias)
    m.__dict__["_cp_last"] = plan.decision
    return y


_conv2d = torch.nn.functional.conv2d


class CallSite:
    """The plans and the weight pack of a conv call made without a patched
    module (the torch.compile custom op, ``conv_patch.runtime.compiled``): one per
    geometry and weight, found by ``call_site``, so those calls are planned,
    weighed against PyTorch and replayed like a wrapper's. Its PyTorch route
    is ``ConvSpec.torch_forward`` with the call's weight and bias (passed to
    ``eager`` as the fallback arguments)."""

    def __init__(self, spec: ConvSpec):
        self.spec = spec
        self._cp_torch_class = torch.nn.ConvTranspose2d if spec.transposed else torch.nn.Conv2d

    @staticmethod
    def _cp_fallback_forward(site, x, weight, bias):
        return site.spec.torch_forward(x, weight, bias)


# Call sites kept (a process compiling many models starts over past this).
MAX_SITES = 1024
_SITES: dict = {}


def call_site(spec: ConvSpec, weight, bias) -> CallSite:
    """The ``CallSite`` of ``spec`` with this weight and bias (by storage: a
    weight edited in place keeps its site, and its pack is refreshed from it
    at every call as a wrapper's is)."""
    key = (spec, weight.data_ptr(), weight.device, weight.dtype, None if bias is None else bias.data_ptr())
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) >= MAX_SITES:
            _SITES.clear()
        site = _SITES[key] = CallSite(spec)
    return site


def clear(m) -> None:
    """Drop ``m``'s plans (its attributes or parameters changed), and what
    the models learned about passing their parts through."""
    passthrough.changed()
    m.__dict__["_cp_plans"] = None
    m.__dict__["_cp_bare"] = None
    m.__dict__["_cp_subpixel"] = None
    m.__dict__["_cp_gate"] = None


# -- the folded upsample -------------------------------------------------------------
def upsample_conv(m, x, residual=None, activation="none"):
    """``act(m(F.interpolate(x, scale_factor=2, mode="nearest")) + residual)``
    for patched 3x3, padding-1 conv ``m``, as the four 2x2 convs of ``x``
    that ``ops.upsample_conv2d`` describes, each through ``conv_with`` on a
    call site of its own (planned, weighed against PyTorch, replayed), into
    the parity-strided views of one output. The folded weights live in a
    buffer kept on ``m`` and are folded again from ``m``'s weight at every
    call (one launch), as packs are refreshed (pack.py says why). None
    where the call is not this one (a weight that is no registered
    Parameter any more, or no 3x3 over the input's channels): the caller
    runs the upsample and the conv."""
    params = m.__dict__["_parameters"]
    weight, bias = params.get("weight"), params.get("bias")
    n, c_in, h, w = x.shape
    if weight is None or "bias" not in params or tuple(weight.shape) != (weight.shape[0], c_in, 3, 3):
        return None
    c_out = weight.shape[0]
    shape = (n, c_out, 2 * h, 2 * w)
    conv_op.check_residual(residual, shape)
    key = (weight.shape, weight.dtype, weight.device, bias is not None)
    held = m.__dict__.get("_cp_subpixel")
    if held is None or held[0] != key:
        # The buffer, and per parity its 2x2 weight (a view of the buffer)
        # and call site: the same from call to call while the buffer is.
        subs = pack.persistent(torch.empty, (2, 2, c_out, 2, 2, c_in), dtype=weight.dtype, device=weight.device)
        spec = ConvSpec(False, c_in, c_out, (2, 2), (1, 1), (1, 1), (0, 0), (0, 0), (0, 0), 1, "zeros",
                        bias is not None)
        parities = [(a, b, parity_weight(subs, a, b)) for a, b in PARITIES]
        parities = [(a, b, w_ab, call_site(spec, w_ab, bias)) for a, b, w_ab in parities]
        held = m.__dict__["_cp_subpixel"] = (key, subs, parities)
    subpixel_weights(weight, out=held[1])
    out = torch.empty(shape, dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last if conv_op.nhwc(x) else torch.contiguous_format)
    for a, b, w_ab, site in held[2]:
        conv_with(site, w_ab, bias, x, None if residual is None else parity_view(residual, a, b), 1.0,
                  activation, 1.0, None, (w_ab, bias), parity_view(out, a, b), parity_padding(a, b))
    return out
