"""Sana's deep-compression autoencoder (diffusers' ``AutoencoderDC``):
its ``ResBlock``s, its upsampling blocks (``DCUpBlock2d``) and its
``Decoder``. Matched by class name, structure and the names each forward
reads.

* ``ResBlock`` (``norm_type="rms_norm"``): conv1, the activation, conv2
  (no bias), diffusers' ``RMSNorm`` over the channels (called on a
  channels-last permutation: an fp32 copy, its square, the mean, the scale,
  the weight and the bias, each a pass of its own), the input added. Here
  conv1's activation is in its epilogue and the norm is one pass of the
  RMS-norm kernel over the channel axis.
* ``DCUpBlock2d``: nearest x2 upsampling and a 3x3 conv (``interpolate``)
  become the four 2x2 convs of the input (``fuse.upsample_conv``); the
  pixel-shuffle form's conv runs before its shuffle. The shortcut (the
  input's channels repeated, pixel-shuffled) is added in the conv's
  epilogue.
* ``Decoder``: run in NHWC inside (the kernels' layout), the ``in_shortcut``
  added in conv_in's epilogue, the final RMS norm and ReLU one pass. Its
  EfficientViT blocks (the linear attention, the GLU convs) run their own
  forward on the NHWC activations.
* ``SanaMultiscaleAttentionProjection`` (the linear attention's multiscale
  branch): its depthwise ``proj_in`` and grouped 1x1 ``proj_out`` each one
  launch of conv-patch's grouped-conv kernels (``fuse.grouped_conv``; cuDNN
  runs the 1x1 as a GEMM per group on NHWC, each behind a slicing kernel).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.ops import grouped_conv as grouped_conv_op
from conv_patch.target import target_for

from .fuse import (Recipe, base, channel_rms_norm, channels_last, conv, epilogue_activation, forward_names,
                   grouped_conv, inference, is_conv, last_axis_rms_norm_params, like_input, named, parts, plain,
                   register, upsample_conv)


def _forward_reads(m, *names: str) -> bool:
    """Whether the forward of ``m``'s own class reads all of ``names`` (a
    forward of the same class name written otherwise is not matched)."""
    return set(names) <= forward_names(getattr(type(m), "cp_base", type(m)))


def _act(m) -> Optional[str]:
    act = epilogue_activation(m)
    return act if act in ("relu", "silu") else None


class ResBlock(Recipe):
    """conv1 with its activation in the epilogue, conv2, the channel RMS
    norm as one pass, the input added."""

    name = "dcae.ResBlock"
    what = "conv1+activation epilogue, channel RMS norm in one pass"

    def match(self, m):
        conv1, conv2, norm, act = parts(m, "conv1", "conv2", "norm", "nonlinearity")
        return (named(m, "ResBlock") and m.__dict__.get("norm_type") == "rms_norm"
                and is_conv(conv1, 3, 1, 1) and is_conv(conv2, 3, 1, 1) and conv2.bias is None
                and conv1.out_channels == conv1.in_channels == conv2.in_channels == conv2.out_channels
                and last_axis_rms_norm_params(norm) is not None and _act(act) is not None
                and _forward_reads(m, "conv1", "nonlinearity", "conv2", "norm", "movedim"))

    def forward(self, m, x, *args, **kwargs):
        conv1, conv2, norm, act = parts(m, "conv1", "conv2", "norm", "nonlinearity")
        if (args or kwargs or not isinstance(x, torch.Tensor) or x.dim() != 4 or not inference(x, conv1, conv2, norm)
                or not plain(conv1, conv2, norm, act)):
            return base(m, x, *args, **kwargs)
        h = conv(conv2, conv(conv1, x, activation=_act(act)))
        return channel_rms_norm(norm, h) + x


def _up_parts(m) -> Optional[tuple]:
    """(conv, interpolate, shortcut) of a ``DCUpBlock2d`` this recipe
    computes, or None."""
    c = parts(m, "conv")[0]
    d = m.__dict__
    interp, shortcut, factor = d.get("interpolate"), d.get("shortcut"), d.get("factor")
    if factor != 2 or not isinstance(interp, bool) or not isinstance(shortcut, bool) or not is_conv(c, 3, 1, 1):
        return None
    if interp and d.get("interpolation_mode") != "nearest":
        return None
    # The shortcut repeats the input's channels to 4x the block's output
    # channels, then shuffles them: the interpolating conv writes the
    # output's channels, the shuffling one 4x them.
    out4 = c.out_channels * (4 if interp else 1)
    if shortcut and (not isinstance(d.get("repeats"), int) or c.in_channels * d["repeats"] != out4):
        return None
    return c, interp, shortcut


class UpBlock(Recipe):
    """Nearest x2 and the 3x3 conv as four 2x2 convs of the input, or the
    conv before its pixel shuffle; the repeated-channel shortcut in the
    conv's epilogue."""

    name = "dcae.DCUpBlock2d"
    what = "upsample folded into the conv, shortcut in its epilogue"

    def match(self, m):
        return (named(m, "DCUpBlock2d") and _up_parts(m) is not None
                and _forward_reads(m, "interpolate", "conv", "shortcut", "repeat_interleave", "pixel_shuffle"))

    def forward(self, m, x, *args, **kwargs):
        found = _up_parts(m)
        if (args or kwargs or found is None or not isinstance(x, torch.Tensor) or x.dim() != 4
                or not inference(x, found[0]) or not plain(found[0])):
            return base(m, x, *args, **kwargs)
        c, interp, shortcut = found
        res = None
        if shortcut:
            r = m.__dict__["repeats"]
            res = x.repeat_interleave(r, dim=1, output_size=x.shape[1] * r)
            if interp:
                res = F.pixel_shuffle(res, 2)
        if interp:
            return upsample_conv(c, x, residual=res)
        return F.pixel_shuffle(conv(c, x, residual=res), 2)

    def upsample_convs(self, m):
        found = _up_parts(m)
        return (found[0],) if found is not None and found[1] else ()


