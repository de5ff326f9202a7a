"""LTX-Video's VAE blocks (diffusers' ``AutoencoderKLLTXVideo``):
``LTXVideoResnetBlock3d``. Matched by class name and structure.

Its norms are diffusers' ``RMSNorm`` over the channels, called on a
channels-last permutation of the activation; its causal convs
(``LTXVideoCausalConv3d``) put ``k - 1`` copies of the first frame in front
of the clip (a concatenated copy of the whole clip), then run a Conv3d that
``apply`` patches.
"""

from __future__ import annotations

from torch import nn

from .fuse import (Recipe, base, channel_rms_norm, conv3d, dropout_is_identity, inference, is_silu,
                   last_axis_rms_norm_params, named, parts, plain, register)


def _causal(m, k: int) -> bool:
    """An ``LTXVideoCausalConv3d`` with a k x k x k Conv3d of stride 1 and
    dilation 1."""
    conv = parts(m, "conv")[0]
    return (named(m, "LTXVideoCausalConv3d") and isinstance(conv, nn.Conv3d)
            and tuple(conv.kernel_size) == (k, k, k) and tuple(conv.stride) == (1, 1, 1)
            and tuple(conv.dilation) == (1, 1, 1) and tuple(conv.padding)[0] == 0
            and isinstance(m.__dict__.get("is_causal"), bool))


def _conv(m, x, residual=None):
    """``m(x) + residual``. Causal, through the Conv3d's cached frames
    (``fuse.conv3d``): the first frame's ``k - 1`` copies are the frames
    before ``x``, read in place of the module's concatenated copy of the
    clip where the conv is patched, the residual added in its epilogue."""
    conv = parts(m, "conv")[0]
    kt = conv.kernel_size[0]
    if m.__dict__["is_causal"]:
        return conv3d(conv, x, cache=x[:, :, :1].repeat(1, 1, kt - 1, 1, 1) if kt > 1 else None, residual=residual)
    y = m(x)
    return y if residual is None else y + residual


class ResnetBlock3d(Recipe):
    """RMS norm+SiLU in one pass each over the channels (no permuted
    copies), the causal convs' first-frame padding read as cached frames,
    the shortcut added in conv2's epilogue. Blocks with timestep
    conditioning or noise injection run their own forward."""

    name = "ltx.ResnetBlock3d"
    what = "RMS norm+SiLU passes, causal padding as cached frames, shortcut in conv2's epilogue"

    def match(self, m):
        norm1, conv1, norm2, conv2, sc, act, drop = parts(
            m, "norm1", "conv1", "norm2", "conv2", "conv_shortcut", "nonlinearity", "dropout")
        return (named(m, "LTXVideoResnetBlock3d") and last_axis_rms_norm_params(norm1) is not None
                and last_axis_rms_norm_params(norm2) is not None and _causal(conv1, 3) and _causal(conv2, 3)
                and (sc is None or _causal(sc, 1)) and is_silu(act) and isinstance(drop, nn.Dropout))

    def forward(self, m, inputs, temb=None, generator=None, *args, **kwargs):
        norm1, conv1, norm2, conv2, norm3, sc, act, drop = parts(
            m, "norm1", "conv1", "norm2", "conv2", "norm3", "conv_shortcut", "nonlinearity", "dropout")
        x = inputs
        own_dtype = all(p is None or p.dtype == getattr(x, "dtype", None)
                        for p in (norm1.weight, norm2.weight))  # (an fp32 weight makes the norm's output fp32)
        if (args or kwargs or not hasattr(x, "dim") or x.dim() != 5 or not own_dtype
                or m.__dict__.get("scale_shift_table") is not None or m.__dict__.get("per_channel_scale1") is not None
                or m.__dict__["_parameters"].get("scale_shift_table") is not None
                or m.__dict__["_parameters"].get("per_channel_scale1") is not None
                or not dropout_is_identity(drop) or not inference(x, norm1, norm2, norm3)
                or not plain(norm1, act, conv1, norm2, drop, conv2, norm3, sc)):
            return base(m, inputs, temb, generator, *args, **kwargs)
        h = _conv(conv1, channel_rms_norm(norm1, x, "silu"))
        h = channel_rms_norm(norm2, h, "silu")
        res = x
        if norm3 is not None:
            res = norm3(res.movedim(1, -1)).movedim(-1, 1)
        if sc is not None:
            res = _conv(sc, res)
        return _conv(conv2, h, residual=res)


RESNET = register(ResnetBlock3d())
