"""How a planned call runs: the plans of the dispatch core (a 2-D conv's, a
Conv3d's, a norm's), the call's own PyTorch computation they fall back to
(``eager``), and what every plan shares: where a failed kernel is reported,
how plans are stored (bounded per module, in its state) and built (one at a
time), how a kernel call is recorded for replay.

A plan is made once per call signature (conv_patch/runtime/planner.py) and
then only run: ``plan.run(m, call, weight, bias)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import sys
import threading
import time
import warnings
from typing import Optional

import torch

from conv_patch.activations import eager_epilogue
from conv_patch.ops import conv2d as conv2d_op
from conv_patch.ops import conv3d as conv3d_op
from conv_patch.ops.epilogue import check_residual
from conv_patch.ops.loader import kernels
from conv_patch.routing.decide import RouteDecision, fallback
from conv_patch.routing.registry import Route
from conv_patch.runtime import pack
from conv_patch.runtime.state import state_of
from conv_patch.specs import ConvSpec, resolve_padding
from conv_patch.target import interpreter_enabled, target_for


class KernelFailureWarning(RuntimeWarning):
    """A kernel could not be built or launched here (e.g. a tile needing more
    shared memory than this GPU has); that call ran on PyTorch instead."""


def kernel_failure(e: Exception, stacklevel: int = 3) -> str:
    """The reason a call whose kernel failed to build or launch (one of
    ``ops.loader.kernel_errors()``) gives for running on PyTorch, warned as
    a ``KernelFailureWarning``: callers remember it and do not try again."""
    reason = f"kernel failed here: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    warnings.warn(f"conv-patch: {reason}; this call ran on PyTorch", KernelFailureWarning, stacklevel=stacklevel)
    return reason


# Plans kept per module; a model that sees more signatures than this (a
# stream of resolutions) starts over rather than growing without bound.
MAX_PLANS = 64

# Plans are built one at a time, every module's, in every thread: two
# threads building one module's plans at once compiled its kernels twice and
# swapped its weight pack under each other, and a full plan dict could be
# replaced under a concurrent store. Only a miss takes the lock: a lookup is
# a plain dict read (a plan is stored complete, and a replay only reads it).
# Reentrant: a build runs the module's forward.
BUILD_LOCK = threading.RLock()

# A plan's first call compiles the Triton kernels it launches (seconds each
# on a cold cache); a build still running after this long says so, once, on
# stderr, so that a first call that takes a minute is not mistaken for a hang.
COMPILE_NOTICE_S = 2.0


class _Build(threading.local):
    depth = 0


_BUILD = _Build()


class BuildCount:
    """Plan builds started in this process (``building``'s outermost ones),
    read before and after a call to say how many it made (``warmup``)."""

    total = 0


def _notice(what, started):
    try:
        name = what()
    except Exception:  # a description must never be the failure
        name = "a convolution"
    print(f"conv-patch: compiling kernels for {name} (its first call; {time.perf_counter() - started:.0f} s so "
          "far; cached for later calls and processes)", file=sys.stderr, flush=True)


class _NoticeWatch:
    """The thread behind ``building``'s notice: one daemon thread for the
    process, woken at a build's start and at its deadline (builds run one
    at a time, under ``BUILD_LOCK``, so there is one build to watch). A
    ``threading.Timer`` per build started a thread for each of them: a
    first call builds hundreds of plans (RRDB x4: 351), and starting a
    thread costs about a millisecond of host time."""

    def __init__(self):
        self.cond = threading.Condition(threading.Lock())
        self.current = None  # (token, what, started, deadline) of the build under way, until noticed or done
        self.token = 0
        self.running = False  # (its thread started: made anew in a forked child, below)

    def start(self, what) -> int:
        now = time.perf_counter()
        with self.cond:
            self.token += 1
            self.current = (self.token, what, now, now + COMPILE_NOTICE_S)
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="conv-patch-build-notice", daemon=True).start()
            self.cond.notify()
            return self.token

    def done(self, token: int) -> None:
        with self.cond:
            if self.current is not None and self.current[0] == token:
                self.current = None

    def _run(self) -> None:
        while True:
            with self.cond:
                while self.current is None:
                    self.cond.wait()
                token, what, started, deadline = self.current
                left = deadline - time.perf_counter()
                if left > 0:
                    self.cond.wait(left)  # (then look again: done, another build, or due)
                    continue
                self.current = None  # (noticed once)
            _notice(what, started)


_WATCH = _NoticeWatch()
if hasattr(os, "register_at_fork"):
    # (A child has no watcher thread, and one forked while the watcher held
    # its lock would find it held.)
    os.register_at_fork(after_in_child=_WATCH.__init__)


@contextlib.contextmanager
def building(x, what):
    """``BUILD_LOCK`` held for one plan build; where it can compile kernels
    (``x`` on a GPU, or under the interpreter) and is the thread's outermost
    build, a line naming ``what()`` once it passes ``COMPILE_NOTICE_S``."""
    with BUILD_LOCK:
        token = None
        if _BUILD.depth == 0:
            BuildCount.total += 1
            if x.is_cuda or interpreter_enabled():
                token = _WATCH.start(what)
        _BUILD.depth += 1
        try:
            yield
        finally:
            _BUILD.depth -= 1
            if token is not None:
                _WATCH.done(token)

UNREGISTERED = fallback("weight or bias is not a registered Parameter (parametrized, or a buffer)")

class Kind(enum.Enum):
    """What a 2-D plan runs: a kernel, the cuDNN route with the fused
    epilogue, or the module's own forward."""

    KERNEL = enum.auto()
    CUDNN = enum.auto()
    MODULE = enum.auto()


