"""ESRGAN-family upscalers: the residual dense block of ESRGAN's RRDB nets,
and Real-ESRGAN's compact net (``SRVGGNetCompact``).

The residual dense block (``ResidualDenseBlock_5C``, basicsr's
``ResidualDenseBlock``) is matched by class name, structure and the
residual scale its forward holds.

The block's own forward concatenates its input with each conv's output
before the next conv (four ``torch.cat`` copies, 96 to 192 channels), runs
the LeakyReLUs as passes of their own and the ``x5 * 0.2 + x`` residual as
two more; in NCHW each cuDNN conv adds a layout copy in and out. The
recipe keeps one NHWC buffer [N, H, W, nf + 4 gc]: every channel prefix of
it is an NHWC channel slice the kernels read in place (the TMA kernel's
descriptor takes the buffer's pixel stride), so each conv reads its prefix
and writes its output, activation applied, into the next slice; the last
conv adds the residual in its epilogue and writes the block's output in
its input's layout. Two forms: the convs ``nn.Conv2d`` with ``lrelu``
applied after conv1-4 (ESRGAN's new-arch, basicsr), or each conv an
``nn.Sequential`` of the conv and its activation, conv5's of the conv alone
(the old-arch "CNA" blocks spandrel, and so ComfyUI, load; not ESRGAN+'s
``plus`` variant, whose extra 1x1 paths add after the activation). The
residual-in-residual block (``RRDB``) around three of them runs them on two
such buffers, each block's output written into the next one's.

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
from conv_patch.runtime.state import state_of

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


def dense_found(m) -> Optional[tuple]:
    """``dense_parts(m)``, kept on the block's state until a part (or a CNA
    step's conv or activation) is replaced, added or removed."""
    key = tuple([c for s in m.__dict__["_modules"].values()
                 for c in ((s, *s.__dict__["_modules"].values()) if type(s) is nn.Sequential else (s,))])
    st = state_of(m)
    held = st.chain
    if held is None or held[0] != key:
        held = st.chain = (key, dense_parts(m))
    return held[1]


def dense_buffer(x: torch.Tensor, found: tuple) -> torch.Tensor:
    """The [N, nf + 4 gc, H, W] NHWC buffer of a dense block on ``x``: its
    first nf channels hold ``x``, conv k's output goes to the next gc. Every
    channel prefix is an NHWC channel slice the kernels read in place
    (``specs.nhwc_pitch``), whatever the batch."""
    convs = found[0]
    nf, gc = convs[0].in_channels, convs[0].out_channels
    n, _, h, w = x.shape
    buf = torch.empty((n, h, w, nf + 4 * gc), dtype=x.dtype, device=x.device).permute(0, 3, 1, 2)
    buf[:, :nf].copy_(x)
    return buf


