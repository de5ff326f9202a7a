"""The wrappers that stand in for patched convolutions.

A wrapper is a real ``nn.Conv2d`` / ``nn.ConvTranspose2d`` / ``nn.Conv3d`` (so ``isinstance``
checks in PEFT, diffusers and ComfyUI still match) built from the original
module's ``__dict__``: the ``_parameters``, ``_buffers``, ``_modules`` and hook
dictionaries are the *same objects* as the original's, so ``state_dict()`` keys,
the Parameter objects, ``load_state_dict``, ``.to()``, and hooks behave exactly
as before, and ``remove()`` can hand the original object back holding the
current weights. The original is kept outside ``_modules`` (it must not add
state_dict keys) and its class's ``forward`` is the fallback.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from conv_patch.activations import activation_code, eager_epilogue, per_channel
from conv_patch.routing.decide import RouteDecision, decide, fallback
from conv_patch.runtime import dispatch, pack, planner
from conv_patch.call import Call
from conv_patch.runtime.plans import eager
from conv_patch.runtime.state import STATE, State, state_of
from conv_patch.specs import Conv3dSpec, ConvSpec
from conv_patch.target import target_for

# Everything conv-patch keeps on a wrapper is its ``State`` (under this
# prefix), never copied back to the original.
PRIVATE = "_cp"


TRAINING_SLOPES = fallback("PReLU slopes that need autograd (the kernels record none)")
COMFY_CASTING = fallback("ComfyUI weight casting or patching active")


class PatchedConvMixin:
    """Behaviour shared by the wrappers; mixed in before the torch class.

    A wrapper may also be constructed like its torch class
    (``PatchedConv2d(in, out, k)``): PEFT builds its LoRA convs as
    ``type(base_layer)(...)``. Such a module has no original; its fallback is
    the torch class's forward and ``unwrap`` makes a plain torch module.
    """

    # The ``cp_`` names are conv-patch's protocol on a patched module, read by
    # the runtime, the recipes and the tools (``cp_torch_class``,
    # ``cp_comfy_class``, ``cp_call``, ``cp_forward``, ``cp_fallback_forward``,
    # ``cp_own_class``; a fused block has ``cp_base``, ``cp_recipe``,
    # ``cp_run``): prefixed so they never meet a name of the class they are
    # mixed into.
    cp_torch_class = nn.Module
    cp_transposed = False

    @classmethod
    def wrap(cls, original: nn.Module, table=None):
        self = cls.__new__(cls)
        self.__dict__.update(original.__dict__)
        self.__dict__[STATE] = State(original=original, table=table)
        return self

    def unwrap(self) -> nn.Module:
        """The original module, given every public attribute of the wrapper
        (training flag, edited hyper-parameters, attributes set since)."""
        orig = state_of(self).original
        if orig is None:
            orig = self.cp_torch_class.__new__(self.cp_torch_class)
        for k, v in self.__dict__.items():
            if not k.startswith(PRIVATE):
                orig.__dict__[k] = v
        if parametrize.is_parametrized(self):
            orig.__class__ = parametrized_class(type(orig), type(self))
        pack.release(self)
        return orig

    # -- routing -----------------------------------------------------------
    @property
    def spec(self) -> ConvSpec:
        """The conv's description, rebuilt after any attribute assignment."""
        st = state_of(self)
        if st.spec is None:
            st.spec = ConvSpec.from_module(self)
        return st.spec

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if not name.startswith(PRIVATE):
            dispatch.clear(self)

    def route(self, x: Optional[torch.Tensor] = None, residual=None, output_padding=None) -> RouteDecision:
        """The route this module takes for input ``x`` (the decision weighed
        against PyTorch as called), or, without ``x``, the kernel family it
        is eligible for."""
        if x is None:
            return decide(self.spec)
        call = Call(x, residual, output_padding=output_padding)
        return planner.decide_call(self, call, self.weight, self.bias, x.is_cuda and pack.on_graph_path(x))[0]

    # Whether the class can be a ComfyUI conv (``is_comfy_conv_class``): only
    # then can ComfyUI cast or patch its weights per call.
    cp_comfy_class = False

    def cp_comfy_active(self) -> bool:
        return self.cp_comfy_class and comfy_active(self)

    def per_channel_eager(self, act) -> bool:
        """Whether a PReLU epilogue must run as PyTorch's ops: its slopes
        train (the kernel plans record no autograd; the weight's and the
        bias's own are in the call's signature). ValueError where the slopes
        do not fit the output's channels."""
        if not act.fits(self.out_channels):
            raise ValueError(f"{act!r}: {act.module.weight.numel()} slopes for a conv of "
                             f"{self.out_channels} output channels")
        return act.module.weight.requires_grad and torch.is_grad_enabled()

    def cp_call(self, call: Call):
        """The call through the one dispatch entry; ``call.out`` (inference
        only; may be the residual) receives the result."""
        if call.activation != "none":
            activation_code(call.activation, per_channel=True)
            if per_channel(call.activation) and self.per_channel_eager(call.activation):
                state_of(self).last = TRAINING_SLOPES
                return eager(self, call, call.padding)
        x = call.x
        if torch.compiler.is_compiling():
            from conv_patch.runtime import compiled
            if (call.padding is None and not call.no_bias and isinstance(call.activation, str)
                    and compiled.takes(self, x, call.residual)):
                # One opaque custom op in the graph; it routes when it runs
                # (its schema carries an activation's name: not PReLU's slopes).
                y = compiled.call(self, call)
                return y if call.out is None else call.out.copy_(y)
            # The op has no backward: Dynamo traces the original forward.
            return eager(self, call, call.padding)
        if self.cp_comfy_class and comfy_active(self):
            # The computation must use the per-call weight ComfyUI builds, never
            # a pack of the stored parameter: the original forward does that.
            state_of(self).last = COMFY_CASTING
            return eager(self, call, call.padding)
        return dispatch.conv(self, call)

    def call_with_epilogue(self, x, residual=None, beta=1.0, activation="none", out_scale=1.0, out=None,
                           padding=None):
        """``out_scale * act(self(F.pad(x, padding)) + beta * residual)``
        into ``out`` when given, without the module's hooks (the caller's
        business): the bare fast path where PyTorch's route was planned for
        such a call (no ``out``, no padding of its own), else the planned
        call. The one body of ``forward`` and of the recipes' conv steps."""
        if out is None and padding is None and not (self.cp_comfy_class and comfy_active(self)):
            y = dispatch.bare_call(self, x, activation, residual, beta, out_scale)
            if y is not None:
                return y
        return self.cp_call(Call(x, residual, beta, activation, out_scale, out, padding))

    def forward_without_bias(self, x):
        """``(y, b)`` with ``y + b`` (``b`` [C_out], per channel) equal to
        ``self(x)``: where the kernels or the table's cuDNN route take the
        call, ``y`` is computed without the bias and ``b`` is ``self.bias``,
        for the GroupNorm that reads ``y`` next to fold in
        (``ops.group_norm(input_bias=...)``): on the cuDNN route the bias
        costs a pass over the output of its own. Elsewhere ``(self(x), None)``.
        Hooks are the caller's business: a hook would see ``y`` without its
        bias."""
        if self.bias is None or self.cp_transposed or torch.compiler.is_compiling() or self.cp_comfy_active():
            return self(x), None
        return self.cp_call(Call(x, no_bias=True))

    def cp_own_class(self) -> Optional[type]:
        """The class this wrapper runs as when ``runtime.passthrough``
        passes it through: its original's. None for a parametrized weight
        (the wrapper's class holds the parametrization)."""
        if parametrize.is_parametrized(self):
            return None
        orig = state_of(self).original
        return type(orig) if orig is not None else self.cp_torch_class

    @property
    def cp_fallback_forward(self):
        """The original module's class's forward (unbound): what a call the
        kernels do not take runs."""
        orig = state_of(self).original
        return type(orig).forward if orig is not None else self.cp_torch_class.forward

    def cp_forward(self, x, *args):
        """The original module's own forward on ``x``."""
        return self.cp_fallback_forward(self, x, *args)

    # -- nn.Module plumbing --------------------------------------------------
    def _apply(self, fn, *args, **kwargs):
        # A weight that moves or changes dtype drops its pack now rather than
        # at the next call (a model offloaded to the CPU frees its GPU packs).
        pack.release(self)
        dispatch.clear(self)
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        last = state_of(self).last
        label = last.label() if last is not None else self.route().label()
        return f"{super().extra_repr()}, route={label}"


