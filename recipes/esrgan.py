"""ESRGAN-family upscalers: the residual dense block of ESRGAN's RRDB nets,
and Real-ESRGAN's compact net (``SRVGGNetCompact``).

The residual dense block (``ResidualDenseBlock_5C``, basicsr's
``ResidualDenseBlock``) is matched by class name, structure and the
residual scale its forward holds.

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

``SRVGGNetCompact`` (Real-ESRGAN's realesr-general/animevideo nets, as
basicsr, Real-ESRGAN and spandrel, and so ComfyUI, build it): a
``body`` ModuleList of 3x3 convs each followed by its activation (PReLU
per channel by default, ReLU or LeakyReLU 0.1 otherwise), a last conv, a
pixel shuffle and the nearest-upsampled input added. Each conv runs with
its activation in the epilogue (no activation pass of its own), the body in
NHWC inside (the kernels' layout; the epilogue pass after a conv cuDNN
computes is NHWC-only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.activations import per_channel
from conv_patch.runtime import pack
from conv_patch.runtime.state import peek, state_of

from .fuse import (Recipe, base, channels_last, conv, epilogue_activation, forward_names, global_hooks, hookless,
                   inference, inline_chain, inline_step, is_conv, like_input, named, parts, plain, register, sum_into)

CLASSES = ("ResidualDenseBlock_5C", "ResidualDenseBlock")
# The residual scale both forms' forward writes (``x5 * 0.2 + x``).
RESIDUAL_SCALE = 0.2


def dense_parts(m) -> Optional[tuple]:
    """(convs, activation names, activation modules) of a residual dense
    block, the modules its forward calls around, or None: five 3x3, stride
    1, padding 1 convs, conv k reading nf + (k-1) gc channels, conv1-4
    writing gc and conv5 nf, conv1-4 followed by an activation the
    kernels carry (ReLU, SiLU, LeakyReLU, PReLU: spandrel's ``act_type``)."""
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
    names = [epilogue_activation(a) for a in acts]
    if any(a is None for a in names) or not all(is_conv(c, 3, 1, 1) for c in convs):
        return None
    nf, gc = convs[0].in_channels, convs[0].out_channels
    if any(c.in_channels != nf + k * gc or c.out_channels != (gc if k < 4 else nf) for k, c in enumerate(convs)):
        return None
    if any(per_channel(a) and not a.fits(gc) for a in names):
        return None
    return convs, names, around


def _forward_scale(cls) -> Optional[float]:
    """The one float constant of ``cls.forward`` (the residual scale), or None."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    floats = {c for c in (code.co_consts if code is not None else ()) if isinstance(c, float)}
    return floats.pop() if len(floats) == 1 else None


def graphs_only(m) -> Optional[tuple]:
    """The dense block's ``unfused`` rule: launched eagerly, an RRDB net's
    call is host-bound and the fused forward measured slower than the
    block's own (its channel-prefix convs mostly on cuDNN, each with an
    activation op and a copy into the buffer: docs/performance.md), so
    eagerly the block runs its own forward (no swaps: nothing fused below
    it); on the graph path (its own graphs, or a capture of a block above
    it) the recipe runs."""
    if pack.GRAPH_PATH or torch.compiler.is_compiling():
        return None
    st = peek(m)
    return None if st is not None and st.graphs is not None else ()


# The names a dense block's forward reads where it is ESRGAN's, basicsr's
# or spandrel's (each conv on the concatenation of the input and the earlier
# outputs, ``x5 * 0.2 + x``): the forward ``LeanDenseBlock`` writes out.
DENSE_FORWARD = frozenset({"conv1", "conv2", "conv3", "conv4", "conv5", "lrelu", "torch", "cat"})
_DENSE_CONVS = ("conv1", "conv2", "conv3", "conv4", "conv5")


def _dense_forward(cls) -> bool:
    return {*_DENSE_CONVS, "cat"} <= forward_names(cls) <= DENSE_FORWARD


def _chain(c, h: torch.Tensor, mine: bool, act) -> tuple:
    """(output, mine) of a dense block's conv step: the conv and, where the
    block has one (``act``: its ``lrelu``), the activation after it; a CNA
    step's ``nn.Sequential`` of the two run part by part."""
    if type(c) is nn.Sequential and hookless(c):
        return inline_chain(c.__dict__["_modules"].values(), h, mine)
    h, mine = inline_step(c, h, mine)
    return (h, mine) if act is None else inline_step(act, h, mine)


class LeanDenseBlock:
    """A residual dense block's forward for a block passed through
    (``Recipe.lean``): the same ops in the same order on the same values
    (each conv on ``torch.cat`` of the input and the earlier outputs, its
    activation, ``x5 * 0.2 + x``), the bare convs and activations as the
    functions their forwards call (any other part called as a module), the
    activations and the last two steps in place on tensors made here. Where
    no gradient is recorded and no global hook is set; otherwise the class's
    own forward."""

    def forward(self, x, *args, **kwargs):
        if args or kwargs or not isinstance(x, torch.Tensor) or torch.is_grad_enabled() or global_hooks():
            return super().forward(x, *args, **kwargs)
        mods = self.__dict__["_modules"]
        act = mods.get("lrelu")
        outs = [x]
        for k, name in enumerate(_DENSE_CONVS):
            h, mine = _chain(mods[name], x if k == 0 else torch.cat(outs, 1), False, act if k < 4 else None)
            outs.append(h)
        return sum_into(h.mul_(RESIDUAL_SCALE) if mine else h * RESIDUAL_SCALE, True, x)


