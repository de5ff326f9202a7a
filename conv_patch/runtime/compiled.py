"""The convolution as a PyTorch op (``ops/library.py``), for ``torch.compile``.

``torch.ops.conv_patch.conv`` takes the whole call (input, weight, bias,
residual, geometry, epilogue). It is a composite op: traced, it becomes
PyTorch's own ops (the convolution and the epilogue as eager ops, which
Inductor fuses and schedules as it does the unpatched model's) where the
kernels would not take the call as it runs (``kernels_may_take``: the
traced shapes are known, the routing decides as for an eager call), and
otherwise ``torch.ops.conv_patch.conv_routed``, which runs the call
through the one dispatch entry (``dispatch.conv_with`` with a
``dispatch.CallSite``): planned per signature, a kernel only where it beats
PyTorch as called, like a wrapper's call. The routed op's fake
implementation only computes the output's shape, dtype and memory format,
so Dynamo traces a patched model without graph breaks and Inductor treats
the call as one opaque kernel. Under tracing the wrappers call ``conv``
instead of falling back (``wrappers.PatchedConvMixin.cp_call``).
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from conv_patch.activations import eager_epilogue
from conv_patch.ops import conv2d as conv_op
from conv_patch.ops import group_norm as group_norm_op
from conv_patch.ops import library
from conv_patch.routing import costs
from conv_patch.routing.decide import decide
from conv_patch.runtime import dispatch, pack, passthrough
from conv_patch.call import Call
from conv_patch.specs import KERNEL_DTYPES, CallDesc, ConvSpec, conv_geometry, layout_of, needs_grad, pair
from conv_patch.target import target_for


def _spec(x, weight, bias, transposed, stride, pad_begin, pad_end, dilation, output_padding) -> ConvSpec:
    c_in, c_out = (weight.shape[0], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[0])
    return ConvSpec(bool(transposed), int(c_in), int(c_out), tuple(weight.shape[2:]), tuple(stride),
                    tuple(dilation), tuple(pad_begin), tuple(pad_end), tuple(output_padding), 1, "zeros",
                    bias is not None)


_CONV_ARGS = ("(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, bool transposed, int[] stride, "
              "int[] pad_begin, int[] pad_end, int[] dilation, int[] output_padding, float beta, str activation, "
              "float out_scale) -> Tensor")


@library.op("conv_routed" + _CONV_ARGS)
def conv_routed(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], transposed: bool, stride: List[int], pad_begin: List[int],
                pad_end: List[int], dilation: List[int], output_padding: List[int], beta: float, activation: str,
                out_scale: float) -> torch.Tensor:
    # The one dispatch entry, with a call site for the plans and the pack:
    # planned, weighed against PyTorch and replayed like a wrapper's call.
    site = dispatch.call_site(
        lambda: _spec(x, weight, bias, transposed, stride, pad_begin, pad_end, dilation, output_padding),
        weight, bias, (transposed, *stride, *pad_begin, *pad_end, *dilation, *output_padding, bias is None))
    y = dispatch.conv_with(site, weight, bias, Call(x, residual, beta, activation, out_scale,
                                                    output_padding=tuple(output_padding) if transposed else None,
                                                    fallback_args=(weight, bias)))
    # An op's output must not alias its inputs (the compiled graph may free them).
    return y.clone() if y is x or y is residual else y


@library.fake(conv_routed)
def _(x, weight, bias, residual, transposed, stride, pad_begin, pad_end, dilation, output_padding,
      beta, activation, out_scale):
    spec = _spec(x, weight, bias, transposed, stride, pad_begin, pad_end, dilation, output_padding)
    shape = conv_op.output_shape(spec, tuple(x.shape), output_padding)
    # The real op's strides: PyTorch's format (run_kernel allocates a 3-D
    # call's output batched, then squeezes it, as PyTorch does).
    fmt = conv_op.output_memory_format(x, weight)
    y = torch.empty((1,) + shape if len(shape) == 3 else shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    return y.squeeze(0) if len(shape) == 3 else y


def size_hint(d) -> Optional[int]:
    """``d``, or for a symbolic size (dynamic shapes) the size it had where
    Dynamo traced it (its hint; no guard is added), None where there is
    none."""
    if not isinstance(d, torch.SymInt):
        return int(d)
    from torch.fx.experimental import symbolic_shapes
    for name in ("optimization_hint", "hint_int"):  # (the name in newer, older torch)
        fn = getattr(symbolic_shapes, name, None)
        if fn is not None:
            try:
                return int(fn(d))
            except Exception:  # (no hint: an unbacked size)
                return None
    return None


def kernels_may_take(spec: ConvSpec, x, weight, bias, residual, beta: float = 1.0, activation: str = "none",
                     out_scale: float = 1.0, shape: Optional[tuple] = None) -> bool:
    """Whether the kernels may take this call when it runs, decided while
    tracing: the routing's decision for the call as an eager call would
    describe it, its tensors taken as 16-byte aligned (a compiled graph's
    buffers are; the routed op checks when it runs) and its epilogue worth
    one pass at most (Inductor fuses the eager ops into one, or into the
    next kernel). The table's cuDNN route counts as PyTorch's: Inductor
    fuses that epilogue too. With symbolic sizes (dynamic shapes) the
    decision at the sizes Dynamo traced: a conv PyTorch's route wins there
    stays PyTorch's at every size (as fast as the compiled unpatched
    model's), one the kernels take stays the routed op, which decides per
    call; without a hint, the routed op. ``shape``: the conv's input shape
    where it is not ``x``'s (``x`` then gives its dtype, layout and
    device)."""
    shape = tuple(size_hint(d) for d in (tuple(x.shape) if shape is None else tuple(shape)))
    if None in shape or any(isinstance(d, torch.SymInt) for d in weight.shape):
        return True
    ops = min(1, costs.epilogue_ops(residual is not None, beta, activation, out_scale))
    desc = CallDesc(shape=shape, dtype=x.dtype, device_type=x.device.type, layout=layout_of(x),
                    weight_dtype=weight.dtype, bias_dtype=None if bias is None else bias.dtype,
                    same_device=all(t is None or t.device == x.device for t in (weight, bias, residual)),
                    output_padding=spec.output_padding if spec.transposed else None, epilogue=ops,
                    packed=not pack.is_kernel_layout(pack.kernel_view(weight, spec.transposed)),
                    residual_dtype=None if residual is None else residual.dtype)
    return decide(spec, desc, target_for(x.device)).is_kernel


def replayed_as_cuda_graphs(x: torch.Tensor) -> bool:
    """Whether the graph being traced, on ``x``'s device, will be replayed
    as CUDA graphs (torch.compile's reduce-overhead mode: Inductor's
    ``triton.cudagraphs``, set while it traces, whatever the device; only a
    CUDA graph is replayed so). The routed conv ops keep tensors across
    calls (a call site's weight pack, the folded upsample's weights), made
    at their first call, which a CUDA-graph tree runs inside its memory
    pool: it refuses such a tensor (its replays would overwrite it). So such
    a graph gets PyTorch's convolutions, which it replays itself."""
    if not x.is_cuda:
        return False
    try:
        from torch._inductor import config
    except ImportError:  # (a build without Inductor cannot be compiling with it)
        return False
    return bool(getattr(getattr(config, "triton", None), "cudagraphs", False))