class PatchedConv2d(PatchedConvMixin, nn.Conv2d):
    """``forward(x, *, residual=None, beta=1.0, activation="none", out_scale=1.0, out=None)``
    computes ``out_scale * act(conv(x) + bias + beta * residual)`` (into
    ``out`` when given, which may be ``residual``); with the defaults it is
    the plain convolution."""

    cp_torch_class = nn.Conv2d

    def forward(self, input, *, residual=None, beta=1.0, activation="none", out_scale=1.0, out=None):
        # call_with_epilogue's body, one frame less on the commonest call.
        if out is None and not self.cp_comfy_class:
            y = dispatch.bare_call(self, input, activation, residual, beta, out_scale)
            if y is not None:
                return y
            return self.cp_call(Call(input, residual, beta, activation, out_scale))
        return self.call_with_epilogue(input, residual, beta, activation, out_scale, out)


def parametrized_class(cls: type, parametrized: type) -> type:
    """``cls`` as torch's parametrize makes it for a module it parametrizes,
    with the parametrized tensors of class ``parametrized`` (a wrapper's
    class after ``register_parametrization``): a subclass holding the same
    class dictionary, i.e. each tensor's property and parametrize's
    ``__getstate__`` / ``__deepcopy__``. The parametrizations themselves are
    in ``_modules``, which the original shares with its wrapper; and
    ``remove_parametrizations`` restores ``__bases__[0]``, here ``cls``."""
    own = {k: v for k, v in vars(parametrized).items()
           if not k.startswith("__") or k in ("__getstate__", "__deepcopy__")}
    name = parametrized.__name__.replace(parametrized.__bases__[0].__name__, cls.__name__, 1)
    return type(name, (cls,), dict(own, __module__=parametrized.__module__, __qualname__=name))


