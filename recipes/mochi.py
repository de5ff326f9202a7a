"""Mochi 1's VAE blocks (diffusers' ``AutoencoderKLMochi``):
``MochiResnetBlock3D``. Matched by class name and structure.

Its norm (``MochiChunkedGroupNorm3D``) is a GroupNorm of every frame on its
own: the clip permuted to [B*T, C, H, W] (a copy), normalised in chunks of
frames, the chunks' outputs concatenated (another copy), then permuted back
as a view. Its convs are CogVideoX's causal convs, called as the block calls
them (``apply`` patches the Conv3d inside them by its contract).
"""

from __future__ import annotations

import torch

from .fuse import Recipe, base, group_norm, inference, is_group_norm, is_silu, named, parts, plain, register


def _frame_norm(m) -> bool:
    """A ``MochiChunkedGroupNorm3D``: its ``norm_layer`` a GroupNorm."""
    return named(m, "MochiChunkedGroupNorm3D") and is_group_norm(parts(m, "norm_layer")[0])


def _frame_norm_silu(m, x: torch.Tensor) -> torch.Tensor:
    """``silu(m(x))``: every frame's GroupNorm and the SiLU as one pass over
    the frames (the norm's statistics are per sample, here per frame), into
    one output, no chunk outputs and no concatenation; the output the same
    [B, C, T, H, W] view of [B*T, C, H, W] memory the module hands on."""
    b = x.shape[0]
    frames = x.permute(0, 2, 1, 3, 4).flatten(0, 1)
    if not (frames.is_contiguous() or frames.is_contiguous(memory_format=torch.channels_last)):
        # (A view of an NCDHW clip: the kernels read dense frames, and
        # PyTorch's GroupNorm makes this copy too.)
        frames = frames.contiguous()
    y = group_norm(parts(m, "norm_layer")[0], frames, "silu")
    return y.unflatten(0, (b, -1)).permute(0, 2, 1, 3, 4)


class ResnetBlock3D(Recipe):
    """Each per-frame GroupNorm and the SiLU after it as one pass; the
    causal convs and their conv caches as the block calls them."""

    name = "mochi.ResnetBlock3D"
    what = "per-frame GroupNorm+SiLU passes, no chunk copies"

    def match(self, m):
        norm1, norm2, act, conv1, conv2 = parts(m, "norm1", "norm2", "nonlinearity", "conv1", "conv2")
        return (named(m, "MochiResnetBlock3D") and _frame_norm(norm1) and _frame_norm(norm2) and is_silu(act)
                and named(conv1, "CogVideoXCausalConv3d") and named(conv2, "CogVideoXCausalConv3d"))

    def forward(self, m, inputs, conv_cache=None, *args, **kwargs):
        norm1, norm2, act, conv1, conv2 = parts(m, "norm1", "norm2", "nonlinearity", "conv1", "conv2")
        gns = (parts(norm1, "norm_layer")[0], parts(norm2, "norm_layer")[0])
        if (args or kwargs or not hasattr(inputs, "dim") or inputs.dim() != 5 or not inference(inputs, *gns)
                or not plain(norm1, norm2, *gns, act)):
            return base(m, inputs, conv_cache, *args, **kwargs)
        new_cache = {}
        conv_cache = conv_cache or {}
        # Each intermediate rebound before the next conv, as the block's own
        # forward does: conv1's output kept alive through conv2 would be one
        # more full-size clip at the decode's peak.
        h = _frame_norm_silu(norm1, inputs)
        h, new_cache["conv1"] = conv1(h, conv_cache=conv_cache.get("conv1"))
        h = _frame_norm_silu(norm2, h)
        h, new_cache["conv2"] = conv2(h, conv_cache=conv_cache.get("conv2"))
        return h + inputs, new_cache


RESNET = register(ResnetBlock3D())
