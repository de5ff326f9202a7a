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
parts' forwards call, with the residual sums written in place. Each part is
recognised at every call (the exact diffusers class with the forward
written out here, ``AttnProcessor2_0``, the configuration, no hooks) and
run inline, or else called as a module, as its parent's forward would (a
LoRA layer, a hooked or replaced part, another attention processor). A call
with masks or extra arguments, with a gradient recorded or global hooks
set, runs the class's own forward.

On the graph path and under torch.compile (host time is not the cost there)
the block runs its own forward with its convs patched."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .fuse import (Recipe, bare, base, global_hooks, hookless, inline_conv, inline_linear, inline_norm, named,
                   register, sum_into, written_out)

# The forwards written out below, by diffusers class name, with the
# parameter names each one's contract was read from; a class whose forward
# takes others (another diffusers version), or a forward replaced at run
# time, is not run inline (``fuse.written_out``).
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


def kind(obj) -> Optional[str]:
    """The name of ``obj``'s class in ``_CONTRACTS`` where the class is
    exactly diffusers' one with that contract, else None."""
    return kind_of(type(obj))


def kind_of(cls: type) -> Optional[str]:
    name = cls.__name__
    params = _CONTRACTS.get(name)
    if params is None or not written_out(cls, _METHOD.get(name, "forward"), params, "diffusers."):
        return None
    return name


def _attr(m, name):
    """``m.name`` read from the dictionaries (a module or a plain value)."""
    d = m.__dict__
    mods = d["_modules"]
    return mods[name] if name in mods else d.get(name)


# Each part below is run inline or called as a module as ``fuse``'s lean
# steps say (``inline_conv`` and the rest).

def _dropout(m, x: torch.Tensor) -> tuple:
    """(output, whether it is the input itself): an eval dropout is the identity."""
    if bare(m, nn.Dropout) and not m.training:
        return x, True
    return m(x), False


def _attention_inline(a, cross: bool) -> bool:
    """``a`` is diffusers' ``Attention`` with ``AttnProcessor2_0`` in the
    configuration ``_attention`` writes out (no norms, no residual)."""
    if kind(a) != "Attention" or not hookless(a) or kind(a.__dict__.get("processor")) != "AttnProcessor2_0":
        return False
    d = a.__dict__
    out = d["_modules"].get("to_out")
    return (_attr(a, "spatial_norm") is None and _attr(a, "group_norm") is None and _attr(a, "norm_q") is None
            and _attr(a, "norm_k") is None and not (cross and _attr(a, "norm_cross") is not None)
            and d.get("residual_connection") is False and isinstance(d.get("rescale_output_factor"), (int, float))
            and type(out) is nn.ModuleList and len(out) == 2)