@library.composite("conv" + _CONV_ARGS)
def conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         transposed: bool, stride: List[int], pad_begin: List[int], pad_end: List[int], dilation: List[int],
         output_padding: List[int], beta: float, activation: str, out_scale: float) -> torch.Tensor:
    spec = _spec(x, weight, bias, transposed, stride, pad_begin, pad_end, dilation, output_padding)
    if (needs_grad(x, weight, bias, residual) or replayed_as_cuda_graphs(x)
            or not kernels_may_take(spec, x, weight, bias, residual, beta, activation, out_scale)):
        # PyTorch's route, as the original module and the eager epilogue
        # (differentiable: the routed op is not).
        return eager_epilogue(spec.torch_forward(x, weight, bias), residual, beta, activation, out_scale)
    return conv_routed(x, weight, bias, residual, transposed, stride, pad_begin, pad_end, dilation, output_padding,
                       beta, activation, out_scale)


def takes(module, x, residual=None) -> bool:
    """Whether a traced call of patched conv ``module`` on ``x`` is the
    ops' (else Dynamo traces the module's own computation): no autograd
    (the ops have no backward), no autocast (the op would compute in the
    input's dtype, not autocast's), no ComfyUI weight casting or patching
    (the original forward builds the weight per call)."""
    return (not needs_grad(x, module.weight, module.bias, residual) and not torch.is_autocast_enabled(x.device.type)
            and not module.cp_comfy_active())


