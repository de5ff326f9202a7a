"""HunyuanVideo's VAE blocks (diffusers' ``AutoencoderKLHunyuanVideo``):
``HunyuanVideoResnetBlockCausal3D``. Matched by class name and structure.

Its causal convs (``HunyuanVideoCausalConv3d``) pad with
``time_causal_padding`` in ``pad_mode`` (replicate: the edge frames and
pixels repeated), then run a Conv3d of no padding of its own, which
``apply`` patches; the pad stays PyTorch's.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .fuse import (Recipe, base, conv3d, dropout_is_identity, group_norm, inference, is_group_norm, is_silu,
                   named, parts, plain, register)


def _causal(m, k: int) -> bool:
    """A ``HunyuanVideoCausalConv3d`` with a k x k x k Conv3d of stride 1,
    dilation 1 and no padding of its own (the block's convs)."""
    conv, pad, mode = parts(m, "conv", "time_causal_padding", "pad_mode")
    return (named(m, "HunyuanVideoCausalConv3d") and isinstance(conv, nn.Conv3d)
            and tuple(conv.kernel_size) == (k, k, k) and tuple(conv.stride) == (1, 1, 1)
            and tuple(conv.padding) == (0, 0, 0) and tuple(conv.dilation) == (1, 1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros" and isinstance(pad, tuple) and len(pad) == 6
            and isinstance(mode, str))


def _conv(m, x, residual=None):
    """``m(x) + residual``: its pad, then its Conv3d with the residual added
    in the conv's epilogue where it is patched (a pass of its own saved)."""
    conv, pad, mode = parts(m, "conv", "time_causal_padding", "pad_mode")
    return conv3d(conv, F.pad(x, pad, mode=mode), residual=residual)


class ResnetBlockCausal3D(Recipe):
    """GroupNorm+SiLU in one pass each (the kernels on the 5-D input's 4-D
    view), the shortcut added in conv2's epilogue."""

    name = "hunyuan.ResnetBlockCausal3D"
    what = "GroupNorm+SiLU passes, shortcut in conv2's epilogue"

    def match(self, m):
        norm1, conv1, norm2, conv2, sc, act, drop = parts(
            m, "norm1", "conv1", "norm2", "conv2", "conv_shortcut", "nonlinearity", "dropout")
        return (named(m, "HunyuanVideoResnetBlockCausal3D") and is_group_norm(norm1) and is_group_norm(norm2)
                and _causal(conv1, 3) and _causal(conv2, 3) and (sc is None or _causal(sc, 1)) and is_silu(act)
                and isinstance(drop, nn.Dropout))

    def forward(self, m, hidden_states, *args, **kwargs):
        norm1, conv1, norm2, conv2, sc, act, drop = parts(
            m, "norm1", "conv1", "norm2", "conv2", "conv_shortcut", "nonlinearity", "dropout")
        x = hidden_states
        convs = [c.__dict__["_modules"]["conv"] for c in (conv1, conv2, sc) if c is not None]
        if (args or kwargs or not hasattr(x, "dim") or x.dim() != 5 or not dropout_is_identity(drop)
                or not inference(x, norm1, norm2, *convs) or not plain(norm1, act, conv1, norm2, drop, conv2, sc)):
            return base(m, hidden_states, *args, **kwargs)
        x = x.contiguous()
        h = _conv(conv1, group_norm(norm1, x, "silu"))
        h = group_norm(norm2, h, "silu")
        return _conv(conv2, h, residual=x if sc is None else _conv(sc, x))


RESNET = register(ResnetBlockCausal3D())