class Decoder(Recipe):
    """The decoder in NHWC inside: conv_in with the repeated-channel
    shortcut in its epilogue, the up blocks, the final RMS norm and
    activation as one pass, conv_out; the output in the caller's layout."""

    name = "dcae.Decoder"
    what = "NHWC inside, in_shortcut in conv_in's epilogue, RMS norm+ReLU in one pass"

    def match(self, m):
        conv_in, ups, norm, act = parts(m, "conv_in", "up_blocks", "norm_out", "conv_act")
        return (named(m, "Decoder") and is_conv(conv_in, 3, 1, 1) and ups is not None
                and isinstance(m.__dict__.get("in_shortcut"), bool) and last_axis_rms_norm_params(norm) is not None
                and _act(act) is not None and parts(m, "conv_out")[0] is not None
                and _forward_reads(m, "in_shortcut", "conv_in", "up_blocks", "norm_out", "conv_act", "conv_out"))

    def forward(self, m, x, *args, **kwargs):
        conv_in, ups, norm, act, conv_out = parts(m, "conv_in", "up_blocks", "norm_out", "conv_act", "conv_out")
        if (args or kwargs or not isinstance(x, torch.Tensor) or x.dim() != 4
                or (torch.is_grad_enabled() and m.__dict__.get("gradient_checkpointing", False))
                or not plain(conv_in, ups, norm, act, conv_out, *ups)
                or not (torch.compiler.is_compiling() or target_for(x.device).kernels)):
            return base(m, x, *args, **kwargs)
        h = channels_last(x)
        res = None
        if m.__dict__["in_shortcut"]:
            r = m.__dict__["in_shortcut_repeats"]
            res = h.repeat_interleave(r, dim=1, output_size=h.shape[1] * r)
        h = conv(conv_in, h, residual=res)
        for up in reversed(ups):
            h = up(h)
        h = channel_rms_norm(norm, h, _act(act))
        return like_input(conv_out(h), x)


class MultiscaleProjection(Recipe):
    """The depthwise ``proj_in`` and the grouped 1x1 ``proj_out``, each in one
    kernel launch where the kernels take it (else the module's call)."""

    name = "dcae.SanaMultiscaleAttentionProjection"
    what = "depthwise proj_in and grouped 1x1 proj_out, one launch each"
    runs_convs = False  # (no patched conv below: no weight packs to refresh)

    def match(self, m):
        proj_in, proj_out = parts(m, "proj_in", "proj_out")
        return (named(m, "SanaMultiscaleAttentionProjection") and isinstance(proj_in, nn.Module)
                and grouped_conv_op.conv_problem(proj_out) is None and _forward_reads(m, "proj_in", "proj_out"))

    def forward(self, m, x, *args, **kwargs):
        if args or kwargs or torch.compiler.is_compiling():
            return base(m, x, *args, **kwargs)
        proj_in, proj_out = parts(m, "proj_in", "proj_out")
        return grouped_conv(proj_out, grouped_conv(proj_in, x))


RESBLOCK = register(ResBlock())
UP_BLOCK = register(UpBlock())
DECODER = register(Decoder())
MULTISCALE_PROJECTION = register(MultiscaleProjection())
