"""The original latent-diffusion VAE modules (``ResnetBlock``, ``Upsample``,
``Downsample``, ``Encoder``, ``Decoder``) as ComfyUI
(``comfy.ldm.modules.diffusionmodules.model``), stable-diffusion-sdkit and
the SD/SGM repositories carry them. Matched by class name and structure, so
every copy is recognised and none needs to be importable."""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from .fuse import (Recipe, attention, base, conv, dropout_is_identity, from_tokens, group_norm, inference,
                   is_conv, is_group_norm, is_silu, matches, named, plain, register, resnet, to_tokens,
                   upsample_conv)
from . import diffusers
from .diffusers import NHWCInside, tail_layer
from .layers import Conv, Layers, Resnet, Up, Whole, need, own_pad, plus


@functools.lru_cache(maxsize=None)
def _module_swish(modname: str) -> bool:
    """The ldm files apply ``nonlinearity(x)``, a module-level function, not a
    submodule; it is checked to *be* SiLU on probe values, not assumed."""
    fn = getattr(sys.modules.get(modname), "nonlinearity", None)
    if not callable(fn):
        return False
    probe = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        return bool(torch.allclose(fn(probe), F.silu(probe), rtol=1e-12, atol=1e-12))
    except Exception:  # noqa: BLE001 - any failure means "not SiLU"
        return False


def _silu_of(m) -> bool:
    # ComfyUI's copy holds ``self.swish = nn.SiLU(inplace=True)``.
    if hasattr(m, "swish"):
        return is_silu(m.swish)
    return _module_swish(getattr(type(m), "cp_base", type(m)).__module__)


def _shortcut(m):
    if m.in_channels == m.out_channels:
        return None
    return m.conv_shortcut if m.use_conv_shortcut else m.nin_shortcut


class ResnetBlock(Recipe):
    """As diffusers.ResnetBlock2D: GroupNorm+SiLU passes, ``x + conv2(h)``
    in conv2's epilogue, the shortcut conv as its own kernel."""

    name = "ldm.ResnetBlock"
    what = "GroupNorm+SiLU, residual in conv2's epilogue"

    def match(self, m):
        if not (named(m, "ResnetBlock") and all(hasattr(m, a) for a in (
                "norm1", "conv1", "norm2", "conv2", "dropout", "in_channels", "out_channels", "use_conv_shortcut"))):
            return False
        try:
            sc = _shortcut(m)
        except AttributeError:
            return False
        return (is_group_norm(m.norm1) and is_group_norm(m.norm2) and is_conv(m.conv1, 3, 1, 1)
                and is_conv(m.conv2, 3, 1, 1) and (sc is None or is_conv(sc)) and _silu_of(m))

    def forward(self, m, x, temb=None):
        sc = _shortcut(m)
        if (temb is not None or x.dim() != 4 or not dropout_is_identity(m.dropout)
                or not inference(x, m.norm1, m.norm2, m.conv1, m.conv2, sc)
                or not plain(m.norm1, m.norm2, m.dropout, getattr(m, "swish", None))):
            return base(m, x, temb)
        return resnet(x, m.norm1, m.conv1, m.norm2, m.conv2, sc)


class AttnBlock(Recipe):
    """The mid-block self-attention: GroupNorm kernel, the q/k/v 1x1 convs
    in NHWC read as tokens without a copy, ``ops.attention`` (one head of
    all channels), ``x + proj_out(h)`` in proj_out's epilogue. ComfyUI's
    copy picks its attention function at runtime; all of them compute
    ``softmax(q k^T / sqrt(C)) v``."""

    name = "ldm.AttnBlock"
    what = "GroupNorm kernel, token views, blocked attention, residual in proj_out's epilogue"

    def match(self, m):
        return (named(m, "AttnBlock") and is_group_norm(getattr(m, "norm", None))
                and all(is_conv(getattr(m, p, None), 1, 1, 0) for p in ("q", "k", "v", "proj_out")))

    def forward(self, m, x):
        parts = (m.norm, m.q, m.k, m.v, m.proj_out)
        if x.dim() != 4 or not inference(x, *parts) or not plain(m.norm):
            return base(m, x)
        b, c, h, w = x.shape
        hn = group_norm(m.norm, x)
        q, k, v = (to_tokens(conv(p, hn)) for p in (m.q, m.k, m.v))
        return conv(m.proj_out, from_tokens(attention(q, k, v), h, w), residual=x)