_COMFY_ATTRS = ("comfy_cast_weights", "weight_function", "bias_function")


def comfy_active(m) -> bool:
    """ComfyUI is casting this module's weights per call (low-VRAM) or
    patching them (``weight_function``/``bias_function``, e.g. LoRA).
    Read from the instance's and the class's dictionaries: a plain
    ``getattr`` of a missing name goes through ``nn.Module.__getattr__`` and
    an AttributeError, microseconds on every call of every conv."""
    d, cls = m.__dict__, type(m)
    return any(d[a] if a in d else getattr(cls, a, None) for a in _COMFY_ATTRS)


def is_comfy_conv_class(cls: type) -> bool:
    """ComfyUI's conv classes (``comfy.ops.disable_weight_init.Conv2d``,
    ``manual_cast.Conv2d``, and copies in custom nodes) override ``forward``
    with a known contract: they compute like their torch base unless
    ``comfy_cast_weights`` or a weight/bias function is set. Recognised by
    structure, not import path, so ComfyUI need not be importable."""
    return (hasattr(cls, "comfy_cast_weights") and hasattr(cls, "weight_function")
            and callable(getattr(cls, "forward_comfy_cast_weights", None)))


def _defined_by(cls: type, name: str) -> Optional[type]:
    """The class of ``cls``'s MRO whose own dictionary holds ``name``."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _comfy_ops_class(c: Optional[type]) -> bool:
    """``c`` is one of ComfyUI's ops classes itself (it defines
    ``forward_comfy_cast_weights``), not a class built on one."""
    return c is not None and "forward_comfy_cast_weights" in vars(c) and is_comfy_conv_class(c)


def comfy_conv_forward(cls: type) -> bool:
    """``cls``'s ``_conv_forward`` is ComfyUI's own (its ``Conv3d`` defines
    one; ``apply`` takes it on a Conv3d only): the base class's convolution, with cuDNN called directly behind a
    workaround flag (the same conv for zero padding, the only padding mode
    ``apply`` takes for a Conv3d), and the time taps cut to the input's
    frames only under ``autopad="causal_zero"``, which only ComfyUI's
    forward passes on (``PatchedComfyConv3d`` hands such a call to it)."""
    return _comfy_ops_class(_defined_by(cls, "_conv_forward"))


def plain_comfy_conv3d(cls: type) -> bool:
    """``cls`` is ComfyUI's ``Conv3d`` (``comfy.ops.disable_weight_init``'s,
    ``manual_cast``'s, or a class that only changes its attributes): its
    ``forward`` is that of one of ComfyUI's ops classes."""
    return (isinstance(cls, type) and issubclass(cls, nn.Conv3d) and is_comfy_conv_class(cls)
            and _comfy_ops_class(_defined_by(cls, "forward")))