def call(module, c: Call) -> torch.Tensor:
    """The op for a wrapper's call (what its forward runs under tracing).
    The geometry is read from the module's own attributes, as the unpatched
    forward reads it: Dynamo guards every value a trace reads, and the
    wrapper's cached ``spec`` added about thirty guards a conv, evaluated at
    every call of the compiled model (0.9 ms a call on SD1.5's UNet)."""
    transposed, stride, dilation, begin, end, op = conv_geometry(module)
    if c.output_padding is not None:
        op = pair(c.output_padding)
    return conv(c.x, module.weight, module.bias, c.residual, transposed, list(stride),
                list(begin), list(end), list(dilation), list(op),
                float(c.beta), c.activation, float(c.out_scale))


def _upsample_spec(weight, bias) -> ConvSpec:
    return ConvSpec(False, int(weight.shape[1]), int(weight.shape[0]), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1),
                    (0, 0), 1, "zeros", bias is not None)


def _format(x) -> Optional[torch.memory_format]:
    """``x``'s dense memory format (NCHW or NHWC), None for any other strides."""
    if x.is_contiguous():
        return torch.contiguous_format
    return torch.channels_last if conv_op.nhwc(x) else None


def _upsample_format(x) -> torch.memory_format:
    return _format(x) or torch.contiguous_format


_UPSAMPLE_ARGS = "(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, str activation) -> Tensor"


@library.op("upsample_conv_routed" + _UPSAMPLE_ARGS)
def upsample_conv_routed(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         residual: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    """``act(conv3x3(F.interpolate(x, scale_factor=2)) + residual)`` as a
    recipe's folded upsample runs it eagerly: the four 2x2 convs of ``x``
    (``dispatch.upsample_conv_with``) where that pays
    (``dispatch.subpixel_pays``), else the conv of the upsampled input, both
    through the one dispatch entry on call sites of this weight."""
    site = dispatch.call_site(_upsample_spec(weight, bias), weight, bias)
    y = None
    if dispatch.subpixel_pays(x, weight):
        y = dispatch.upsample_conv_with(site, weight, bias, x, residual, activation)
    if y is None:
        up = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        y = dispatch.conv_with(site, weight, bias, Call(up, residual, activation=activation,
                                                        fallback_args=(weight, bias)))
    # One layout whichever way it ran (the fake's).
    y = y.contiguous(memory_format=_upsample_format(x))
    return y.clone() if y is residual else y


@library.fake(upsample_conv_routed)
def _(x, weight, bias, residual, activation):
    n, _, h, w = x.shape
    return torch.empty((n, weight.shape[0], 2 * h, 2 * w), dtype=x.dtype, device=x.device,
                       memory_format=_upsample_format(x))


@library.composite("upsample_conv" + _UPSAMPLE_ARGS)
def upsample_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  residual: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    """Traced, PyTorch's interpolate, conv and eager epilogue where neither
    the folded convs (``dispatch.subpixel_pays``) nor the kernels on the
    upsampled input (``kernels_may_take``) would run, where a gradient is
    needed, or in a graph replayed as CUDA graphs; else the routed op."""
    spec = _upsample_spec(weight, bias)
    n, c, h, w = x.shape
    # (Symbolic sizes: the routed op, which decides per call; the size
    # test of the folded convs would guard on them.)
    static = not any(isinstance(d, torch.SymInt) for d in (n, c, h, w))
    if (needs_grad(x, weight, bias, residual) or replayed_as_cuda_graphs(x)
            or static and not dispatch.subpixel_pays(x, weight) and not kernels_may_take(
                spec, x, weight, bias, residual, activation=activation, shape=(n, c, 2 * h, 2 * w))):
        up = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        return eager_epilogue(spec.torch_forward(up, weight, bias), residual, 1.0, activation, 1.0)
    return upsample_conv_routed(x, weight, bias, residual, activation)


def upsample_call(module, x, residual=None, activation="none") -> torch.Tensor:
    """The folded-upsample op for patched 3x3 conv ``module`` (what a
    recipe's upsample step runs under tracing)."""
    return upsample_conv(x, module.weight, module.bias, residual, activation)


# -- GroupNorm -------------------------------------------------------------------------
@library.op("group_norm(Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps, str activation, "
            "Tensor? input_bias, Tensor? scale, Tensor? shift) -> Tensor")
def group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float, activation: str, input_bias: Optional[torch.Tensor], scale: Optional[torch.Tensor],
               shift: Optional[torch.Tensor]) -> torch.Tensor:
    """``ops.group_norm.group_norm`` (modulated by ``scale``, ``shift`` where
    given) as one opaque op of a compiled graph: the pass the eager model
    runs, in place of the ``native_group_norm`` and activation Inductor
    would build for it (those are the eager decode's slow steps, and on an
    NHWC activation Inductor's are slower still), planned and replayed
    through the one dispatch entry on a ``dispatch.NormSite`` as a fused
    block's norm is (a replayed call costs a fraction of a launch through
    the kernels' Python launchers)."""
    mod = None if scale is None else (scale, shift)
    y = dispatch.group_norm(dispatch.norm_site(num_groups, weight, bias, eps), x, activation,
                            input_bias=input_bias, modulation=mod)
    # One layout whichever way it ran (the fake's).
    y = y.contiguous(memory_format=group_norm_op.output_format(x))
    return y.clone() if y is x else y