class ResidualDenseBlock(Recipe):
    """conv1-4 reading channel prefixes of one buffer in place and writing
    their activated outputs into its next slices, conv5 with the 0.2-scaled
    residual in its epilogue: no concatenations, no activation or residual
    passes of their own (one image, NCHW; anything else runs the block's
    own forward, as does a traced call)."""

    name = "esrgan.ResidualDenseBlock"
    what = ("dense-block convs on one buffer's channel prefixes, activation and 0.2 residual in the epilogues "
            "(with cuda_graphs; launched eagerly its own forward)")

    graphs_only = True

    def unfused(self, m, args, kwargs):
        return graphs_only(m)

    def lean_for(self, cls):
        """``LeanDenseBlock`` where the class's forward reads only what
        ESRGAN's, basicsr's and spandrel's read (``DENSE_FORWARD``)."""
        return LeanDenseBlock if _dense_forward(cls) else None

    def match(self, m):
        return (any(named(m, n) for n in CLASSES) and dense_parts(m) is not None
                and _forward_scale(getattr(type(m), "cp_base", type(m))) == RESIDUAL_SCALE)

    def forward(self, m, x, *args, **kwargs):
        # The parts are the block's: kept until a part (or a CNA step's
        # conv or activation) is replaced, added or removed.
        key = tuple([c for s in m.__dict__["_modules"].values()
                     for c in ((s, *s.__dict__["_modules"].values()) if type(s) is nn.Sequential else (s,))])
        st = state_of(m)
        held = st.chain
        if held is None or held[0] != key:
            held = st.chain = (key, dense_parts(m))
        found = held[1]
        if (args or kwargs or found is None or not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != 1
                or not x.is_contiguous() or torch.compiler.is_compiling()):
            # (A batch's or an NHWC buffer's channel prefixes are not dense:
            # the convs would copy them, as the concatenations do. Under
            # torch.compile Inductor plans the memory, and the slice writes
            # would be copies of their own.)
            return base(m, x, *args, **kwargs)
        convs, acts, around = found
        if not inference(x, *convs, *around) or not plain(*convs, *around):
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


def compact_steps(m) -> Optional[tuple]:
    """((conv, activation, activation module) per hidden layer, the last
    conv) of an ``SRVGGNetCompact``, or None: the body alternates 3x3
    stride-1 convs of padding 1 with activations the kernels carry (a PReLU
    with one slope or one per channel), its last conv writes ``upscale**2``
    channels per output channel and the upsampler is a pixel shuffle by
    ``upscale``."""
    body, upsampler, upscale = parts(m, "body", "upsampler", "upscale")
    if type(body) is not nn.ModuleList or type(upsampler) is not nn.PixelShuffle:
        return None
    mods = list(body)
    if len(mods) < 3 or len(mods) % 2 == 0 or upscale != upsampler.upscale_factor:
        return None
    steps = []
    for c, a in zip(mods[:-1:2], mods[1::2]):
        act = epilogue_activation(a)
        if not is_conv(c, 3, 1, 1) or act is None or (per_channel(act) and not act.fits(c.out_channels)):
            return None
        steps.append((c, act, a))
    last = mods[-1]
    if not is_conv(last, 3, 1, 1) or last.out_channels % (upscale * upscale):
        return None
    if any(c.in_channels != p.out_channels for (c, _, _), (p, _, _) in zip(steps[1:], steps)):
        return None
    return tuple(steps), last


# The names the compact net's forward may read (Real-ESRGAN's, basicsr's and
# spandrel's forward: the body in order, the pixel shuffle, the nearest
# upsampled input added): a forward reading anything else (a variant with a
# switch of its own) is not the one this recipe computes.
COMPACT_FORWARD = frozenset({"range", "len", "enumerate", "body", "upsampler", "upscale", "F", "torch", "nn",
                             "functional", "interpolate"})


def _compact_forward(cls) -> bool:
    return {"body", "upsampler", "upscale", "interpolate"} <= forward_names(cls) <= COMPACT_FORWARD


class CompactNet(Recipe):
    """``SRVGGNetCompact``: every conv with its activation in the epilogue,
    the body in NHWC inside; the pixel shuffle and the upsampled input's add
    as the net's own. Batches of any size; a traced call, hooks or autograd
    run the net's own forward. Launched eagerly too: the fused body
    measured faster than the net's own forward, whose NCHW convs pay
    cuDNN's layout copies, a bias add and a PReLU pass each
    (docs/performance.md)."""

    name = "esrgan.SRVGGNetCompact"
    what = "conv+PReLU/ReLU/LeakyReLU epilogues, body in NHWC"

    def match(self, m):
        return (named(m, "SRVGGNetCompact") and compact_steps(m) is not None
                and _compact_forward(getattr(type(m), "cp_base", type(m))))

    def forward(self, m, x, *args, **kwargs):
        body, upsampler = parts(m, "body", "upsampler")
        if (args or kwargs or not isinstance(x, torch.Tensor) or x.dim() != 4 or type(body) is not nn.ModuleList
                or torch.compiler.is_compiling()):
            return base(m, x, *args, **kwargs)
        # The plan is the body's: kept until a layer is replaced, added or
        # removed (or the upsampler or the scale).
        layers = tuple(body.__dict__["_modules"].values()) + (upsampler, m.__dict__.get("upscale"))
        st = state_of(m)
        held = st.chain
        if held is None or held[0] != layers:
            held = st.chain = (layers, compact_steps(m))
        found = held[1]
        mods = layers[:-1]
        if found is None or not inference(x, *mods) or not plain(body, *mods):
            return base(m, x)
        steps, last = found
        y = channels_last(x)
        for c, act, _ in steps:
            y = conv(c, y, activation=act)
        y = like_input(conv(last, y), x)
        return upsampler(y) + F.interpolate(x, scale_factor=layers[-1], mode="nearest")


COMPACT = register(CompactNet())