_DYNAMIC: dict = {}


def wrapper_class_for(cls: type) -> type:
    """The wrapper class of a convolution class. For a ComfyUI conv class it
    is a subclass of both our wrapper and that class: ComfyUI's model patcher
    finds modules by ``hasattr(m, "comfy_cast_weights")``, and the class's own
    ``forward`` (our fallback) calls ``super().forward``, which needs ``self``
    to be an instance of it."""
    if cls is nn.Conv2d or cls is PatchedConv2d:
        return PatchedConv2d
    if cls is nn.ConvTranspose2d or cls is PatchedConvTranspose2d:
        return PatchedConvTranspose2d
    if cls is nn.Conv3d or cls is PatchedConv3d:
        return PatchedConv3d
    if issubclass(cls, nn.Conv3d):
        # The only Conv3d subclasses apply() takes: time-chunked and causal
        # ones (safe_conv3d_problem, causal_conv3d_problem) and ComfyUI's own
        # Conv3d (plain_comfy_conv3d).
        if safe_conv3d_problem(cls) is None:
            base = PatchedSafeConv3d
        elif plain_comfy_conv3d(cls):
            base = PatchedComfyConv3d
        else:
            base = PatchedCausalConv3d
    else:
        base = PatchedConvTranspose2d if issubclass(cls, nn.ConvTranspose2d) else PatchedConv2d
    if cls not in _DYNAMIC:
        _DYNAMIC[cls] = type(f"Patched{cls.__name__}", (base, cls), {
            "cp_torch_class": cls, "cp_comfy_class": is_comfy_conv_class(cls), "__module__": __name__,
            "__qualname__": f"Patched{cls.__name__}",
            "__doc__": f"conv-patch wrapper of {cls.__module__}.{cls.__qualname__}.",
            "__reduce_ex__": _reduce_dynamic,
        })
    return _DYNAMIC[cls]


def _reduce_dynamic(self, protocol):
    # Dynamic classes cannot be found by name when unpickling: rebuild them
    # from the original class, which can.
    return (_rebuild_dynamic, (self.cp_torch_class,), self.__getstate__())


def _rebuild_dynamic(cls):
    return wrapper_class_for(cls).__new__(wrapper_class_for(cls))


class PatchedConvTranspose2d(PatchedConvMixin, nn.ConvTranspose2d):
    """Same extended call as PatchedConv2d, after ConvTranspose2d's own
    ``output_size`` argument."""

    cp_torch_class = nn.ConvTranspose2d
    cp_transposed = True

    def forward(self, input, output_size=None, *, residual=None, beta=1.0, activation="none",
                out_scale=1.0):
        output_padding = None
        if output_size is not None:
            output_padding = tuple(self._output_padding(
                input, output_size, self.stride, self.padding, self.kernel_size, 2, self.dilation))
        return self.cp_call(Call(input, residual, beta, activation, out_scale, output_padding=output_padding,
                                  fallback_args=(output_size,)))