KERNEL, CUDNN, MODULE = Kind.KERNEL, Kind.CUDNN, Kind.MODULE


def tensor_sig(t):
    """What of a tensor a plan's signature holds: shape, strides, dtype,
    device, 16-byte alignment."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def recorded(fn, roles):
    """``(fn(), program)``: the result and its launches recorded as a
    ``Program`` that replays them with another call's tensors in ``roles``
    (None where they cannot be recorded). Kernel errors propagate, raised
    before anything ran."""
    k = kernels()
    with k.recording() as rec:
        y = fn()
    try:
        return y, k.Program(rec, roles, y)
    except k.Unrecordable:
        return y, None


def store_plan(m, key, plan, keep: bool = True):
    """``plan`` kept in ``m``'s state under ``key``; a full dict starts over
    (with the bare fast path's slots, which it bounds). Not where ``keep``
    is false: a plan built inside someone else's CUDA graph capture
    (``pack.graph_flag`` says why)."""
    if not keep:
        return
    st = state_of(m)
    if st.plans is None or len(st.plans) >= MAX_PLANS:
        if st.plans is not None:
            st.bare = None
        st.plans = {}
    st.plans[key] = plan


def records_grad(x, weight, bias, residual) -> bool:
    """Autograd would record a 2-D conv call on these tensors (written out,
    not ``specs.needs_grad``'s generator: it runs at every planned call)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)
                                        or (residual is not None and residual.requires_grad))


def conv_key(call, weight, bias):
    """Everything a 2-D plan depends on besides the module's attributes (a
    change of those clears the module's plans)."""
    x, residual, out = call.x, call.residual, call.out
    grad = records_grad(x, weight, bias, residual)
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
    # The planner reads the last three entries: autograd, the autocast dtype
    # and the graph flag.
    return (x.shape, x.stride(), x.dtype, device, x.data_ptr() & 15, weight.data_ptr(), weight.shape,
            None if bias is None else bias.data_ptr(), tensor_sig(residual), tensor_sig(out), alias, call.beta,
            call.activation, call.out_scale, call.output_padding, call.padding, call.no_bias, grad, cast, graph)


_conv2d = torch.nn.functional.conv2d


@dataclasses.dataclass(eq=False)
class ConvPlan:
    """How 2-D calls of one signature run. ``decision`` is what the report
    and ``repr`` show; ``program`` the recorded launches (None: call the
    launchers each time)."""

    kind: Kind
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
    # (no epilogue, no ``out``): ``dispatch.conv`` calls that itself.
    bare: bool = False
    # A ``direct`` call on an NHWC CUDA input, without autograd or autocast:
    # F.conv2d may get the weight's channels_last pack (``cudnn_weight`` says when).
    cl_pack: bool = False

    def run(self, m, call, weight, bias):
        if self.kind == MODULE:
            y = None
            if self.direct is not None:
                y = _conv2d(call.x, cudnn_weight(m, call.x, weight) if self.cl_pack else weight, bias, *self.direct)
            return eager(m, call, self.padding, y)
        if self.kind == CUDNN:
            y = conv2d_op.cudnn_conv2d(self.spec, call.x, cudnn_weight(m, call.x, weight),
                                       None if call.no_bias else bias, residual=call.residual, beta=call.beta,
                                       activation=call.activation, out_scale=call.out_scale, out=call.out)
            return (y, bias) if call.no_bias else y
        b = None if call.no_bias else bias
        if self.program is not None:
            y = self.replay(m, call.x, weight, b, call.activation, call.residual, call.out)
        else:
            w = self.weight(m, weight)
            if type(call.activation) is not str:
                b = conv2d_op.kernel_bias(b, call.activation, self.spec.out_channels, call.x.device)
            y = self.launch(call, w, b)
        return (y, bias) if call.no_bias else y

    def replay(self, m, x, weight, bias, activation, residual, out):
        """A KERNEL plan's recorded launches on this call's tensors, the
        pack refreshed from ``weight`` first."""
        w = self.weight(m, weight)
        if type(activation) is not str:  # (PReLU's slopes: one type check on the hot path)
            bias = conv2d_op.kernel_bias(bias, activation, self.spec.out_channels, x.device)
        return self.program((x, w, bias, residual, out))

    def weight(self, m, weight):
        """The kernels' weight, read from ``weight`` during this call (see
        conv_patch/runtime/pack.py: a pack is rewritten at every call)."""
        entry = self.pack_entry
        if entry is None:
            # In the kernels' layout already, or read in place (the lean route).
            return pack.kernel_view(weight.detach(), self.spec.transposed)
        if self.graph or state_of(m).pack is not entry:
            return pack.packed_weight(m, weight, self.spec.transposed)
        # Kernel plans run without autograd, so the copy records nothing.
        transposed = self.spec.transposed
        return pack.refresh(m, entry, weight.transpose(0, 1) if transposed else weight, transposed)

    def launch(self, call, w, bias):
        """The kernel's launch for this call (recorded by the planner)."""
        d = self.decision
        return conv2d_op.run_kernel(d.route, d.config, target_for(call.x.device), self.spec, call.x, w, bias,
                                    residual=call.residual, beta=call.beta, activation=call.activation,
                                    out_scale=call.out_scale, output_padding=call.output_padding, out=call.out,
                                    memory_format=self.memory_format)


class KernelSlot:
    """A recorded KERNEL plan on the bare fast path (``dispatch.bare_call``):
    the bare slot holds the input's geometry, dtype, device and alignment,
    the residual's layout, dtype and alignment, and the epilogue's
    constants; what else the plan's signature (``conv_key``) held for such a
    call is checked here: the weight and bias by address and shape (a
    replaced parameter builds a new plan), the residual's shape and that it
    is not the input, no autograd, no autocast. Where a check fails the call
    takes the full path."""

    __slots__ = ("plan", "weight_key", "bias_ptr", "residual_shape")

    def __init__(self, plan, weight, bias, residual):
        self.plan = plan
        self.weight_key = (weight.data_ptr(), weight.shape)
        self.bias_ptr = None if bias is None else bias.data_ptr()
        self.residual_shape = None if residual is None else residual.shape

    def run(self, m, x, activation, residual):
        """The plan's replay, or None where the call is not the plan's."""
        params = m.__dict__["_parameters"]
        weight, bias = params.get("weight"), params.get("bias")
        if weight is None or (weight.data_ptr(), weight.shape) != self.weight_key:
            return None
        if (None if bias is None else bias.data_ptr()) != self.bias_ptr:
            return None
        if residual is not None and (residual is x or residual.shape != self.residual_shape):
            return None
        if records_grad(x, weight, bias, residual) or torch.is_autocast_enabled(x.device.type):
            return None
        plan = self.plan
        state_of(m).last = plan.decision
        return plan.replay(m, x, weight, bias, activation, residual, None)


@dataclasses.dataclass(eq=False)
class AutocastPlan:
    """Calls under ``torch.autocast``. Autocast's lower-precision list holds
    conv2d and conv_transpose2d (CUDA and CPU): each floating input
    (input, weight, bias) of its device type, float64 excepted, is cast to
    the autocast dtype and the op computes in it. ``inner`` is the plan of
    that cast call, built like any other; where the kernels cannot give
    autocast's answer (``autocast_in_kernels``) it is None and the call is
    the module's own forward, under autocast."""

    bare = False  # (never the one-F.conv2d PyTorch route: the cast comes first)

    dtype: torch.dtype
    device_type: str
    padding: Optional[tuple] = None
    inner: Optional[ConvPlan] = None

    @property
    def decision(self) -> RouteDecision:
        if self.inner is None:
            return fallback("autocast: the epilogue's dtypes follow PyTorch's promotion")
        return self.inner.decision

    def cast(self, t):
        if (t is None or t.dtype == self.dtype or t.dtype == torch.float64 or not t.is_floating_point()
                or t.device.type != self.device_type):
            return t
        return t.to(self.dtype)

    def cast_call(self, call):
        """The call with its input cast (the residual and ``out`` are not
        autocast's business)."""
        return _with_x(call, self.cast(call.x))

    def run(self, m, call, weight, bias):
        if self.inner is None:
            return eager(m, call, self.padding)
        return self.inner.run(m, self.cast_call(call), self.cast(weight), self.cast(bias))


def _with_x(call, x):
    """``call`` with another input (a Call is a slotted object: copied)."""
    new = type(call).__new__(type(call))
    for name in type(call).__slots__:
        setattr(new, name, getattr(call, name))
    new.x = x
    return new


def autocast_in_kernels(plan: AutocastPlan, call, grad) -> bool:
    """Whether the cast call's plan gives autocast's answer: the fused
    epilogue computes in the conv's dtype, while PyTorch adds a residual of
    another dtype (or writes into an ``out`` of another) with type
    promotion; and autograd must see autocast's own casts."""
    if grad:
        return False
    return all(t is None or t.dtype == plan.dtype for t in (call.residual, call.out))


def eager(m, call, padding=None, y=None):
    """The call as PyTorch computes it: the module's own forward (after the
    call's own ``padding`` where given; ``y`` when the caller already has
    the module's output), then the epilogue as eager ops, into ``out`` when
    given. With ``no_bias`` the pair ``(y, None)``: the bias is in ``y``."""
    x = call.x
    if y is None:
        if padding is not None:
            y = forward_with_padding(m, x, padding, lambda t: m.cp_forward(t, *call.fallback_args))
        else:
            y = m.cp_forward(x, *call.fallback_args)
    if call.no_bias:
        return y, None
    out = call.out
    if call.plain_epilogue:
        return y if out is None else out.copy_(y)
    check_residual(call.residual, y.shape)
    y = eager_epilogue(y, call.residual, call.beta, call.activation, call.out_scale)
    return y if out is None else out.copy_(y)


def forward_with_padding(m, x, padding, forward):
    """``forward`` (the conv ``m``'s own computation) on ``x`` with
    ``padding`` (F.pad order) in place of ``m``'s own padding, as the
    kernels compute a call's padding: for a module without padding of its
    own, ``forward(F.pad(x, padding))``. A module that pads itself (a 3x3
    conv computing one band of an image, with zero rows only on the
    image-edge sides) pads the F.pad'ed input again, and the output rows and
    columns that extra padding made are cut away."""
    x = torch.nn.functional.pad(x, tuple(int(v) for v in padding))
    if isinstance(m, torch.nn.Module):
        (pt, pl), (pb, pr) = resolve_padding(m.padding, tuple(m.kernel_size), tuple(m.dilation))
        (sh, sw), transposed = m.stride, getattr(m, "transposed", False)
    else:
        # A CallSite: its forward is its spec's (the torch.compile op, the folded upsample).
        (pt, pl), (pb, pr) = m.spec.pad_begin, m.spec.pad_end
        (sh, sw), transposed = m.spec.stride, m.spec.transposed
    if not (pt or pl or pb or pr):
        return forward(x)
    if pt % sh or pb % sh or pl % sw or pr % sw or transposed:
        raise ValueError(f"a call's own padding replaces {m}'s only where the stride divides that padding")
    y = forward(x)
    h, w = y.shape[-2:]
    return y[..., pt // sh:h - pb // sh, pl // sw:w - pr // sw]


def cudnn_weight(m, x, weight):
    """The weight handed to cuDNN: for an NHWC input inside a fused block's
    call (``pack.grouped``: its pack already refreshed with the block's
    others, in one launch) or on the graph path (the pack kernel's GPU time
    beats PyTorch's strided copy), the weight's channels_last pack, where
    cuDNN would convert an NCHW weight itself. Anywhere else the weight as
    it is: a refresh there is the same strided copy PyTorch makes inside
    its call, launched from Python, host time that a launch-bound conv
    pays in full. An NCHW input keeps the weight as it is, since a
    channels_last weight would make PyTorch return a channels_last output.
    Only for calls without autograd (the pack is no function of the weight
    for it): the callers check."""
    if ((pack.ACTIVE.group is not None or pack.GRAPH_PATH) and x.dim() == 4 and x.is_cuda
            and conv2d_op.nhwc(x)):
        return pack.packed_weight(m, weight, False)
    return weight


@dataclasses.dataclass(eq=False)
class Conv3dPlan:
    """A Conv3d call's plan: the kernel (``decision.config`` its tiles), the
    cuDNN route (``ops.conv3d.cudnn_conv3d``: PyTorch's conv3d with fewer
    copies than the module's own forward, the bias and epilogue as one pass
    on NDHWC), or the module's own forward, with the epilogue as PyTorch
    ops."""

    decision: RouteDecision
    spec: object
    target: Optional[object] = None

    def run(self, m, call, weight, bias):
        d, s = self.decision, self.spec
        if d.is_kernel:
            w = pack.route_weight(weight.detach(), d.route)
            return conv3d_op.run_kernel(d.route, d.config, self.target, call.x, w,
                                        None if bias is None else bias.detach(), call.cache, s.pads, s.stride,
                                        s.dilation, residual=call.residual, beta=call.beta,
                                        activation=call.activation, out_scale=call.out_scale)
        if d.route is Route.CUDNN:
            return conv3d_op.cudnn_conv3d(call.x, weight, bias, call.cache, s.pads, s.stride, s.dilation,
                                          residual=call.residual, beta=call.beta, activation=call.activation,
                                          out_scale=call.out_scale)
        return eager_epilogue(call.own(), call.residual, call.beta, call.activation, call.out_scale)


@dataclasses.dataclass(eq=False)
class NormPlan:
    """A norm call's plan: the kernels (``program``: their recorded
    launches) or PyTorch's own norm and activation."""

    kernel: bool
    why: str
    program: Optional[object] = None
