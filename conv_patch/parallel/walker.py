"""A VAE encoder's or decoder's layers run over bands, layer-major: each
layer over all bands before the next layer starts, because a GroupNorm must
see every band's statistics before it normalises any band.

The layers are what the block's recipe declares (``Recipe.bands``:
``recipes/layers.py``'s ``Conv``, ``Resnet``, ``Up``, ``Whole``,
``NormConv``); ``program_of`` asks it, so the model families are known in
one place, their recipes. Each layer reads its input band plus halo
(``Comm.window``) and calls the recipes' fused steps
(``conv_patch.recipes.fuse``), so a patched model runs its kernels, cache and
fallback exactly as in an unbanded call, and an unpatched one runs PyTorch.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
from torch import nn

from conv_patch.recipes import catalog
from conv_patch.recipes import fuse as steps
from conv_patch.recipes.layers import Conv, NormConv, Resnet, Up, UnsupportedModel, Whole, own_pad
from conv_patch.runtime import passthrough
from conv_patch.runtime.wrappers import PatchedConvMixin
from conv_patch.parallel.comm import Banded, Comm
from conv_patch.parallel.geometry import Level, check_halo, window
from conv_patch.parallel.stats import band_moments, merge, normalise, scale_shift


@dataclasses.dataclass
class Program:
    kind: str  # "decoder" | "encoder"
    recipe: str  # the recipe that declared the layers
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
        act = RUNNERS[type(step)](step, ctx, act)
    return act


def _kernels_here(x) -> bool:
    from conv_patch.target import target_for
    return target_for(x.device).kernels


def _run_conv(step: Conv, ctx, x):
    return conv_layer(ctx, step.m, step.pad, x, next_norm=ctx.next_norm)


def _run_resnet(step: Resnet, ctx, x):
    h = conv_layer(ctx, step.conv1, own_pad(step.conv1), x, pre=step.norm1, next_norm=step.norm2)
    sc = x if step.shortcut is None else conv_layer(ctx, step.shortcut, own_pad(step.shortcut), x)
    return conv_layer(ctx, step.conv2, own_pad(step.conv2), h, pre=step.norm2, residual=sc,
                      out_scale=step.out_scale, next_norm=ctx.next_norm)


def _run_up(step: Up, ctx, x):
    return up_layer(ctx, step.conv, x, next_norm=ctx.next_norm)


def _run_whole(step: Whole, ctx, x):
    # Run on the whole tensor, gathered to every process (it runs at the
    # latent resolution, the smallest).
    y = step.m(ctx.comm.whole(x))
    return Banded.of_whole(x.level, y)


def _run_norm_conv(step: NormConv, ctx, x):
    return conv_layer(ctx, step.conv, own_pad(step.conv), x, pre=step.norm, next_norm=ctx.next_norm)


# How each kind of layer runs over bands.
RUNNERS = {Conv: _run_conv, Resnet: _run_resnet, Up: _run_up, Whole: _run_whole, NormConv: _run_norm_conv}


def program_of(m: nn.Module) -> Program:
    """The band program of a decoder or encoder whose recipe declares its
    layers (``Recipe.bands``: diffusers' and the ldm/ComfyUI ones);
    ``UnsupportedModel`` for anything else."""
    recipe = getattr(type(m), "cp_recipe", None) or catalog.recipe_for(m)
    if recipe is None or recipe.bands is None:
        raise UnsupportedModel(f"bands: {type(m).__name__} is not a VAE Decoder or Encoder the recipes recognise")
    layers = recipe.bands(m)
    return Program(layers.kind, recipe.name, layers.steps, m)


def blocked_reason(m: nn.Module, x: torch.Tensor) -> Optional[str]:
    """Why this call must run the plain forward instead of bands: hooks on
    any module below (a hook expects to see its module run on the whole
    tensor), a dropout in training mode, or autograd (the band steps compute
    no backward)."""
    if not steps.plain():
        return "global forward hooks are installed"
    for name, sub in m.named_modules():
        if passthrough.other_hooks(sub):
            return f"forward hooks on {name or type(m).__name__}"
        if isinstance(sub, nn.Dropout) and not steps.dropout_is_identity(sub):
            return f"{name} is an active dropout (training mode): bands compute inference"
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in m.parameters())):
        return "autograd is needed (run under torch.no_grad() or torch.inference_mode() for bands)"
    return None