class PatchedConv3d(PatchedConvMixin, nn.Conv3d):
    """``forward(x, *, cache=None, residual=None, beta=1.0, activation="none", out_scale=1.0)``:
    ``out_scale * act(conv(cat([cache, x], 2)) + bias + beta * residual)``;
    with the defaults the plain convolution. Routed by ``dispatch.conv3d``."""

    cp_torch_class = nn.Conv3d

    @property
    def spec(self) -> Conv3dSpec:
        st = state_of(self)
        if st.spec is None:
            st.spec = Conv3dSpec.from_module(self, self.cp_own_pads())
        return st.spec

    def cp_own_pads(self):
        return None

    def route(self, x: Optional[torch.Tensor] = None, residual=None, output_padding=None) -> RouteDecision:
        """The route of input ``x`` (the decision as called), or, without
        ``x``, the kernel family the module is eligible for."""
        if x is None:
            return decide(self.spec)
        return planner.decide_conv3d(self, self.spec, Call(x, residual), self.weight, self.bias, False, False,
                                     target_for(x.device))

    def forward(self, input, *, cache=None, residual=None, beta=1.0, activation="none", out_scale=1.0):
        if activation != "none":
            activation_code(activation)

        def own():
            return self.cp_fallback_forward(self, input if cache is None else torch.cat([cache, input], 2))
        if torch.compiler.is_compiling():
            return eager_epilogue(own(), residual, beta, activation, out_scale)
        if self.cp_comfy_active():
            state_of(self).last = COMFY_CASTING
            return eager_epilogue(own(), residual, beta, activation, out_scale)
        return dispatch.conv3d(self, Call(input, residual, beta, activation, out_scale, cache=cache, own=own))

    def forward_without_bias(self, x):
        return self(x), None


class PatchedComfyConv3d(PatchedConv3d):
    """The wrapper of ComfyUI's own Conv3d (``plain_comfy_conv3d``): a plain
    Conv3d's call, routed as one, where ComfyUI neither casts nor patches
    the weight (``cp_comfy_active``: the class's forward builds the per-call
    weight) and the call passes nothing of ComfyUI's own
    (``autopad="causal_zero"``, which cuts the time taps to a single
    frame's): such a call runs the class's forward."""

    def forward(self, input, *args, cache=None, residual=None, beta=1.0, activation="none", out_scale=1.0,
                **kwargs):
        if args or kwargs:
            state_of(self).last = fallback(f"ComfyUI's own arguments ({', '.join(kwargs) or 'positional'})")
            x = input if cache is None else torch.cat([cache, input], 2)
            return eager_epilogue(self.cp_fallback_forward(self, x, *args, **kwargs), residual, beta, activation,
                                  out_scale)
        return super().forward(input, cache=cache, residual=residual, beta=beta, activation=activation,
                               out_scale=out_scale)


class PatchedCausalConv3d(PatchedConv3d):
    """The wrapper of a video VAE's causal Conv3d (``causal_conv3d_problem``
    says which): ``forward(x, cache_x=None)`` as the module computes it (and
    ComfyUI's ``cache_list``/``cache_idx``, which hand over the cached frames
    by list slot and clear it), the cached frames and the front time padding
    read in place by the kernel instead of ``torch.cat`` and ``F.pad``
    copies. ``causal`` is the same call with the fused epilogue."""

    def cp_own_pads(self):
        pw0, pw1, ph0, ph1, pt0, pt1 = self._padding
        return (pt0, pt1), (ph0, ph1), (pw0, pw1)

    def forward(self, x, cache_x=None, cache_list=None, cache_idx=None):
        if cache_list is not None:
            cache_x = cache_list[cache_idx]
            cache_list[cache_idx] = None
        return self.causal(x, cache_x)

    def causal(self, x, cache_x=None, *, residual=None, beta=1.0, activation="none", out_scale=1.0):
        """``out_scale * act(self(x, cache_x) + beta * residual)``."""
        def own():
            return self.cp_fallback_forward(self, x, cache_x)
        if torch.compiler.is_compiling() or x.dim() != 5:
            return eager_epilogue(own(), residual, beta, activation, out_scale)
        if self.cp_comfy_active():
            state_of(self).last = COMFY_CASTING
            return eager_epilogue(own(), residual, beta, activation, out_scale)
        (pt0, pt1), hw_h, hw_w = self.cp_own_pads()
        cache = None
        if cache_x is not None and pt0 > 0:
            # The module pads time by what the cached frames do not cover.
            if cache_x.dim() != 5 or cache_x.device != x.device:
                return eager_epilogue(own(), residual, beta, activation, out_scale)
            cache, pt0 = cache_x, pt0 - cache_x.shape[2]
        if pt0 < 0:
            # More cached frames than padding: F.pad would crop them.
            return eager_epilogue(own(), residual, beta, activation, out_scale)
        return dispatch.conv3d(self, Call(x, residual, beta, activation, out_scale, cache=cache,
                                          pads=((pt0, pt1), hw_h, hw_w), own=own))


