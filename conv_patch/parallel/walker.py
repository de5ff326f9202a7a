"""The VAE encoders and decoders the recipes recognise, as a list of layer
steps, and those steps run over bands, layer-major: each layer over all bands
before the next layer starts, because a GroupNorm must see every band's
statistics before it normalises any band.

A model becomes a ``Program`` (``program_of``): ``Conv`` (any conv, with its
padding over the whole image, an F.pad folded in: the stride-2 downsample),
``Resnet``, ``Up`` (nearest x2 + 3x3 conv), ``Whole`` (a module that must see
every row at once: the attention) and ``NormConv`` (GroupNorm, SiLU, conv:
the tail). Each step reads its input band plus halo (``Comm.window``) and
calls the recipes' fused steps (``conv_patch.recipes.steps``), so a patched
model runs its kernels, cache and fallback exactly as in an unbanded call,
and an unpatched one runs PyTorch.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
from torch import nn

from conv_patch.recipes.catalog import REGISTRY, steps
from conv_patch.recipes.ldm import uses_silu
from conv_patch.runtime.wrappers import PatchedConvMixin
from conv_patch.parallel.comm import Banded, Comm
from conv_patch.parallel.geometry import Level, check_halo, window
from conv_patch.parallel.stats import band_moments, merge, normalise, scale_shift


class UnsupportedModel(ValueError):
    """The module is not an encoder or decoder whose layers the band walker
    knows (its structure differs from what the recipes recognise)."""


# -- the steps -------------------------------------------------------------------
@dataclasses.dataclass
class Conv:
    """A conv over the whole image with padding ``pad`` (F.pad order: the
    module's own plus a folded F.pad)."""

    m: nn.Conv2d
    pad: Tuple[int, int, int, int]

    def out_hw(self, h: int, w: int) -> Tuple[int, int]:
        (kh, kw), (sh, sw) = self.m.kernel_size, self.m.stride
        l, r, t, b = self.pad
        return (h + t + b - kh) // sh + 1, (w + l + r - kw) // sw + 1

    def run(self, ctx, x):
        return conv_layer(ctx, self.m, self.pad, x, next_norm=ctx.next_norm)


@dataclasses.dataclass
class Resnet:
    norm1: nn.GroupNorm
    conv1: nn.Conv2d
    norm2: nn.GroupNorm
    conv2: nn.Conv2d
    shortcut: Optional[nn.Conv2d]
    out_scale: float

    def out_hw(self, h, w):
        return h, w

    def run(self, ctx, x):
        h = conv_layer(ctx, self.conv1, own_pad(self.conv1), x, pre=self.norm1, next_norm=self.norm2)
        sc = x if self.shortcut is None else conv_layer(ctx, self.shortcut, own_pad(self.shortcut), x)
        return conv_layer(ctx, self.conv2, own_pad(self.conv2), h, pre=self.norm2, residual=sc,
                          out_scale=self.out_scale, next_norm=ctx.next_norm)


@dataclasses.dataclass
class Up:
    """Nearest x2 then a 3x3 conv with padding 1."""

    conv: nn.Conv2d

    def out_hw(self, h, w):
        return 2 * h, 2 * w

    def run(self, ctx, x):
        return up_layer(ctx, self.conv, x, next_norm=ctx.next_norm)


@dataclasses.dataclass
class Whole:
    """A module computed over all rows at once (the attention, which every
    token of the image attends to): run on the whole tensor, gathered to
    every process (it runs at the latent resolution, the smallest)."""

    m: nn.Module

    def out_hw(self, h, w):
        return h, w

    def run(self, ctx, x):
        y = self.m(ctx.comm.whole(x))
        return Banded.of_whole(x.level, y)


@dataclasses.dataclass
class NormConv:
    """GroupNorm, SiLU, then a conv (the tail of every VAE half)."""

    norm: nn.GroupNorm
    conv: nn.Conv2d

    def out_hw(self, h, w):
        return Conv(self.conv, own_pad(self.conv)).out_hw(h, w)

    def run(self, ctx, x):
        return conv_layer(ctx, self.conv, own_pad(self.conv), x, pre=self.norm, next_norm=ctx.next_norm)


@dataclasses.dataclass
class Program:
    kind: str  # "decoder" | "encoder"
    family: str  # "diffusers" | "ldm"
    steps: list
    module: nn.Module

    def heights(self, h: int) -> List[int]:
        """The height of every step's input, and the last one's output."""
        out = [h]
        for s in self.steps:
            out.append(s.out_hw(out[-1], 1)[0])
        return out

    @property
    def convs(self) -> List[nn.Conv2d]:
        return [m for m in self.module.modules() if isinstance(m, nn.Conv2d)]

    @property
    def patched(self) -> bool:
        return any(isinstance(m, PatchedConvMixin) for m in self.convs)


@dataclasses.dataclass
class Context:
    comm: Comm
    kernels: bool  # the model is patched and its kernels run here: the GroupNorm apply kernel too
    # The GroupNorm the next step begins with (its output's statistics are
    # taken band by band as they are made).
    next_norm: Optional[nn.GroupNorm] = None


def first_norm(step) -> Optional[nn.GroupNorm]:
    """The GroupNorm a step applies to its input first, if any."""
    return getattr(step, "norm1", None) or getattr(step, "norm", None)


def own_pad(m: nn.Conv2d) -> Tuple[int, int, int, int]:
    ph, pw = m.padding
    return (pw, pw, ph, ph)


# -- running the steps over bands ----------------------------------------------------
def _on_device(ctx, t: torch.Tensor) -> torch.Tensor:
    return t if t.device == ctx.comm.device else t.to(ctx.comm.device, non_blocking=True)


def statistics(ctx, norm: nn.GroupNorm, x: Banded) -> torch.Tensor:
    """The whole image's GroupNorm (scale, shift) [N, C, 2] of ``x``: each
    band's moments (taken as the band was made where they were, else now),
    merged exactly across bands and processes."""
    made = x.moments.get(norm.num_groups)
    local = [made[i] if made is not None and made[i] is not None
             else band_moments(_on_device(ctx, x.parts[i]), norm.num_groups, ctx.kernels) for i in ctx.comm.held]
    moments = merge(ctx.comm.all_moments(local))
    return scale_shift(moments, norm, x.like().shape[1])


def stats_hint(ctx, norm: Optional[nn.GroupNorm]):
    """``Comm.begin``'s ``stats`` for an output ``norm`` normalises next."""
    if norm is None:
        return None
    groups = norm.num_groups
    return groups, lambda band: band_moments(band, groups, ctx.kernels)


def conv_layer(ctx, m: nn.Conv2d, pad, x: Banded, *, pre: Optional[nn.GroupNorm] = None,
               residual: Optional[Banded] = None, out_scale: float = 1.0,
               next_norm: Optional[nn.GroupNorm] = None) -> Banded:
    """``out_scale * (m(silu(pre(x))) + residual)`` over the bands of ``x``
    (``pre``: a GroupNorm and SiLU before the conv, with the whole image's
    statistics; the normalised band plus halo is made band by band, never
    whole). Each band's conv gets the rows it reads as one view where they
    are on the device, and padding only on the image-edge sides
    (``steps.conv``'s padding replaces the module's)."""
    comm = ctx.comm
    ss = None if pre is None else statistics(ctx, pre, x)
    spec = Conv(m, pad)
    (kh, _), (sh, _) = m.kernel_size, m.stride
    l, r, t, _ = pad
    h_in, w_in = x.level.height, x.like().shape[3]
    h_out, w_out = spec.out_hw(h_in, w_in)
    if sh == 1 and h_out == h_in:
        level = x.level
    elif sh == 2:
        level = x.level.halved(h_out)
    else:
        raise UnsupportedModel(f"{m}: bands take convs that keep the height or halve it")
    wins = [window(level.rows(i), kh, sh, t, h_in) for i in range(level.bands)]
    check_halo(x.level, wins)
    comm.prepare(x, wins)
    out = comm.begin(level, stats_hint(ctx, next_norm))
    for i in comm.held:
        w = wins[i]
        xv = comm.window(x, i, w)
        if ss is not None:
            xv = normalise(xv, ss, "silu", ctx.kernels)
        res = None if residual is None else _on_device(ctx, residual.parts[i])
        dst = out.target(i, xv, m.out_channels, w_out)
        y = steps.conv(m, xv, padding=(l, r, w.top, w.bottom), residual=res, out_scale=out_scale, out=dst)
        out.put(i, y)
    return out.done()


def up_layer(ctx, m: nn.Conv2d, x: Banded, next_norm: Optional[nn.GroupNorm] = None) -> Banded:
    """Nearest x2 then ``m`` (3x3, padding 1) over the bands of ``x``: each
    band with one low-resolution halo row on each inner side goes through
    ``steps.upsample_conv`` (the subpixel fold where it runs), whose output
    rows next to an inner side (computed against the view's zero padding
    instead of the neighbour's row) are cut away: two per halo row."""
    comm = ctx.comm
    h_in = x.level.height
    level = x.level.scaled(2, 2 * h_in)
    wins = [window(x.level.rows(i), 3, 1, 1, h_in) for i in range(x.level.bands)]
    check_halo(x.level, wins)
    comm.prepare(x, wins)
    out = comm.begin(level, stats_hint(ctx, next_norm))
    for i in comm.held:
        w = wins[i]
        a, b = x.level.rows(i)
        y = steps.upsample_conv(m, comm.window(x, i, w))
        skip = 2 * (a - w.lo)
        out.put(i, y[:, :, skip:skip + 2 * (b - a)])
    return out.done()


def run(program: Program, x: torch.Tensor, comm: Comm, first: Level) -> Banded:
    """The program's layers over the bands of ``first`` (the input's level),
    from an input every process holds whole."""
    ctx = Context(comm, program.patched and _kernels_here(x))
    if program.patched and ctx.kernels:
        x = steps.channels_last(x)
    act = Banded.of_whole(first, x)
    for k, step in enumerate(program.steps):
        ctx.next_norm = first_norm(program.steps[k + 1]) if k + 1 < len(program.steps) else None
        act = step.run(ctx, act)
    return act


def _kernels_here(x) -> bool:
    from conv_patch.target import target_for
    return target_for(x.device).kernels


# -- recognising the models ------------------------------------------------------
def _match(name: str, m) -> bool:
    try:
        return bool(REGISTRY[name].match(m))
    except Exception:  # noqa: BLE001 - an odd module simply does not match
        return False


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise UnsupportedModel(f"bands: {what}")


def _resnet(r, family: str) -> Resnet:
    if family == "diffusers":
        _need(_match("diffusers.ResnetBlock2D", r), f"{type(r).__name__} is not a VAE ResnetBlock2D")
        return Resnet(r.norm1, r.conv1, r.norm2, r.conv2, r.conv_shortcut, 1.0 / r.output_scale_factor)
    _need(_match("ldm.ResnetBlock", r), f"{type(r).__name__} is not an ldm ResnetBlock")
    sc = None if r.in_channels == r.out_channels else (r.conv_shortcut if r.use_conv_shortcut else r.nin_shortcut)
    return Resnet(r.norm1, r.conv1, r.norm2, r.conv2, sc, 1.0)


def _tail(m, norm, act_ok: bool):
    _need(steps.is_group_norm(norm) and act_ok and steps.is_conv(m.conv_out, 3, 1, 1), "unknown tail")
    return NormConv(norm, m.conv_out)


def _diffusers_mid(mid) -> list:
    _need(getattr(type(mid), "_cp_base", type(mid)).__name__ == "UNetMidBlock2D", "the mid block is not "
          "UNetMidBlock2D")
    out = [_resnet(mid.resnets[0], "diffusers")]
    for attn, r in zip(mid.attentions, mid.resnets[1:]):
        if attn is not None:
            out.append(Whole(attn))
        out.append(_resnet(r, "diffusers"))
    return out


def _ldm_attn(a) -> list:
    if type(a) is nn.Identity:
        return []
    _need(isinstance(a, nn.Module), "unknown attention")
    return [Whole(a)]


def program_of(m: nn.Module) -> Program:
    """The band program of a diffusers or ldm/ComfyUI ``Decoder`` or
    ``Encoder``; ``UnsupportedModel`` for anything else."""
    if _match("diffusers.Decoder", m):
        _need(steps.is_conv(m.conv_in, 3, 1, 1), "conv_in is not a 3x3 conv")
        ops = [Conv(m.conv_in, own_pad(m.conv_in))] + _diffusers_mid(m.mid_block)
        for up in m.up_blocks:
            ops += [_resnet(r, "diffusers") for r in up.resnets]
            for u in up.upsamplers or ():
                _need(_match("diffusers.Upsample2D", u), "an upsampler is not a nearest-x2 Upsample2D with a conv")
                ops.append(Up(u.conv if getattr(u, "name", "conv") == "conv" else u.Conv2d_0))
        ops.append(_tail(m, m.conv_norm_out, steps.is_silu(m.conv_act)))
        return Program("decoder", "diffusers", ops, m)
    if _match("diffusers.Encoder", m):
        _need(steps.is_conv(m.conv_in, 3, 1, 1), "conv_in is not a 3x3 conv")
        ops = [Conv(m.conv_in, own_pad(m.conv_in))]
        for d in m.down_blocks:
            _need(getattr(d, "_cp_base", type(d)).__name__ == "DownEncoderBlock2D", "a down block is not "
                  "DownEncoderBlock2D")
            ops += [_resnet(r, "diffusers") for r in d.resnets]
            for s in d.downsamplers or ():
                _need(_match("diffusers.Downsample2D", s), "a downsampler is not Downsample2D(padding=0)")
                ops.append(Conv(s.conv, _plus(own_pad(s.conv), (0, 1, 0, 1))))
        ops += _diffusers_mid(m.mid_block)
        ops.append(_tail(m, m.conv_norm_out, steps.is_silu(m.conv_act)))
        return Program("encoder", "diffusers", ops, m)
    if _match("ldm.Decoder", m):
        _need(not getattr(m, "give_pre_end", False) and not getattr(m, "tanh_out", False),
              "give_pre_end / tanh_out are not taken")
        _need(uses_silu(m) and steps.is_conv(m.conv_in, 3, 1, 1), "unknown ldm Decoder")
        ops = [Conv(m.conv_in, own_pad(m.conv_in)), _resnet(m.mid.block_1, "ldm"), *_ldm_attn(m.mid.attn_1),
               _resnet(m.mid.block_2, "ldm")]
        for lvl in reversed(range(m.num_resolutions)):
            up = m.up[lvl]
            for j, b in enumerate(up.block):
                ops.append(_resnet(b, "ldm"))
                if len(up.attn) > 0:
                    ops += _ldm_attn(up.attn[j])
            if lvl != 0:
                _need(_match("ldm.Upsample", up.upsample), "an Upsample has no conv")
                ops.append(Up(up.upsample.conv))
        ops.append(_tail(m, m.norm_out, True))
        return Program("decoder", "ldm", ops, m)
    if _match("ldm.Encoder", m):
        _need(uses_silu(m) and steps.is_conv(m.conv_in, 3, 1, 1), "unknown ldm Encoder")
        ops = [Conv(m.conv_in, own_pad(m.conv_in))]
        for lvl in range(m.num_resolutions):
            down = m.down[lvl]
            for j, b in enumerate(down.block):
                ops.append(_resnet(b, "ldm"))
                if len(down.attn) > 0:
                    ops += _ldm_attn(down.attn[j])
            if lvl != m.num_resolutions - 1:
                _need(_match("ldm.Downsample", down.downsample), "a Downsample has no conv (avg-pool)")
                ops.append(Conv(down.downsample.conv, _plus(own_pad(down.downsample.conv), (0, 1, 0, 1))))
        ops += [_resnet(m.mid.block_1, "ldm"), *_ldm_attn(m.mid.attn_1), _resnet(m.mid.block_2, "ldm")]
        ops.append(_tail(m, m.norm_out, True))
        return Program("encoder", "ldm", ops, m)
    raise UnsupportedModel(f"bands: {type(m).__name__} is not a VAE Decoder or Encoder the recipes recognise")


def _plus(a, b):
    return tuple(x + y for x, y in zip(a, b))


def blocked_reason(m: nn.Module, x: torch.Tensor) -> Optional[str]:
    """Why this call must run the plain forward instead of bands: hooks on
    any module below (a hook expects to see its module run on the whole
    tensor), a dropout in training mode, or autograd (the band steps compute
    no backward)."""
    if not steps.plain():
        return "global forward hooks are installed"
    for name, sub in m.named_modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            return f"forward hooks on {name or type(m).__name__}"
        if isinstance(sub, nn.Dropout) and not steps.dropout_is_identity(sub):
            return f"{name} is an active dropout (training mode): bands compute inference"
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in m.parameters())):
        return "autograd is needed (run under torch.no_grad() or torch.inference_mode() for bands)"
    return None