@library.fake(group_norm)
def _(x, num_groups, weight, bias, eps, activation, input_bias, scale, shift):
    return torch.empty_like(x, memory_format=group_norm_op.output_format(x))


def traced_group_norm(norm, x: torch.Tensor, activation: str = "none", input_bias: Optional[torch.Tensor] = None,
                      modulation: Optional[tuple] = None) -> Optional[torch.Tensor]:
    """A GroupNorm module's call under torch.compile tracing: the op above
    where the kernels would take it eagerly (a kernel target for ``x``'s
    device, a kernel dtype, no autograd, no autocast, modulation of ``x``'s
    shape, and on a GPU a size where the kernels pay,
    ``costs.group_norm_pays``), else None (the caller traces the eager
    expression)."""
    num_groups, weight, bias, eps = norm.num_groups, norm.weight, norm.bias, norm.eps
    tensors = (x, weight, bias, input_bias) + (() if modulation is None else tuple(modulation))
    target = target_for(x.device)
    if (x.dim() not in (4, 5) or x.numel() == 0 or x.dtype not in KERNEL_DTYPES or needs_grad(*tensors)
            or torch.is_autocast_enabled(x.device.type) or not target.kernels
            or not (target.interpreter or costs.group_norm_pays(x.numel(), x.shape[0] * num_groups))
            or x.shape[1] % num_groups
            or any(t is not None and t.device != x.device for t in tensors)
            or (modulation is not None and any(t.shape != x.shape for t in modulation))):
        return None
    scale, shift = (None, None) if modulation is None else modulation
    return group_norm(x, int(num_groups), weight, bias, float(eps), activation, input_bias, scale, shift)


