"""ESRGAN's residual dense block (``ResidualDenseBlock_5C``, basicsr's
``ResidualDenseBlock``): matched by class name, structure and the residual
scale its forward holds.

The block's own forward concatenates its input with each conv's output
before the next conv (four ``torch.cat`` copies, 96 to 192 channels), runs
the LeakyReLUs as passes of their own and the ``x5 * 0.2 + x`` residual as
two more. For one image in NCHW (an upscaler's call) every channel prefix of
a [1, nf + 4 gc, H, W] buffer is itself a dense NCHW tensor: each conv reads
its prefix in place and writes its output, activation applied, into the
next slice; the last conv adds the residual in its epilogue. Two forms:
the convs ``nn.Conv2d`` with ``lrelu`` applied after conv1-4 (ESRGAN's
new-arch, basicsr), or each conv an ``nn.Sequential`` of the conv and its
activation, conv5's of the conv alone (the old-arch "CNA" blocks spandrel,
and so ComfyUI, load; not ESRGAN+'s ``plus`` variant, whose extra 1x1 paths
add after the activation).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from conv_patch.activations import leaky_relu

from .fuse import Recipe, base, conv, inference, is_conv, is_relu, named, parts, plain, register

CLASSES = ("ResidualDenseBlock_5C", "ResidualDenseBlock")
# The residual scale both forms' forward writes (``x5 * 0.2 + x``).
RESIDUAL_SCALE = 0.2


def _act_name(m) -> Optional[str]:
    if is_relu(m):
        return "relu"
    if type(m) is nn.LeakyReLU:
        return leaky_relu(m.negative_slope)
    return None


def dense_parts(m) -> Optional[tuple]:
    """(convs, activation names, activation modules) of a residual dense
    block, the modules its forward calls around, or None: five 3x3, stride
    1, padding 1 convs, conv k reading nf + (k-1) gc channels, conv1-4
    writing gc and conv5 nf, conv1-4 followed by a ReLU or LeakyReLU the
    kernels carry."""
    convs = parts(m, "conv1", "conv2", "conv3", "conv4", "conv5")
    if all(type(c) is nn.Sequential for c in convs):
        if parts(m, "conv1x1")[0] is not None:
            return None
        seqs = [list(c) for c in convs]
        if [len(s) for s in seqs] != [2, 2, 2, 2, 1]:
            return None
        acts = [s[1] for s in seqs[:4]]
        convs, around = [s[0] for s in seqs], list(convs) + acts
    else:
        act = parts(m, "lrelu")[0]
        acts, around = [act] * 4, [act]
    names = [_act_name(a) for a in acts]
    if None in names or not all(is_conv(c, 3, 1, 1) for c in convs):
        return None
    nf, gc = convs[0].in_channels, convs[0].out_channels
    if any(c.in_channels != nf + k * gc or c.out_channels != (gc if k < 4 else nf) for k, c in enumerate(convs)):
        return None
    return convs, names, around


def _forward_scale(cls) -> Optional[float]:
    """The one float constant of ``cls.forward`` (the residual scale), or None."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    floats = {c for c in (code.co_consts if code is not None else ()) if isinstance(c, float)}
    return floats.pop() if len(floats) == 1 else None


class ResidualDenseBlock(Recipe):
    """conv1-4 reading channel prefixes of one buffer in place and writing
    their activated outputs into its next slices, conv5 with the 0.2-scaled
    residual in its epilogue: no concatenations, no activation or residual
    passes of their own (one image, NCHW; anything else runs the block's
    own forward, as does a traced call)."""

    name = "esrgan.ResidualDenseBlock"
    what = "dense-block convs on one buffer's channel prefixes, LeakyReLU and 0.2 residual in the epilogues"

    def match(self, m):
        return (any(named(m, n) for n in CLASSES) and dense_parts(m) is not None
                and _forward_scale(getattr(type(m), "cp_base", type(m))) == RESIDUAL_SCALE)

    def forward(self, m, x, *args, **kwargs):
        found = dense_parts(m)
        if (args or kwargs or found is None or not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != 1
                or not x.is_contiguous() or torch.compiler.is_compiling()):
            # (A batch's or an NHWC buffer's channel prefixes are not dense:
            # the convs would copy them, as the concatenations do. Under
            # torch.compile Inductor plans the memory, and the slice writes
            # would be copies of their own.)
            return base(m, x, *args, **kwargs)
        convs, acts, around = found
        if not inference(x, *convs) or not plain(*convs, *around):
            return base(m, x, *args, **kwargs)
        nf, gc = convs[0].in_channels, convs[0].out_channels
        buf = torch.empty((1, nf + 4 * gc) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        buf[:, :nf].copy_(x)
        for k in range(4):
            c0 = nf + k * gc
            conv(convs[k], buf[:, :c0], activation=acts[k], out=buf[:, c0:c0 + gc])
        # x5 * 0.2 + x as 0.2 * (x5 + 5 x): one epilogue.
        return conv(convs[4], buf, residual=x, beta=1.0 / RESIDUAL_SCALE, out_scale=RESIDUAL_SCALE)


RESIDUAL_DENSE = register(ResidualDenseBlock())
