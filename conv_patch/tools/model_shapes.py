"""The convolutions a model runs, read off the model itself.

A model is built on the ``meta`` device (no memory, no weights) and run once
on meta tensors with a pre-hook on every convolution; each hook records the
module's ``ConvSpec`` and its input shape. The tuner and the benchmarks use
this, so their shape lists come from the architectures, not from a copy that
could drift.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from conv_patch.specs import ConvSpec


@dataclass(frozen=True)
class ConvCall:
    """One distinct convolution call: what ran, on what input shape, where."""

    spec: ConvSpec
    shape: Tuple[int, int, int, int]
    where: str  # e.g. "flux decoder @1024"

    def describe(self) -> str:
        n, c, h, w = self.shape
        return f"{self.spec.describe()} on {n}x{c}x{h}x{w}"


def _padded_downsample_convs(model: nn.Module) -> set:
    """The convs of diffusers ``Downsample2D`` blocks that pad (0, 1, 0, 1)
    with ``F.pad`` before a stride-2 conv of their own padding 0: the block
    recipe folds that pad into the conv (``recipes/diffusers.py``), so the
    patched model runs them on the unpadded input."""
    out = set()
    for m in model.modules():
        conv = getattr(m, "conv", None)
        if (type(m).__name__ == "Downsample2D" and getattr(m, "padding", None) == 0
                and isinstance(conv, nn.Conv2d) and tuple(conv.padding) == (0, 0)):
            out.add(id(conv))
    return out


def trace_convs(model: nn.Module, run: Callable[[nn.Module], object]) -> "Counter[Tuple[ConvSpec, tuple]]":
    """Counter of (spec, input shape) over every conv call of ``run(model)``,
    and the folded forms the block recipes run instead: for a padding
    Downsample2D's conv the unpadded input with the pad as the conv's end
    padding, for an upsampling conv (nearest x2, then 3x3) the four 2x2
    convs of the small input, one per output parity, each with its own
    asymmetric padding (``ops.upsample_conv2d``). ``model`` should live on
    the meta device."""
    from conv_patch.recipes.catalog import upsample_convs

    seen: "Counter[Tuple[ConvSpec, tuple]]" = Counter()
    folded = _padded_downsample_convs(model)
    upsampling = upsample_convs(model)

    def hook(mod, args):
        x = args[0]
        shape = tuple(x.shape) if x.dim() == 4 else (1,) + tuple(x.shape)
        spec = ConvSpec.from_module(mod)
        seen[(spec, shape)] += 1
        if id(mod) in folded:
            n, c, h, w = shape
            seen[(dataclasses.replace(spec, pad_end=(1, 1)), (n, c, h - 1, w - 1))] += 1
        if id(mod) in upsampling:
            n, c, h, w = shape
            for a in (0, 1):
                for b in (0, 1):
                    sub = dataclasses.replace(spec, kernel=(2, 2), pad_begin=(1 - a, 1 - b), pad_end=(a, b))
                    seen[(sub, (n, c, h // 2, w // 2))] += 1

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return seen


def _autoencoder_kl(latent: int, quant: bool) -> nn.Module:
    from diffusers import AutoencoderKL
    with torch.device("meta"):
        return AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=latent,
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=[128, 256, 512, 512], layers_per_block=2,
            use_quant_conv=quant, use_post_quant_conv=quant)


def _taesd(latent: int, pool: bool):
    from conv_patch.tools import taesd
    with torch.device("meta"):
        return taesd.encoder(latent, pool=pool), taesd.decoder(latent, pool=pool)


# family -> (description, latent channels, builder of (encoder, decoder) runners)
FAMILIES: Dict[str, Tuple[str, int]] = {
    "flux": ("diffusers AutoencoderKL of FLUX.1 and SD3 (16-channel latent, no quant convs)", 16),
    "sd": ("diffusers AutoencoderKL of SD1.5 and SDXL (4-channel latent, quant convs)", 4),
    "taesd": ("TAESD tiny autoencoder (4-channel latent)", 4),
    "taef2": ("TAEF2 tiny autoencoder (32-channel latent, GroupNorm pools)", 32),
}
PARTS = ("decoder", "encoder")


def family_convs(family: str, resolution: int, batch: int = 1, parts=PARTS) -> "Counter[ConvCall]":
    """Counter of ConvCall over a family's decoder and/or encoder at an image
    of ``resolution``^2 pixels (the latent is 1/8 of it)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: expected one of {', '.join(FAMILIES)}")
    if resolution % 8:
        raise ValueError(f"resolution {resolution} is not a multiple of 8")
    latent = FAMILIES[family][1]
    z = torch.empty(batch, latent, resolution // 8, resolution // 8, device="meta")
    img = torch.empty(batch, 3, resolution, resolution, device="meta")
    runs = {}
    if family in ("flux", "sd"):
        vae = _autoencoder_kl(latent, quant=family == "sd")
        runs["decoder"] = (vae, lambda m: m.decode(z, return_dict=False))
        runs["encoder"] = (vae, lambda m: m.encode(img, return_dict=False))
    else:
        enc, dec = _taesd(latent, pool=family == "taef2")
        runs["decoder"] = (dec, lambda m: m(z))
        runs["encoder"] = (enc, lambda m: m(img))
    out: "Counter[ConvCall]" = Counter()
    for part in parts:
        model, run = runs[part]
        for (spec, shape), count in trace_convs(model, run).items():
            out[ConvCall(spec, shape, f"{family} {part} @{resolution}")] += count
    return out


def distinct_calls(families, resolutions, batches, parts=PARTS) -> List[ConvCall]:
    """Every distinct (geometry, input shape) once, in first-seen order,
    labelled by the first model that runs it. Bias or not does not split a
    shape: the config tables do not key on it."""
    seen = {}
    for fam in families:
        for res in resolutions:
            for n in batches:
                for call in family_convs(fam, res, n, parts):
                    seen.setdefault((dataclasses.replace(call.spec, has_bias=False), call.shape), call)
    return list(seen.values())