# -- whole blocks: a fused block the compiled graph runs as patched eager -----------
# A big VAE half (``Recipe.whole_from``) runs eagerly at several times
# the unpatched speed; traced op by op, Inductor's glue between the ops and
# each op's host cost made it slower than that eager run. Such a block is one
# op in the graph: its eager fused forward, planned and replayed as eagerly.
# The op names the block by ``id`` (Dynamo bakes the value in and guards the
# registry's membership); a block is registered when fused (and when copied
# or unpickled, which rebuilds it through its recipe), never while traced.
_WHOLE: dict = {}
_CALLS = {"whole_block": 0}
# A compiled graph runs a whole block's forward inside the op, never its
# call: the forward pre-hook that compiles the kernels ahead at a first call
# (``PatchConfig.compile_ahead``) ran only while traced, where it does
# nothing. The api layer registers that pass here (``on_first_whole_call``);
# the op makes it at each block's first call in the process, so a cold
# compiled call compiles the block's kernels side by side, as an eager one.
_FIRST_PASS: list = []
_PASSED: "weakref.WeakSet" = weakref.WeakSet()


def whole_block_calls() -> int:
    """How many ``whole_block`` calls have run in this process."""
    return _CALLS["whole_block"]


def register_whole(block) -> None:
    """Let ``block`` run as one op when traced (``traced_block``)."""
    key = id(block)

    def gone(ref, key=key):
        if _WHOLE.get(key) is ref:
            del _WHOLE[key]
    _WHOLE[key] = weakref.ref(block, gone)


def on_first_whole_call(fn) -> None:
    """``fn(block, args)`` runs before the first ``whole_block`` call of
    each block in this process (the api layer's first-call pass)."""
    _FIRST_PASS[:] = [fn]


def _whole(key: int):
    ref = _WHOLE.get(key)
    block = None if ref is None else ref()
    if block is None:
        raise RuntimeError("conv_patch::whole_block: the block this compiled graph was traced with is gone "
                           "(compile the model again)")
    return block


# Never captured in a CUDA graph (reduce-overhead mode): the eager forward
# makes packs and plans at its first call and keeps them across calls, which a
# graph tree's memory pool refuses. Inductor runs it between captured parts.
@library.op("whole_block(int block, Tensor x) -> Tensor", tags=(library.CUDAGRAPH_UNSAFE,))
def whole_block(block: int, x: torch.Tensor) -> torch.Tensor:
    """The registered block's fused forward on ``x``, run as eagerly (its
    pack group, plans and replays), in ``x``'s memory format."""
    _CALLS["whole_block"] += 1
    m = _whole(block)
    if _FIRST_PASS and m not in _PASSED:
        _PASSED.add(m)
        _FIRST_PASS[0](m, (x,))
    y = m.forward(x)
    y = y.contiguous(memory_format=_format(x))
    return y.clone() if y is x else y


@library.fake(whole_block)
def _(block, x):
    # The output's shape and dtype: the block's unpatched computation on the
    # fake input, every conv-patch component under it run as its own class
    # for the while (PyTorch's ops only: the patched paths read tensors'
    # addresses, which a fake tensor has none of). The block's parameters
    # are real tensors, which the fake mode takes as constants here.
    m = _whole(block)
    swaps = passthrough.own_class_swaps([c for c in m.modules() if c is not m])
    mode = x.fake_mode
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        y = passthrough.run_unfused(m, swaps, lambda: m.cp_own_forward(x))
    finally:
        mode.allow_non_fake_inputs = allowed
    return torch.empty(y.shape, dtype=y.dtype, device=y.device, memory_format=_format(x))


def traced_block(block, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """A fused block's call under torch.compile tracing: ``whole_block``
    for a registered block called on one 4-D tensor of a kernel dtype, in a
    dense layout, of at least its recipe's ``whole_from`` pixels (N·H·W;
    with dynamic shapes a guard: a size across the bound compiles again), with
    no autograd, no autocast, on a kernel target, in a torch that can keep
    the op out of CUDA graphs; else None (the caller traces the block's
    recipe)."""
    if kwargs or len(args) != 1 or library.CUDAGRAPH_UNSAFE is None or id(block) not in _WHOLE:
        return None
    x = args[0]
    if (not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in KERNEL_DTYPES
            or _format(x) is None or not target_for(x.device).kernels
            or x.shape[0] * x.shape[2] * x.shape[3] < block.cp_recipe.whole_from
            or torch.is_autocast_enabled(x.device.type)
            or (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in block.parameters())))):
        return None
    return whole_block(id(block), x)