def dense_convs(found: tuple, buf: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A dense block's five convs on ``buf`` (``dense_buffer``): conv1-4
    each on its channel prefix, its activated output written into the next
    slice; conv5 on the whole buffer writes ``conv5 * 0.2 + residual`` (as
    0.2 * (conv5 + 5 residual): one epilogue) into ``out``."""
    convs, acts, _ = found
    nf, gc = convs[0].in_channels, convs[0].out_channels
    for k in range(4):
        c0 = nf + k * gc
        conv(convs[k], buf[:, :c0], activation=acts[k], out=buf[:, c0:c0 + gc])
    return conv(convs[4], buf, residual=residual, beta=1.0 / RESIDUAL_SCALE, out_scale=RESIDUAL_SCALE, out=out)


def dense_call_ok(x, found, *args, **kwargs) -> bool:
    """Whether a dense block's call runs fused: one 4-D tensor, no autograd,
    no hooks, not traced (under torch.compile Inductor plans the memory,
    and the slice writes would be copies of their own)."""
    if (args or kwargs or found is None or not isinstance(x, torch.Tensor) or x.dim() != 4
            or torch.compiler.is_compiling()):
        return False
    convs, _, around = found
    return inference(x, *convs, *around) and plain(*convs, *around)


class ResidualDenseBlock(Recipe):
    """conv1-4 reading channel prefixes of one NHWC buffer in place and
    writing their activated outputs into its next slices, conv5 with the
    0.2-scaled residual in its epilogue, its output in the input's layout:
    no concatenations, no activation or residual passes of their own
    (anything else runs the block's own forward, as does a traced call)."""

    name = "esrgan.ResidualDenseBlock"
    what = "dense-block convs on one NHWC buffer's channel prefixes, activation and 0.2 residual in the epilogues"

    def lean_for(self, cls):
        """``LeanDenseBlock`` where the class's forward reads only what
        ESRGAN's, basicsr's and spandrel's read (``DENSE_FORWARD``)."""
        return LeanDenseBlock if _dense_forward(cls) else None

    def match(self, m):
        return (any(named(m, n) for n in CLASSES) and dense_parts(m) is not None
                and _forward_scale(getattr(type(m), "cp_base", type(m))) == RESIDUAL_SCALE)

    def forward(self, m, x, *args, **kwargs):
        found = dense_found(m)
        if not dense_call_ok(x, found, *args, **kwargs):
            return base(m, x, *args, **kwargs)
        return dense_convs(found, dense_buffer(x, found), torch.empty_like(x), x)


RESIDUAL_DENSE = register(ResidualDenseBlock())

# ESRGAN's and spandrel's RRDB name its dense blocks RDB1-3, basicsr's rdb1-3.
RRDB_PARTS = (("RDB1", "RDB2", "RDB3"), ("rdb1", "rdb2", "rdb3"))


def rrdb_blocks(m) -> Optional[tuple]:
    """The three dense blocks of a residual-in-residual block, each one the
    dense-block recipe takes, or None."""
    for names in RRDB_PARTS:
        blocks = parts(m, *names)
        if all(b is not None for b in blocks):
            if all(RESIDUAL_DENSE.match(b) for b in blocks):
                return blocks
            return None
    return None


def rrdb_found(m) -> Optional[tuple]:
    """``rrdb_blocks(m)``, kept on the block's state until a dense block is
    replaced, added or removed (matching them is structural work a call
    need not repeat; each block's parts are checked by ``dense_found``)."""
    key = tuple(m.__dict__["_modules"].values())
    st = state_of(m)
    held = st.chain
    if held is None or held[0] != key:
        held = st.chain = (key, rrdb_blocks(m))
    return held[1]


def _rrdb_forward(cls) -> bool:
    """The class's forward reads its three dense blocks and nothing else
    (``out * 0.2 + x`` around them)."""
    return any(forward_names(cls) == frozenset(n) for n in RRDB_PARTS)


class ResidualInResidual(Recipe):
    """ESRGAN's RRDB: its three dense blocks on two NHWC buffers (each
    block's conv5 writes its output into the next block's buffer, the
    0.2-scaled residual in the epilogue), the outer ``out * 0.2 + x`` as one
    add into the last block's output, in the input's layout: one layout
    copy into the first buffer, none between the blocks."""

    name = "esrgan.RRDB"
    what = "three dense blocks on two NHWC buffers, their residuals in the epilogues"

    def match(self, m):
        cls = getattr(type(m), "cp_base", type(m))
        return (named(m, "RRDB") and rrdb_blocks(m) is not None and _rrdb_forward(cls)
                and _forward_scale(cls) == RESIDUAL_SCALE)

    def forward(self, m, x, *args, **kwargs):
        blocks = rrdb_found(m)
        found = None if blocks is None else [dense_found(b) for b in blocks]
        if found is None or not all(dense_call_ok(x, f, *args, **kwargs) for f in found) or not plain(*blocks):
            return base(m, x, *args, **kwargs)
        nf = found[0][0][0].in_channels
        a = dense_buffer(x, found[0])
        b = torch.empty_like(a)
        dense_convs(found[0], a, b[:, :nf], x)
        dense_convs(found[1], b, a[:, :nf], b[:, :nf])
        y = dense_convs(found[2], a, torch.empty_like(x), a[:, :nf])
        return torch.add(x, y, alpha=RESIDUAL_SCALE, out=y)


RRDB_RECIPE = register(ResidualInResidual())


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

    def auto_graphs(self, m):
        # 64 channels, one conv after another at the tile's size: at the
        # 256^2 tiles upscale loaders cut, host-bound (docs/performance.md).
        return True

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
