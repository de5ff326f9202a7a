"""diffusers' ``Transformer2DModel``, a UNet's spatial transformer (SD1.x,
SD2.x, SDXL, ControlNet): the GroupNorm, the projections in and out (1x1
convs or linears) and the ``BasicTransformerBlock`` stack between them.

Launched eagerly a UNet is host-bound (its GPU work about half of its call
on an H100, docs/performance.md), and these blocks hold most of its Python:
a stack of module calls per token block, and diffusers' ``Attention.forward``
reads its processor's call signature through ``inspect`` at every call. The
projections stay on PyTorch's route there, so the block is idle and the
passthrough runs it as its own class; this recipe's ``lean`` mixin,
``LeanTransformer2D``, is that class's forward then: the same ops in the
same order on the same values (bit for bit), called as the functions the
parts' forwards call, with the residual sums written in place. It runs only
for the configuration written out below, recognised at every call (exact
diffusers classes, ``AttnProcessor2_0``, no masks, no extra arguments, no
hooks, no gradient recorded); any other call runs the class's own forward.

On the graph path and under torch.compile (host time is not the cost there)
the block runs its own forward with its convs patched."""

from __future__ import annotations

import inspect
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .fuse import Recipe, bare, base, global_hooks, named, register

# The forwards written out below, by diffusers class name, with the
# parameter names each one's contract was read from; a class whose forward
# takes others (another diffusers version) is not run lean.
_CONTRACTS = {
    "Transformer2DModel": ("self", "hidden_states", "encoder_hidden_states", "timestep", "added_cond_kwargs",
                           "class_labels", "cross_attention_kwargs", "attention_mask", "encoder_attention_mask",
                           "return_dict"),
    "BasicTransformerBlock": ("self", "hidden_states", "attention_mask", "encoder_hidden_states",
                              "encoder_attention_mask", "timestep", "cross_attention_kwargs", "class_labels",
                              "added_cond_kwargs"),
    "Attention": ("self", "hidden_states", "encoder_hidden_states", "attention_mask", "cross_attention_kwargs"),
    "FeedForward": ("self", "hidden_states", "args", "kwargs"),
    "GEGLU": ("self", "hidden_states", "args", "kwargs"),
    "GELU": ("self", "hidden_states"),
    "AttnProcessor2_0": ("self", "attn", "hidden_states", "encoder_hidden_states", "attention_mask", "temb",
                         "args", "kwargs"),
}
_METHOD = {"AttnProcessor2_0": "__call__"}
# (class, its method) -> the class's name in _CONTRACTS, or None: read once
# per class and per method object, so a forward replaced at run time (a
# wrapper some library installs) is read again, and not run lean.
_KINDS: Dict[tuple, Optional[str]] = {}


def kind(obj) -> Optional[str]:
    """The name of ``obj``'s class in ``_CONTRACTS`` where the class is
    exactly diffusers' one with that contract, else None."""
    return kind_of(type(obj))


def kind_of(cls: type) -> Optional[str]:
    name = cls.__name__
    fn = cls.__dict__.get(_METHOD.get(name, "forward"))
    key = (cls, fn)
    k = _KINDS.get(key, 0)
    if k == 0:
        k = name if _written_out(cls, name, fn) else None
        _KINDS[key] = k
    return k


def _written_out(cls: type, name: str, fn) -> bool:
    """``cls`` is diffusers' class ``name`` with its own method ``fn`` as
    diffusers defines it (not a wrapper) and the parameters read above."""
    if name not in _CONTRACTS or not cls.__module__.startswith("diffusers.") or not inspect.isfunction(fn):
        return False
    if hasattr(fn, "__wrapped__") or not fn.__module__.startswith("diffusers."):
        return False
    try:
        params = tuple(inspect.signature(fn, follow_wrapped=False).parameters)
    except (TypeError, ValueError):
        return False
    return params == _CONTRACTS[name]


def _plain(m) -> bool:
    """A diffusers module the lean forward reads its parts from: no hooks."""
    return not m._forward_hooks and not m._forward_pre_hooks


def _bare_linear(m) -> bool:
    return bare(m, nn.Linear)


def _bare_conv1x1(m) -> bool:
    return bare(m, nn.Conv2d) and m.padding_mode == "zeros"


def _eval_dropout(m) -> bool:
    return bare(m, nn.Dropout) and not m.training


def _attr(m, name):
    """``m.name`` read from the dictionaries (a module or a plain value)."""
    d = m.__dict__
    mods = d["_modules"]
    return mods[name] if name in mods else d.get(name)