class PatchedSafeConv3d(PatchedConv3d):
    """The wrapper of a time-chunked Conv3d (``safe_conv3d_problem`` says
    which: diffusers' ``CogVideoXSafeConv3d``, CogVideoX's and Mochi's
    convs): its forward is ``nn.Conv3d``'s, computed in chunks of frames
    where the input passes a size (so that cuDNN never sees more than 2 GiB
    in one call). A call under that size is the plain conv and is routed like
    one; a larger one runs the class's own chunked forward."""

    # The class's rule: chunk where 2 bytes an element exceed 2 GiB.
    CHUNKED_GIB = 2.0

    def forward(self, input, *, cache=None, residual=None, beta=1.0, activation="none", out_scale=1.0):
        elements = input.numel() + (0 if cache is None else cache.numel())
        if elements * 2 / 1024 ** 3 > self.CHUNKED_GIB:
            x = input if cache is None else torch.cat([cache, input], 2)
            return eager_epilogue(self.cp_fallback_forward(self, x), residual, beta, activation, out_scale)
        return super().forward(input, cache=cache, residual=residual, beta=beta, activation=activation,
                               out_scale=out_scale)


def safe_conv3d_problem(cls: type) -> Optional[str]:
    """Why ``cls`` is not a time-chunked Conv3d class, or None: an
    ``nn.Conv3d`` subclass named ``*SafeConv3d`` whose ``forward(input)``
    takes the input alone and that leaves ``_conv_forward`` as it is (the
    class computes ``nn.Conv3d.forward`` chunk by chunk)."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Conv3d) and cls.__name__.endswith("SafeConv3d")):
        return "not a time-chunked Conv3d"
    try:
        names = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return "forward has no readable signature"
    if len(names) != 2 or names[0] != "self":
        return "forward is not forward(input)"
    if cls._conv_forward is not nn.Conv3d._conv_forward:
        return "overrides _conv_forward"
    return None


def causal_conv3d_problem(m: nn.Module) -> Optional[str]:
    """Why ``m`` is not a causal Conv3d of the Wan family (diffusers'
    ``WanCausalConv3d``, ComfyUI's ``CausalConv3d``), or None. Recognised by
    structure: ``forward(x, cache_x=None)`` (ComfyUI's also takes
    ``cache_list=None, cache_idx=None``: the cached frames by list slot),
    which puts ``cache_x`` in front of ``x`` along time where it pads time
    and then pads by ``_padding`` (F.pad order, the time entries last, front
    only, less the cached frames), with the module's own ``padding`` zero."""
    cls = type(m)
    if not (isinstance(m, nn.Conv3d) and cls.__name__.endswith("CausalConv3d")):
        return "not a causal Conv3d"
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return "forward has no readable signature"
    names = [p.name for p in params]
    if (names not in (["self", "x", "cache_x"], ["self", "x", "cache_x", "cache_list", "cache_idx"])
            or any(p.default is not None for p in params[2:])):
        return "forward is not forward(x, cache_x=None[, cache_list=None, cache_idx=None])"
    pad = m.__dict__.get("_padding")
    if not (isinstance(pad, (tuple, list)) and len(pad) == 6 and all(isinstance(v, int) and v >= 0 for v in pad)):
        return "no _padding of six non-negative ints"
    if pad[5] != 0:
        return "pads time at the back too"
    if tuple(m.padding) != (0, 0, 0):
        return "pads through padding as well as _padding"
    return None