class WithConv(Recipe):
    """ldm ``Upsample`` (nearest x2, then a 3x3 conv) and ``Downsample``
    (``F.pad(x, (0, 1, 0, 1))``, then a stride-2 3x3 conv) with
    ``with_conv=True``: ``step(conv, x)`` does the pair in one go."""

    def __init__(self, name, cls_name, stride, padding, what, step):
        self.name, self.cls_name, self.stride, self.padding, self.what = name, cls_name, stride, padding, what
        self.step = step

    def match(self, m):
        return named(m, self.cls_name) and getattr(m, "with_conv", False) is True and is_conv(
            getattr(m, "conv", None), 3, self.stride, self.padding)

    def forward(self, m, x):
        if x.dim() != 4:
            return base(m, x)
        return self.step(m.conv, x)

    def upsample_convs(self, m):
        return (m.conv,) if self.step is upsample_conv else ()


def _padded_conv(c, x):
    return conv(c, x, padding=(0, 1, 0, 1))


def _resnet_layer(r) -> Resnet:
    need(matches(RESNET, r), f"{type(r).__name__} is not an ldm ResnetBlock")
    return Resnet(r.norm1, r.conv1, r.norm2, r.conv2, _shortcut(r), 1.0)


def _attn_layers(a) -> list:
    if type(a).__name__ == "Identity":
        return []
    need(isinstance(a, torch.nn.Module), "unknown attention")
    return [Whole(a)]


def _mid_layers(m) -> list:
    return [_resnet_layer(m.mid.block_1), *_attn_layers(m.mid.attn_1), _resnet_layer(m.mid.block_2)]


class Decoder(NHWCInside):
    """The ldm ``Decoder`` (NHWC inside), and its layers for bands."""

    whole_from = diffusers.Decoder.whole_from  # (the same VAE half)

    def bands(self, m) -> Layers:
        need(not getattr(m, "give_pre_end", False) and not getattr(m, "tanh_out", False),
             "give_pre_end / tanh_out are not taken")
        need(_silu_of(m) and is_conv(m.conv_in, 3, 1, 1), "unknown ldm Decoder")
        steps = [Conv(m.conv_in, own_pad(m.conv_in)), *_mid_layers(m)]
        for lvl in reversed(range(m.num_resolutions)):
            up = m.up[lvl]
            for j, b in enumerate(up.block):
                steps.append(_resnet_layer(b))
                if len(up.attn) > 0:
                    steps += _attn_layers(up.attn[j])
            if lvl != 0:
                need(matches(UPSAMPLE, up.upsample), "an Upsample has no conv")
                steps.append(Up(up.upsample.conv))
        steps.append(tail_layer(m.norm_out, m.conv_out, True))
        return Layers("decoder", steps)


class Encoder(NHWCInside):
    """The ldm ``Encoder`` (NHWC inside), and its layers for bands."""

    whole_from = diffusers.Encoder.whole_from

    def bands(self, m) -> Layers:
        need(_silu_of(m) and is_conv(m.conv_in, 3, 1, 1), "unknown ldm Encoder")
        steps = [Conv(m.conv_in, own_pad(m.conv_in))]
        for lvl in range(m.num_resolutions):
            down = m.down[lvl]
            for j, b in enumerate(down.block):
                steps.append(_resnet_layer(b))
                if len(down.attn) > 0:
                    steps += _attn_layers(down.attn[j])
            if lvl != m.num_resolutions - 1:
                need(matches(DOWNSAMPLE, down.downsample), "a Downsample has no conv (avg-pool)")
                steps.append(Conv(down.downsample.conv, plus(own_pad(down.downsample.conv), (0, 1, 0, 1))))
        steps += _mid_layers(m)
        steps.append(tail_layer(m.norm_out, m.conv_out, True))
        return Layers("encoder", steps)


RESNET = register(ResnetBlock())
ATTN = register(AttnBlock())
UPSAMPLE = register(WithConv("ldm.Upsample", "Upsample", 1, 1, "upsample folded into the conv", upsample_conv))
DOWNSAMPLE = register(WithConv("ldm.Downsample", "Downsample", 2, 0, "asymmetric pad folded into the stride-2 conv",
                               _padded_conv))
DECODER = register(Decoder("ldm.Decoder", "Decoder", ("conv_in", "mid", "up", "conv_out")))
ENCODER = register(Encoder("ldm.Encoder", "Encoder", ("conv_in", "mid", "down", "conv_out")))