def _attention_ok(a, cross: bool) -> bool:
    if kind(a) != "Attention" or not _plain(a) or kind(a.__dict__.get("processor")) != "AttnProcessor2_0":
        return False
    d, mods = a.__dict__, a.__dict__["_modules"]
    out = mods.get("to_out")
    if (_attr(a, "spatial_norm") is not None or _attr(a, "group_norm") is not None
            or _attr(a, "norm_q") is not None or _attr(a, "norm_k") is not None
            or (cross and _attr(a, "norm_cross") is not None) or d.get("residual_connection") is not False
            or not isinstance(d.get("rescale_output_factor"), (int, float)) or type(out) is not nn.ModuleList
            or len(out) != 2):
        return False
    o = out._modules
    return (_bare_linear(mods.get("to_q")) and _bare_linear(mods.get("to_k")) and _bare_linear(mods.get("to_v"))
            and _bare_linear(o["0"]) and _eval_dropout(o["1"]))


def _ff_ok(ff) -> bool:
    if kind(ff) != "FeedForward" or not _plain(ff):
        return False
    net = ff.__dict__["_modules"].get("net")
    if type(net) is not nn.ModuleList:
        return False
    for m in net._modules.values():
        k = kind(m)
        if k in ("GEGLU", "GELU"):
            if not _plain(m) or not _bare_linear(m.__dict__["_modules"].get("proj")):
                return False
        elif not (_bare_linear(m) or _eval_dropout(m)):
            return False
    return True


def _block_ok(b, cross: bool) -> bool:
    if kind(b) != "BasicTransformerBlock" or not _plain(b):
        return False
    d, mods = b.__dict__, b.__dict__["_modules"]
    a2 = mods.get("attn2")
    return (d.get("norm_type") == "layer_norm" and _attr(b, "pos_embed") is None
            and d.get("_chunk_size") is None and d.get("only_cross_attention") is False
            and bare(mods.get("norm1"), nn.LayerNorm) and bare(mods.get("norm3"), nn.LayerNorm)
            and _attention_ok(mods.get("attn1"), False)
            and (a2 is None or (bare(mods.get("norm2"), nn.LayerNorm) and _attention_ok(a2, cross)))
            and _ff_ok(mods.get("ff")))


def lean_ok(t, x, ctx) -> bool:
    """Whether ``LeanTransformer2D`` computes what ``t``'s own forward does
    for a call on ``x`` with the text states ``ctx`` (the caller has checked
    the arguments)."""
    d, mods = t.__dict__, t.__dict__["_modules"]
    if (d.get("training", True) or not d.get("is_input_continuous") or torch.is_grad_enabled() or global_hooks() or x.device.type not in ("cuda", "cpu")):
        return False
    lin = d.get("use_linear_projection")
    proj = _bare_linear if lin else _bare_conv1x1
    blocks = mods.get("transformer_blocks")
    if (not bare(mods.get("norm"), nn.GroupNorm) or not proj(mods.get("proj_in")) or not proj(mods.get("proj_out"))
            or type(blocks) is not nn.ModuleList):
        return False
    cross = ctx is not None
    return all([_block_ok(b, cross) for b in blocks._modules.values()])


def _linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    p = m._parameters
    return F.linear(x, p["weight"], p["bias"])


