"""Model-family rewrites, installed as ``conv_patch.recipes``.

``conv_patch.apply(model)`` runs :func:`plan` over the model and gives each
recognised block a fused forward (see ``fuse.py`` for how, and why the block
object itself is kept); ``apply(model, recipes=False)`` skips this and only
swaps convolutions. The order below is the matching order: the first recipe
that matches a module takes it.
"""

from __future__ import annotations

from typing import List, Tuple

from torch import nn

from . import cogvideox, common, dcae, diffusers, esrgan, hunyuan, ldm, ltx, mochi, transformer2d, video_pass, wan  # noqa: F401  (registration)
from .fuse import REGISTRY, FusedBlock, Recipe, fused_class, is_fused
from conv_patch.runtime.state import peek

ORDER = [
    diffusers.RESNET, diffusers.COND_NORM_RESNET, diffusers.SPATIAL_NORM, diffusers.UPSAMPLE, diffusers.DOWNSAMPLE,
    diffusers.ATTENTION, transformer2d.TRANSFORMER_2D, diffusers.DECODER,
    diffusers.ENCODER, diffusers.TINY_BLOCK, ldm.RESNET, ldm.ATTN, ldm.UPSAMPLE, ldm.DOWNSAMPLE, ldm.DECODER,
    ldm.ENCODER, wan.RESIDUAL, wan.COMFY_RESIDUAL, wan.ATTENTION, wan.RMS_NORM, wan.DECODER, wan.RESAMPLE,
    wan.RESIDUAL_UP, hunyuan.RESNET, ltx.RESNET, cogvideox.RESNET, mochi.RESNET, esrgan.RESIDUAL_DENSE,
    esrgan.RRDB_RECIPE, esrgan.COMPACT, dcae.RESBLOCK, dcae.UP_BLOCK, dcae.DECODER, dcae.MULTISCALE_PROJECTION,
    common.SEQUENTIAL, common.GROUP_NORM,
]


def recipe_for(module: nn.Module):
    """The recipe that takes ``module``, or None."""
    if is_fused(module):
        return None
    for r in ORDER:
        try:
            if r.match(module):
                return r
        except Exception:  # noqa: BLE001 - an odd module is simply not matched
            continue
    return None


def plan(model: nn.Module, prefix: str = "") -> List[Tuple[str, nn.Module, Recipe]]:
    """(path, module, recipe) for every module of ``model`` a recipe takes
    (each shared module once)."""
    out, seen = [], set()
    for fqn, m in model.named_modules(prefix=prefix.rstrip(".")):
        if id(m) in seen:
            continue
        seen.add(id(m))
        r = recipe_for(m)
        if r is not None:
            out.append((fqn, m, r))
    return out


def fuse(module: nn.Module, recipe: Recipe) -> None:
    module.__class__ = fused_class(type(module), recipe)
    if recipe.whole_from is not None:
        from conv_patch.runtime import compiled
        compiled.register_whole(module)


def unfuse(module: nn.Module) -> None:
    if is_fused(module):
        module.__class__ = module.cp_base
        st = peek(module)
        if st is not None:
            st.drop_block()


__all__ = ["ORDER", "REGISTRY", "FusedBlock", "Recipe", "recipe_for", "plan", "fuse", "unfuse", "is_fused",
           "pass_methods", "pass_inputs"]

# The families whose video VAEs compile ahead at their first decode / encode
# (the compiling pass, ``conv_patch.warmup``), and what input their pass takes
# (``video_pass``: the clip cut short).
PASS_FAMILIES = (wan, *video_pass.FAMILIES)


def pass_methods(model: nn.Module) -> tuple:
    """The methods of ``model`` (a video VAE) hooked to compile ahead at
    their first call: () for a family without a pass of its own."""
    for family in PASS_FAMILIES:
        names = family.pass_methods(model)
        if names:
            return names
    return ()


def pass_inputs(model: nn.Module, method: str, args: tuple, kwargs: dict) -> tuple:
    """(args, kwargs) the compiling pass of ``model.<method>`` calls it with:
    the family's (a video VAE's clip cut short), else the call's own."""
    for family in PASS_FAMILIES:
        if method in family.pass_methods(model):
            return family.pass_inputs(model, method, args, kwargs)
    return args, kwargs


def upsample_convs(model: nn.Module) -> set:
    """ids of the convs in ``model`` that the recipes would run as the
    subpixel fold of a nearest-x2 upsample (``Recipe.upsample_convs``)."""
    out = set()
    for m in model.modules():
        r = recipe_for(m)
        if r is not None:
            out.update(id(c) for c in r.upsample_convs(m) if c is not None)
    return out