def _attention(a, x: torch.Tensor, ctx: Optional[torch.Tensor]) -> tuple:
    """``a(x, encoder_hidden_states=ctx)`` on 3-D tokens, no mask: inline,
    ``AttnProcessor2_0``'s steps, where ``_attention_inline``."""
    if not _attention_inline(a, ctx is not None):
        return a(x, encoder_hidden_states=ctx, attention_mask=None), False
    mods = a.__dict__["_modules"]
    src = x if ctx is None else ctx
    b = src.shape[0]
    q = inline_linear(mods["to_q"], x)[0]
    k = inline_linear(mods["to_k"], src)[0]
    v = inline_linear(mods["to_v"], src)[0]
    heads = a.__dict__["heads"]
    d = k.shape[-1] // heads
    q = q.view(b, -1, heads, d).transpose(1, 2)
    k = k.view(b, -1, heads, d).transpose(1, 2)
    v = v.view(b, -1, heads, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
    # (diffusers' ``.to(query.dtype)`` after it is the identity: SDPA
    # returns its query's dtype.)
    o = o.transpose(1, 2).reshape(b, -1, heads * d)
    out = mods["to_out"]._modules
    o, mine = inline_linear(out["0"], o)
    o, same = _dropout(out["1"], o)
    mine = mine and same
    scale = a.__dict__["rescale_output_factor"]
    return (o, mine) if scale == 1 else (o / scale, True)


def _feed_forward(ff, h: torch.Tensor) -> tuple:
    if kind(ff) != "FeedForward" or not hookless(ff) or type(_attr(ff, "net")) is not nn.ModuleList:
        return ff(h), False
    mine = False  # (the input: a norm's output, made here or not)
    for m in ff.__dict__["_modules"]["net"]._modules.values():
        k = kind(m)
        if k == "GEGLU" and hookless(m):
            h, gate = inline_linear(m.__dict__["_modules"]["proj"], h)[0].chunk(2, dim=-1)
            h, mine = h * F.gelu(gate), True
        elif k == "GELU" and hookless(m):
            proj = m.__dict__["_modules"]["proj"]
            h, mine = F.gelu(inline_linear(proj, h)[0], approximate=m.__dict__["approximate"]), True
        elif type(m) is nn.Dropout:
            h, same = _dropout(m, h)
            mine = mine and same
        else:
            h, mine = inline_linear(m, h) if type(m) is nn.Linear else (m(h), False)
    return h, mine


def _block_inline(b) -> bool:
    """``b`` is diffusers' ``BasicTransformerBlock`` in the configuration
    ``_block`` writes out (layer norms, no positional embedding, no chunked
    feed-forward, self-attention then optional cross-attention)."""
    if kind(b) != "BasicTransformerBlock" or not hookless(b):
        return False
    d = b.__dict__
    return (d.get("norm_type") == "layer_norm" and _attr(b, "pos_embed") is None and d.get("_chunk_size") is None
            and d.get("only_cross_attention") is False)


def _block(b, x: torch.Tensor, ctx: Optional[torch.Tensor], cross_attention_kwargs) -> torch.Tensor:
    """``b``'s call as ``Transformer2DModel`` makes it, with no masks,
    timestep or class labels (``cross_attention_kwargs`` None or empty)."""
    if not _block_inline(b):
        return b(x, attention_mask=None, encoder_hidden_states=ctx, encoder_attention_mask=None, timestep=None,
                 cross_attention_kwargs=cross_attention_kwargs, class_labels=None)
    mods = b.__dict__["_modules"]
    x = sum_into(*_attention(mods["attn1"], inline_norm(mods["norm1"], x), None), x)
    a2 = mods.get("attn2")
    if a2 is not None:
        x = sum_into(*_attention(a2, inline_norm(mods["norm2"], x), ctx), x)
    return sum_into(*_feed_forward(mods["ff"], inline_norm(mods["norm3"], x)), x)


class LeanTransformer2D:
    """``Transformer2DModel.forward`` for a block passed through
    (``Recipe.lean``), on continuous inputs with ``return_dict=False`` (how a
    UNet calls it); the module docstring says when it runs."""

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None, added_cond_kwargs=None,
                class_labels=None, cross_attention_kwargs=None, attention_mask=None,
                encoder_attention_mask=None, return_dict=True):
        x, ctx = hidden_states, encoder_hidden_states
        d = self.__dict__
        mods = d["_modules"]
        blocks = mods.get("transformer_blocks")
        if (return_dict is not False or timestep is not None or added_cond_kwargs is not None
                or class_labels is not None or cross_attention_kwargs or attention_mask is not None
                or encoder_attention_mask is not None or not isinstance(x, torch.Tensor) or x.dim() != 4
                or not (ctx is None or isinstance(ctx, torch.Tensor) and ctx.dim() == 3)
                or d.get("training", True) or not d.get("is_input_continuous") or type(blocks) is not nn.ModuleList
                or torch.is_grad_enabled() or global_hooks() or x.device.type not in ("cuda", "cpu")):
            return super().forward(hidden_states, encoder_hidden_states, timestep, added_cond_kwargs, class_labels,
                                   cross_attention_kwargs, attention_mask, encoder_attention_mask, return_dict)
        b, _, height, width = x.shape
        h = inline_norm(mods["norm"], x)
        linear = d["use_linear_projection"]
        if linear:
            inner = h.shape[1]
            h = inline_linear(mods["proj_in"], h.permute(0, 2, 3, 1).reshape(b, height * width, inner))[0]
        else:
            h = inline_conv(mods["proj_in"], h)[0]
            inner = h.shape[1]
            h = h.permute(0, 2, 3, 1).reshape(b, height * width, inner)
        for blk in blocks._modules.values():
            h = _block(blk, h, ctx, cross_attention_kwargs)
        if linear:
            h, mine = inline_linear(mods["proj_out"], h)
            y = h.reshape(b, height, width, inner).permute(0, 3, 1, 2).contiguous()
            mine = mine or y.data_ptr() != h.data_ptr()
        else:
            y, mine = inline_conv(mods["proj_out"], h.reshape(b, height, width, inner).permute(0, 3, 1, 2).contiguous())
        # diffusers: ``hidden_states + residual``
        return (sum_into(y, mine, x),)


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