def _conv(m: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    p = m._parameters
    return F.conv2d(x, p["weight"], p["bias"], m.stride, m.padding, m.dilation, m.groups)


def _layer_norm(m: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def _add(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``a + x`` with ``a`` a tensor the caller made: in place where that
    gives the same tensor (same shape, dtype, device and strides)."""
    if a.shape == x.shape and a.dtype == x.dtype and a.device == x.device and a.stride() == x.stride():
        return a.add_(x)
    return a + x


def _attention(a, x: torch.Tensor, ctx: Optional[torch.Tensor]) -> torch.Tensor:
    """``AttnProcessor2_0`` on 3-D tokens, no mask (``_attention_ok``)."""
    mods = a.__dict__["_modules"]
    src = x if ctx is None else ctx
    b = src.shape[0]
    q = _linear(mods["to_q"], x)
    k = _linear(mods["to_k"], src)
    v = _linear(mods["to_v"], src)
    heads = a.__dict__["heads"]
    d = k.shape[-1] // heads
    q = q.view(b, -1, heads, d).transpose(1, 2)
    k = k.view(b, -1, heads, d).transpose(1, 2)
    v = v.view(b, -1, heads, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
    # (diffusers' ``.to(query.dtype)`` after it is the identity: SDPA
    # returns its query's dtype.)
    o = o.transpose(1, 2).reshape(b, -1, heads * d)
    o = _linear(mods["to_out"]._modules["0"], o)
    scale = a.__dict__["rescale_output_factor"]
    return o if scale == 1 else o / scale


def _feed_forward(ff, h: torch.Tensor) -> torch.Tensor:
    for m in ff.__dict__["_modules"]["net"]._modules.values():
        k = kind(m)
        if k == "GEGLU":
            h, gate = _linear(m.__dict__["_modules"]["proj"], h).chunk(2, dim=-1)
            h = h * F.gelu(gate)
        elif k == "GELU":
            h = F.gelu(_linear(m.__dict__["_modules"]["proj"], h), approximate=m.__dict__["approximate"])
        elif type(m) is nn.Linear:
            h = _linear(m, h)
        # else an eval dropout: the identity
    return h


def _block(b, x: torch.Tensor, ctx: Optional[torch.Tensor]) -> torch.Tensor:
    mods = b.__dict__["_modules"]
    x = _add(_attention(mods["attn1"], _layer_norm(mods["norm1"], x), None), x)
    a2 = mods.get("attn2")
    if a2 is not None:
        x = _add(_attention(a2, _layer_norm(mods["norm2"], x), ctx), x)
    return _add(_feed_forward(mods["ff"], _layer_norm(mods["norm3"], x)), x)


class LeanTransformer2D:
    """``Transformer2DModel.forward`` for a block passed through
    (``Recipe.lean``), on continuous inputs with ``return_dict=False`` (how a
    UNet calls it); the module docstring says when it runs."""

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None, added_cond_kwargs=None,
                class_labels=None, cross_attention_kwargs=None, attention_mask=None,
                encoder_attention_mask=None, return_dict=True):
        x, ctx = hidden_states, encoder_hidden_states
        if (return_dict is not False or timestep is not None or added_cond_kwargs is not None
                or class_labels is not None or cross_attention_kwargs or attention_mask is not None
                or encoder_attention_mask is not None or not isinstance(x, torch.Tensor) or x.dim() != 4
                or not (ctx is None or isinstance(ctx, torch.Tensor) and ctx.dim() == 3)
                or not lean_ok(self, x, ctx)):
            return super().forward(hidden_states, encoder_hidden_states, timestep, added_cond_kwargs, class_labels,
                                   cross_attention_kwargs, attention_mask, encoder_attention_mask, return_dict)
        mods = self.__dict__["_modules"]
        b, _, height, width = x.shape
        n = mods["norm"]
        h = F.group_norm(x, n.num_groups, n.weight, n.bias, n.eps)
        linear = self.__dict__["use_linear_projection"]
        if linear:
            inner = h.shape[1]
            h = _linear(mods["proj_in"], h.permute(0, 2, 3, 1).reshape(b, height * width, inner))
        else:
            h = _conv(mods["proj_in"], h)
            inner = h.shape[1]
            h = h.permute(0, 2, 3, 1).reshape(b, height * width, inner)
        for blk in mods["transformer_blocks"]._modules.values():
            h = _block(blk, h, ctx)
        if linear:
            h = _linear(mods["proj_out"], h).reshape(b, height, width, inner).permute(0, 3, 1, 2).contiguous()
        else:
            h = h.reshape(b, height, width, inner).permute(0, 3, 1, 2).contiguous()
            h = _conv(mods["proj_out"], h)
        # diffusers: ``hidden_states + residual``
        return (_add(h, x),)


class Transformer2D(Recipe):
    """No fused forward: the block's own one, its convs patched; passed
    through as ``LeanTransformer2D`` (see the module docstring)."""

    name = "diffusers.Transformer2DModel"
    what = "passed through as its own forward in fewer Python calls (LeanTransformer2D)"
    lean = LeanTransformer2D

    def match(self, m):
        cls = getattr(type(m), "cp_base", type(m))
        blocks = getattr(m, "transformer_blocks", None)
        return (named(m, "Transformer2DModel") and kind_of(cls) == "Transformer2DModel"
                and getattr(m, "is_input_continuous", False) is True and isinstance(blocks, nn.ModuleList)
                and len(blocks) > 0 and all(named(b, "BasicTransformerBlock") for b in blocks))

    def forward(self, m, *args, **kwargs):
        return base(m, *args, **kwargs)


TRANSFORMER_2D = register(Transformer2D())
