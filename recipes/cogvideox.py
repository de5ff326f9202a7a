"""CogVideoX's VAE blocks (diffusers' ``AutoencoderKLCogVideoX``; Mochi's
VAE shares its causal convs): ``CogVideoXResnetBlock3D``. Matched by class
name and structure.

The block's convs (``CogVideoXCausalConv3d``, with their ``conv_cache``) are
called as they are: ``apply`` patches the Conv3d inside them by its contract.
What the recipe fuses is around them: each norm and the SiLU after it as one
pass of the GroupNorm kernels (on the 5-D input's 4-D view), the decoder's
spatial norm (``CogVideoXSpatialNorm3D``: ``GroupNorm(f) * conv_y(zq) +
conv_b(zq)``) with its modulation in the same pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fuse import (Recipe, base, dropout_is_identity, group_norm, inference, is_group_norm, is_silu, named,
                   parts, plain, register, spatial_norm_parts)


def _spatial_norm_parts(m):
    """(norm_layer, conv_y, conv_b) of a ``CogVideoXSpatialNorm3D``, or None."""
    return spatial_norm_parts(m, "CogVideoXSpatialNorm3D", lambda c: c is not None)


def _zq_like(zq: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``zq`` resized to ``f``'s frames and pixels as the spatial norm does
    (an odd clip's first frame resized on its own)."""
    if f.shape[2] > 1 and f.shape[2] % 2 == 1:
        first = F.interpolate(zq[:, :, :1], size=f[:, :, :1].shape[-3:])
        rest = F.interpolate(zq[:, :, 1:], size=f[:, :, 1:].shape[-3:])
        return torch.cat([first, rest], dim=2)
    return F.interpolate(zq, size=f.shape[-3:])


def _norm_silu(norm, h, zq, cache):
    """``silu(norm(h[, zq]))`` and the spatial norm's new conv cache (None
    for a plain GroupNorm): one GroupNorm pass with the modulation and the
    SiLU in it."""
    if zq is None:
        return group_norm(norm, h, "silu"), None
    gn, conv_y, conv_b = _spatial_norm_parts(norm)
    cache = cache or {}
    z = _zq_like(zq, h)
    new = {}
    y, new["conv_y"] = conv_y(z, conv_cache=cache.get("conv_y"))
    b, new["conv_b"] = conv_b(z, conv_cache=cache.get("conv_b"))
    return group_norm(gn, h, "silu", modulation=(y, b)), new


class ResnetBlock3D(Recipe):
    """GroupNorm (the decoder's spatial norm with its modulation) and SiLU
    in one pass each; the causal convs and their caches as the block calls
    them."""

    name = "cogvideox.ResnetBlock3D"
    what = "GroupNorm(+spatial modulation)+SiLU passes"

    def match(self, m):
        norm1, norm2, act, drop, conv1, conv2 = parts(m, "norm1", "norm2", "nonlinearity", "dropout", "conv1",
                                                      "conv2")
        plain_norms = is_group_norm(norm1) and is_group_norm(norm2)
        spatial = _spatial_norm_parts(norm1) is not None and _spatial_norm_parts(norm2) is not None
        return (named(m, "CogVideoXResnetBlock3D") and (plain_norms or spatial) and is_silu(act)
                and isinstance(drop, nn.Dropout) and named(conv1, "CogVideoXCausalConv3d")
                and named(conv2, "CogVideoXCausalConv3d"))

    def forward(self, m, inputs, temb=None, zq=None, conv_cache=None, *args, **kwargs):
        norm1, norm2, act, drop, conv1, conv2, sc, proj = parts(
            m, "norm1", "norm2", "nonlinearity", "dropout", "conv1", "conv2", "conv_shortcut", "temb_proj")
        spatial = _spatial_norm_parts(norm1) is not None
        norms = (norm1, norm2) + ((_spatial_norm_parts(norm1)[0], _spatial_norm_parts(norm2)[0]) if spatial else ())
        if (args or kwargs or not hasattr(inputs, "dim") or inputs.dim() != 5 or (zq is not None) != spatial
                or not dropout_is_identity(drop) or not inference(inputs, *norms)
                or (zq is not None and torch.is_grad_enabled()) or not plain(*norms, act, drop)):
            return base(m, inputs, temb, zq, conv_cache, *args, **kwargs)
        new_cache = {}
        conv_cache = conv_cache or {}
        h, c = _norm_silu(norm1, inputs, zq, conv_cache.get("norm1"))
        if c is not None:
            new_cache["norm1"] = c
        h, new_cache["conv1"] = conv1(h, conv_cache=conv_cache.get("conv1"))
        if temb is not None:
            h = h + proj(act(temb))[:, :, None, None, None]
        h, c = _norm_silu(norm2, h, zq, conv_cache.get("norm2"))
        if c is not None:
            new_cache["norm2"] = c
        h, new_cache["conv2"] = conv2(h, conv_cache=conv_cache.get("conv2"))
        if m.in_channels != m.out_channels:
            if m.use_conv_shortcut:
                inputs, new_cache["conv_shortcut"] = sc(inputs, conv_cache=conv_cache.get("conv_shortcut"))
            else:
                inputs = sc(inputs)
        return h + inputs, new_cache


RESNET = register(ResnetBlock3D())
