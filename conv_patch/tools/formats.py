"""Which VAE a checkpoint holds, from tensor names and shapes alone.

Recognised: diffusers ``AutoencoderKL`` (SD1.5/SDXL/SD3/FLUX.1 layouts), the
original single-file layout (ComfyUI, the SD repositories, FLUX ``ae``; bare
or under ``first_stage_model.``/``vae.``), TAESD-format ``nn.Sequential``
encoders/decoders, diffusers ``AutoencoderTiny``, the Wan-family video
VAEs (diffusers ``AutoencoderKLWan``, Wan 2.1's and 2.2's, in its own layout
and in the original Wan repository's), and diffusers' CogVideoX, Mochi,
HunyuanVideo and LTX-Video VAEs as released (``VIDEO_DEFAULTS``), in
diffusers' layout (HunyuanVideo's own) and in the original ones: LTX-Video's,
Mochi's (genmo, ComfyUI), CogVideoX's (SAT) and HunyuanVideo's as ComfyUI
holds it; alone or under ``first_stage_model.``/``vae.``. Each recognised
format knows how to build its model (the diffusers class or the package's
own TAESD module), how to decode/encode with it, and the geometry of each
convolution weight (2-D and 3-D) for the per-layer check. Anything else gets the per-layer check alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

Shapes = Dict[str, tuple]
LDM_PREFIXES = ("first_stage_model.", "vae.")
# What ``recognise`` knows, in the words ``convpatch verify --help`` and the
# README use.
KNOWN = (
    "diffusers AutoencoderKL (SD1.5, SDXL, SD3, FLUX.1 layouts)",
    "the original single-file layout (ComfyUI, the SD repositories, FLUX ae; bare or under first_stage_model.)",
    "TAESD and TAEF2 encoders and decoders",
    "diffusers AutoencoderTiny",
    "the Wan 2.1 and Wan 2.2 (TI2V-5B) video VAEs, in diffusers' (AutoencoderKLWan) and the original Wan layout",
    "the CogVideoX, Mochi 1, HunyuanVideo and LTX-Video (0.9.0) video VAEs in diffusers' layout, as released",
    "the LTX-Video (0.9.0) video VAE in its original layout too (alone, as ComfyUI loads it, or under vae. in a "
    "whole checkpoint), read through diffusers' own converter",
    "the Mochi 1 (genmo's files, ComfyUI's mochi_vae.safetensors), CogVideoX (SAT) and HunyuanVideo (as ComfyUI "
    "holds it) video VAEs in their original layouts, alone or under vae. or first_stage_model.",
)


def same_geometry3d(name: str, shape: tuple) -> Tuple[tuple, tuple]:
    """Stride 1 and 'same' padding at both ends of each axis: the guess for
    a 5-D weight of a format that says nothing else."""
    return (1, 1, 1), tuple((k // 2, k // 2) for k in shape[2:5])


@dataclass
class Format:
    kind: str
    description: str
    # Per-layer geometry of a 4-D weight: (stride, padding) for its conv.
    geometry: Callable[[str, tuple], Tuple[int, int]] = lambda name, shape: (1, shape[2] // 2)
    # Of a 5-D weight: (stride (t, h, w), padding ((front, back) per axis)).
    geometry3d: Callable[[str, tuple], Tuple[tuple, tuple]] = same_geometry3d
    build: Optional[Callable[[Dict[str, torch.Tensor]], nn.Module]] = None
    decode: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]] = None
    encode: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]] = None
    latent_channels: int = 0
    factor: int = 8
    image_range: Tuple[float, float] = (-1.0, 1.0)
    # A video model's end-to-end inputs: latent frames decoded, frames
    # encoded (0: an image model, 4-D inputs).
    latent_frames: int = 0
    video_frames: int = 0
    # Set where the file is plainly of this format but cannot be a model of
    # it (a tensor missing or of the wrong shape): bad input, not a fallback.
    problem: str = ""

    @property
    def recognised(self) -> bool:
        return self.build is not None


def _idx(keys, pattern):
    """Sorted distinct integers captured by ``pattern`` over ``keys``."""
    rx = re.compile(pattern)
    return sorted({int(m.group(1)) for k in keys for m in [rx.match(k)] if m})


# -- diffusers AutoencoderKL ---------------------------------------------------

_OLD_ATTN = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


# Where each layout keeps what the config is read from: per-level block
# prefixes, the first resnet's conv2 (its output width is the level's width),
# resnet indices, whether decoder levels run in reverse, the mid attention.
_KL_LAYOUTS = {
    "diffusers": dict(enc=r"encoder\.down_blocks\.(\d+)\.", dec=r"decoder\.up_blocks\.(\d+)\.",
                      enc_conv2="encoder.down_blocks.{}.resnets.0.conv2.weight",
                      dec_conv2="decoder.up_blocks.{}.resnets.0.conv2.weight",
                      enc_res=r"encoder\.down_blocks\.0\.resnets\.(\d+)\.",
                      dec_res=r"decoder\.up_blocks\.0\.resnets\.(\d+)\.",
                      dec_reversed=True, attn=".mid_block.attentions."),
    "ldm": dict(enc=r"encoder\.down\.(\d+)\.", dec=r"decoder\.up\.(\d+)\.",
                enc_conv2="encoder.down.{}.block.0.conv2.weight", dec_conv2="decoder.up.{}.block.0.conv2.weight",
                enc_res=r"encoder\.down\.0\.block\.(\d+)\.", dec_res=r"decoder\.up\.0\.block\.(\d+)\.",
                dec_reversed=False, attn=".mid.attn_1."),
}


def _kl_config(shapes: Shapes, layout: str) -> dict:
    """AutoencoderKL's constructor arguments read off a checkpoint's shapes."""
    L, keys = _KL_LAYOUTS[layout], list(shapes)
    enc_levels = _idx(keys, L["enc"])
    if enc_levels:
        block_out = [shapes[L["enc_conv2"].format(i)][0] for i in enc_levels]
        layers = len(_idx(keys, L["enc_res"]))
    else:  # decoder-only file; its levels have one resnet more
        block_out = [shapes[L["dec_conv2"].format(i)][0] for i in _idx(keys, L["dec"])]
        block_out = block_out[::-1] if L["dec_reversed"] else block_out
        layers = len(_idx(keys, L["dec_res"])) - 1
    latent = (shapes["decoder.conv_in.weight"][1] if "decoder.conv_in.weight" in shapes
              else shapes["encoder.conv_out.weight"][0] // 2)
    return dict(
        in_channels=shapes["encoder.conv_in.weight"][1] if "encoder.conv_in.weight" in shapes else 3,
        out_channels=shapes["decoder.conv_out.weight"][0] if "decoder.conv_out.weight" in shapes else 3,
        down_block_types=("DownEncoderBlock2D",) * len(block_out),
        up_block_types=("UpDecoderBlock2D",) * len(block_out),
        block_out_channels=tuple(block_out), layers_per_block=layers, latent_channels=latent,
        norm_num_groups=32, use_quant_conv="quant_conv.weight" in shapes,
        use_post_quant_conv="post_quant_conv.weight" in shapes,
        mid_block_add_attention=any(L["attn"] in k for k in keys),
    )


def _build_kl(config: dict, state: Dict[str, torch.Tensor]) -> nn.Module:
    from diffusers import AutoencoderKL
    model = AutoencoderKL(**config)
    fixed = {}
    for k, v in state.items():
        for old, new in _OLD_ATTN.items():
            k = k.replace(old, new)
        if ".attentions." in k and v.dim() == 4 and v.shape[2:] == (1, 1):
            v = v[:, :, 0, 0]  # attention projections stored as 1x1 convs
        fixed[k] = v
    missing, unexpected = model.load_state_dict(fixed, strict=False)
    part_missing = {k.split(".")[0] for k in missing}
    if unexpected or (missing and not ({"encoder"} >= part_missing or {"decoder"} >= part_missing)):
        raise ValueError(f"layout does not match AutoencoderKL{tuple(config['block_out_channels'])}: "
                         f"{len(missing)} missing, {len(unexpected)} unexpected keys")
    return model


def _kl_format(kind, description, shapes, config, convert=None) -> Format:
    has_enc = any(k.startswith("encoder.") for k in shapes)
    has_dec = any(k.startswith("decoder.") for k in shapes)

    def build(state):
        return _build_kl(config, convert(state) if convert else state)

    def down_geometry(name, shape):
        # Downsample2D pads (0, 1, 0, 1) itself, then runs an unpadded stride-2 conv.
        if ".downsamplers." in name or ".downsample." in name:
            return 2, 0
        return 1, shape[2] // 2

    return Format(
        kind=kind, description=description, geometry=down_geometry, build=build,
        decode=(lambda m, z: m.decode(z).sample) if has_dec else None,
        encode=(lambda m, x: m.encode(x).latent_dist.mode()) if has_enc else None,
        latent_channels=config["latent_channels"], factor=2 ** (len(config["block_out_channels"]) - 1),
        image_range=(-1.0, 1.0))


def _describe_kl(config):
    return (f"AutoencoderKL block_out_channels={list(config['block_out_channels'])}, layers_per_block="
            f"{config['layers_per_block']}, latent_channels={config['latent_channels']}, quant convs: "
            f"{'yes' if config['use_quant_conv'] else 'no'}")


# -- original single-file (ldm) layout ---------------------------------------

def _ldm_to_diffusers(config):
    def convert(state):
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
        return convert_ldm_vae_checkpoint(state, config)
    return convert


# -- TAESD-format Sequential and diffusers AutoencoderTiny ------------------

def taesd_plan(shapes: Shapes, prefix: str = "", decoder: Optional[bool] = None) -> Optional[list]:
    """The layer list of a TAESD-format Sequential from its keys, or None.

    ("conv", c_in, c_out, k, stride, bias) | ("block", c_in, c_out, pool) |
    ("clamp",) | ("relu",) | ("upsample",). A TAESD decoder starts with the
    clamp (index 0 has no parameters; AutoencoderTiny's decoder, whose clamp is
    in forward, is read with ``decoder=True``); in an encoder the bias-free
    convs are the stride-2 ones; in a decoder a parameter-free index right
    after the first conv is its ReLU, any later one an upsample.
    """
    keys = [k[len(prefix):] for k in shapes if k.startswith(prefix)]
    if not keys or not all(re.match(r"\d+\.", k) for k in keys):
        return None
    s = {k: shapes[prefix + k] for k in keys}
    used = {int(k.split(".")[0]) for k in keys}
    last = max(used)
    # A TAESD stack's parameter-free layers (clamp, ReLU, upsample) are a
    # few between its parameterised ones; an index far past the tensors a
    # file has is no TAESD layout, and must not cost a loop that long.
    if last > 2 * len(used) + 8:
        return None
    if decoder is None:
        decoder = "0.weight" not in s
    plan, first_conv = [], None
    for i in range(last + 1):
        if f"{i}.weight" in s:
            c_out, c_in, kh, kw = (tuple(s[f"{i}.weight"]) + (0, 0, 0, 0))[:4]
            if len(s[f"{i}.weight"]) != 4 or kh != kw:
                return None
            bias = f"{i}.bias" in s
            stride = 2 if (not decoder and not bias and i != 0 and i != last) else 1
            plan.append(("conv", c_in, c_out, kh, stride, bias))
            first_conv = i if first_conv is None else first_conv
        elif f"{i}.conv.0.weight" in s and f"{i}.conv.4.weight" in s:
            plan.append(("block", s[f"{i}.conv.0.weight"][1], s[f"{i}.conv.4.weight"][0],
                         f"{i}.pool.0.weight" in s))
        elif i in used:
            return None
        elif decoder and i == 0 and "0.weight" not in s:
            plan.append(("clamp",))
        elif decoder and first_conv == i - 1:
            plan.append(("relu",))
        elif decoder:
            plan.append(("upsample",))
        else:
            return None
    return plan


def _strided(plan) -> set:
    """Sequential indices of a plan's stride-2 convs (plan index = layer index)."""
    return {i for i, p in enumerate(plan) if p[0] == "conv" and p[4] == 2}


def _taesd_format(plan: list) -> Format:
    from conv_patch.tools import taesd
    decoder = plan[0] == ("clamp",)
    convs = [p for p in plan if p[0] == "conv"]
    latent = convs[0][1] if decoder else convs[-1][2]
    strided = _strided(plan)

    def build(state):
        model = taesd.from_plan(plan)
        model.load_state_dict(state)
        return model

    def geometry(name, shape):
        return (2 if int(name.split(".")[0]) in strided else 1), shape[2] // 2

    n_blocks = sum(p[0] == "block" for p in plan)
    return Format(
        kind="taesd-decoder" if decoder else "taesd-encoder",
        description=(f"TAESD-format {'decoder' if decoder else 'encoder'}: {latent} latent channels, "
                     f"{convs[0][2]} wide, {n_blocks} blocks"
                     + (", pooled blocks" if any(p[0] == "block" and p[3] for p in plan) else "")),
        geometry=geometry, build=build,
        decode=(lambda m, z: m(z)) if decoder else None,
        encode=None if decoder else (lambda m, x: m(x)),
        latent_channels=latent, factor=8, image_range=(0.0, 1.0))


def _tiny_config(enc: list, dec: list) -> dict:
    """AutoencoderTiny's constructor arguments from its two layer plans."""

    def stages(plan):
        """Blocks per stage and their width; a stage is the run of blocks
        between two convs."""
        counts, chans, n = [], [], 0
        for p in plan:
            if p[0] == "block":
                n += 1
                last = p[2]
            elif p[0] == "conv" and n:
                counts.append(n)
                chans.append(last)
                n = 0
        if n:
            counts.append(n)
            chans.append(last)
        return tuple(counts), tuple(chans)

    enc_counts, enc_chans = stages(enc)
    dec_counts, dec_chans = stages(dec)
    return dict(encoder_block_out_channels=enc_chans, decoder_block_out_channels=dec_chans,
                num_encoder_blocks=enc_counts, num_decoder_blocks=dec_counts,
                latent_channels=enc[-1][2] if enc[-1][0] == "conv" else 4,
                in_channels=enc[0][1], out_channels=[p for p in dec if p[0] == "conv"][-1][2])


def _tiny_format(enc: list, dec: list) -> Format:
    config = _tiny_config(enc, dec)
    strided = {f"encoder.layers.{i}.weight" for i in _strided(enc)}

    def build(state):
        from diffusers import AutoencoderTiny
        model = AutoencoderTiny(**config)
        model.load_state_dict(state)
        return model

    def geometry(name, shape):
        return (2 if name in strided else 1), shape[2] // 2

    return Format(
        kind="diffusers-autoencodertiny",
        description=(f"AutoencoderTiny: {config['latent_channels']} latent channels, encoder blocks "
                     f"{list(config['num_encoder_blocks'])}, decoder blocks {list(config['num_decoder_blocks'])}"),
        geometry=geometry, build=build,
        decode=lambda m, z: m.decode(z).sample, encode=lambda m, x: m.encode(x).latents,
        latent_channels=config["latent_channels"], factor=2 ** (len(config["num_encoder_blocks"]) - 1),
        image_range=(-1.0, 1.0))


# -- Wan-family video VAEs (diffusers AutoencoderKLWan: Wan 2.1 and 2.2) -------

# The original Wan repository's layout (wan/modules/vae.py: Wan2.1_VAE.pth,
# ComfyUI's wan_2.1_vae.safetensors) to AutoencoderKLWan's names, written
# from the two modules' attribute names. A residual block there is one
# Sequential (norm, SiLU, conv, norm, SiLU, dropout, conv), the middle is
# (resnet, attention, resnet), the head (norm, SiLU, conv), and the quant
# convs are the top-level conv1/conv2. The decoder's flat ``upsamples`` list
# is regrouped into levels by wan_original_names, not by this table.
_WAN_RENAMES = [(re.compile(a), b) for a, b in (
    (r"^conv1\.", "quant_conv."),
    (r"^conv2\.", "post_quant_conv."),
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^(encoder|decoder)\.middle\.0\.", r"\1.mid_block.resnets.0."),
    (r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
    (r"^(encoder|decoder)\.middle\.2\.", r"\1.mid_block.resnets.1."),
    (r"^(encoder|decoder)\.head\.0\.", r"\1.norm_out."),
    (r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out."),
    (r"^encoder\.downsamples\.", "encoder.down_blocks."),
    (r"\.residual\.0\.", ".norm1."),
    (r"\.residual\.2\.", ".conv1."),
    (r"\.residual\.3\.", ".norm2."),
    (r"\.residual\.6\.", ".conv2."),
    (r"\.shortcut\.", ".conv_shortcut."),
)]
_WAN_ORIGINAL = re.compile(r"(encoder\.downsamples|decoder\.upsamples|encoder\.middle|decoder\.middle|"
                           r"encoder\.head|decoder\.head)\.\d+\.")
# Wan 2.2's residual up/down blocks (the TI2V-5B VAE: patchified 12-channel
# input, avg/dup shortcuts without weights, residual blocks nested in levels):
# AutoencoderKLWan(is_residual=True) names them down_blocks.L.resnets.J /
# .downsampler (up_blocks.L.resnets.J / .upsampler); the original layout
# (Wan2.2_VAE.pth, ComfyUI's wan2.2_vae.safetensors) downsamples.L.downsamples.J
# (upsamples.L.upsamples.J), the resample last in its level.
_WAN22 = re.compile(r"(encoder\.down_blocks\.\d+\.resnets\.|decoder\.up_blocks\.\d+\.upsampler\.|"
                    r"(encoder\.downsamples|decoder\.upsamples)\.\d+\.(downsamples|upsamples)\.)")
_WAN22_NESTED = re.compile(r"(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\."
                           r"(.*)")


def wan_original_names(keys) -> Dict[str, str]:
    """Original Wan layout name -> AutoencoderKLWan name, for every key.
    The decoder's ``upsamples.N`` are, level after level, num_res_blocks + 1
    residual blocks then one resample (none after the last level); a block
    is a resample when it has ``resample.``/``time_conv.`` tensors."""
    rx = re.compile(r"decoder\.upsamples\.(\d+)\.(.*)")
    flat = _idx(keys, r"decoder\.upsamples\.(\d+)\.")
    resamples = {int(m.group(1)) for k in keys for m in [rx.match(k)]
                 if m and m.group(2).startswith(("resample.", "time_conv."))}
    where, level, j = {}, 0, 0
    for n in flat:
        if n in resamples:
            where[n] = f"decoder.up_blocks.{level}.upsamplers.0."
            level, j = level + 1, 0
        else:
            where[n] = f"decoder.up_blocks.{level}.resnets.{j}."
            j += 1
    out = {}
    for k in keys:
        m = rx.match(k)
        new = where[int(m.group(1))] + m.group(2) if m else k
        for pattern, repl in _WAN_RENAMES:
            new = pattern.sub(repl, new)
        out[k] = new
    return out


def wan22_original_names(keys) -> Dict[str, str]:
    """Original Wan 2.2 layout name -> AutoencoderKLWan(is_residual=True)
    name, for every key: a level's nested block is a resample where it has
    ``resample.``/``time_conv.`` tensors, else its residual block J."""
    samplers = {(m.group(1), m.group(2), m.group(3)) for k in keys for m in [_WAN22_NESTED.match(k)]
                if m and m.group(4).startswith(("resample.", "time_conv."))}
    out = {}
    for k in keys:
        m = _WAN22_NESTED.match(k)
        new = k
        if m:
            part, level, j, rest = m.groups()
            half, blocks, sampler = (("encoder", "down_blocks", "downsampler") if part.startswith("encoder")
                                     else ("decoder", "up_blocks", "upsampler"))
            new = (f"{half}.{blocks}.{level}.{sampler}.{rest}" if (part, level, j) in samplers
                   else f"{half}.{blocks}.{level}.resnets.{j}.{rest}")
        for pattern, repl in _WAN_RENAMES:
            new = pattern.sub(repl, new)
        out[k] = new
    return out


class _Unsupported(ValueError):
    """A Wan-family file of a variant AutoencoderKLWan is not built for here."""


def _wan_config(shapes: Shapes) -> dict:
    """AutoencoderKLWan's constructor arguments from AutoencoderKLWan-named
    shapes. Only a plausible config: the shape check against the model built
    from it (_wan_problem) is what decides whether the file fits."""
    keys = list(shapes)
    has_enc, has_dec = "encoder.conv_in.weight" in shapes, "decoder.conv_in.weight" in shapes
    if any(_WAN22.match(k) for k in keys):
        return _wan22_config(shapes)
    if any(re.match(r"(encoder\.down_blocks|decoder\.up_blocks\.\d+\.resnets)\.\d+\.to_qkv\.", k) for k in keys):
        raise _Unsupported("attention blocks inside the levels (attn_scales)")
    widths, temporal, nrb, base = None, None, None, 0
    if has_enc:
        levels, cur = [], []
        for i in _idx(keys, r"encoder\.down_blocks\.(\d+)\."):
            if f"encoder.down_blocks.{i}.conv1.weight" in shapes:
                cur.append(shapes[f"encoder.down_blocks.{i}.conv1.weight"][0])
            elif f"encoder.down_blocks.{i}.resample.1.weight" in shapes:
                levels.append((cur, f"encoder.down_blocks.{i}.time_conv.weight" in shapes))
                cur = []
            else:
                raise KeyError(f"encoder.down_blocks.{i} is neither a residual block (conv1) nor a resample")
        levels.append((cur, False))
        if not all(ws for ws, _ in levels):
            raise ValueError("an encoder level has no residual block")
        widths = [ws[0] for ws, _ in levels]
        temporal = [t for _, t in levels[:-1]]
        nrb = len(levels[0][0])
        base = shapes["encoder.conv_in.weight"][0]
        in_channels = shapes["encoder.conv_in.weight"][1]
    if has_dec:
        ups = _idx(keys, r"decoder\.up_blocks\.(\d+)\.")
        dec_widths = [shapes[f"decoder.up_blocks.{i}.resnets.0.conv2.weight"][0] for i in ups][::-1]
        dec_temporal = [f"decoder.up_blocks.{i}.upsamplers.0.time_conv.weight" in shapes for i in ups[:-1]][::-1]
        dec_nrb = len(_idx(keys, r"decoder\.up_blocks\.0\.resnets\.(\d+)\.")) - 1
        if widths is None:
            # A decoder alone does not say how its widths split into base
            # and multipliers; Wan's first multiplier is 1.
            widths, temporal, nrb, base, in_channels = dec_widths, dec_temporal, dec_nrb, dec_widths[0], 3
        dec_base = dec_widths[0] * base // widths[0]
    if not widths or base <= 0 or any(w % base for w in widths):
        raise ValueError(f"level widths {widths} are not multiples of the base width {base}")
    if in_channels != 3:
        raise _Unsupported(f"{in_channels} input channels (a patchified input, as Wan 2.2's)")
    z_dim = (shapes["post_quant_conv.weight"][0] if "post_quant_conv.weight" in shapes
             else shapes["decoder.conv_in.weight"][1] if has_dec else shapes["encoder.conv_out.weight"][0] // 2)
    config = dict(base_dim=base, z_dim=z_dim, dim_mult=[w // base for w in widths], num_res_blocks=nrb,
                  temperal_downsample=temporal, attn_scales=[], in_channels=3,
                  out_channels=shapes["decoder.conv_out.weight"][0] if "decoder.conv_out.weight" in shapes else 3,
                  scale_factor_spatial=2 ** (len(widths) - 1), scale_factor_temporal=2 ** sum(temporal))
    if has_dec and dec_base != base:
        config["decoder_base_dim"] = dec_base
    return config


def _wan22_config(shapes: Shapes) -> dict:
    """AutoencoderKLWan(is_residual=True)'s arguments from its names: level
    widths from each level's first residual block, the temporal flags from
    the encoder's time convs (or the decoder's, reversed), the patch size
    from the 3 * p^2 input and output channels. As for Wan 2.1 only a
    plausible config: ``_wan_problem`` decides."""
    keys = list(shapes)
    if any(re.match(r"(encoder\.down_blocks|decoder\.up_blocks)\.\d+\.resnets\.\d+\.to_qkv\.", k) for k in keys):
        raise _Unsupported("attention blocks inside the levels (attn_scales)")
    has_enc, has_dec = "encoder.conv_in.weight" in shapes, "decoder.conv_in.weight" in shapes
    enc = _idx(keys, r"encoder\.down_blocks\.(\d+)\.")
    dec = _idx(keys, r"decoder\.up_blocks\.(\d+)\.")
    if has_enc:
        widths = [shapes[f"encoder.down_blocks.{i}.resnets.0.conv2.weight"][0] for i in enc]
        temporal = [f"encoder.down_blocks.{i}.downsampler.time_conv.weight" in shapes for i in enc[:-1]]
        nrb = len(_idx(keys, r"encoder\.down_blocks\.0\.resnets\.(\d+)\."))
        base = shapes["encoder.conv_in.weight"][0]
        channels = shapes["encoder.conv_in.weight"][1]
    if has_dec:
        dec_widths = [shapes[f"decoder.up_blocks.{i}.resnets.0.conv2.weight"][0] for i in dec][::-1]
        dec_temporal = [f"decoder.up_blocks.{i}.upsampler.time_conv.weight" in shapes for i in dec[:-1]][::-1]
        if not has_enc:
            # A decoder alone does not say how its widths split into base
            # and multipliers; Wan's first multiplier is 1.
            widths, temporal, base = dec_widths, dec_temporal, dec_widths[0]
            nrb = len(_idx(keys, r"decoder\.up_blocks\.0\.resnets\.(\d+)\.")) - 1
            channels = shapes["decoder.conv_out.weight"][0]
    if not widths or base <= 0 or any(w % base for w in widths):
        raise ValueError(f"level widths {widths} are not multiples of the base width {base}")
    mult = [w // base for w in widths]
    patch = int(round((channels / 3) ** 0.5))
    if channels != 3 * patch * patch:
        raise _Unsupported(f"{channels} image channels (not 3 x a square patch)")
    z_dim = (shapes["post_quant_conv.weight"][0] if "post_quant_conv.weight" in shapes
             else shapes["decoder.conv_in.weight"][1] if has_dec else shapes["encoder.conv_out.weight"][0] // 2)
    config = dict(base_dim=base, z_dim=z_dim, dim_mult=mult, num_res_blocks=nrb, temperal_downsample=temporal,
                  attn_scales=[], is_residual=True, in_channels=channels,
                  out_channels=shapes["decoder.conv_out.weight"][0] if has_dec else channels, patch_size=patch,
                  scale_factor_spatial=2 ** (len(mult) - 1) * patch, scale_factor_temporal=2 ** sum(temporal))
    if has_dec:
        # The decoder's first width is its base times the last multiplier.
        config["decoder_base_dim"] = shapes["decoder.conv_in.weight"][0] // mult[-1]
    return config


# What a file holding one half of the model lacks: the other half's tensors.
_WAN_HALVES = {"encoder": ("encoder.", "quant_conv."), "decoder": ("decoder.", "post_quant_conv.")}


def _wan_absent(parts: set) -> tuple:
    """Name prefixes of the halves a file does not hold (missing, not lost)."""
    return tuple(p for part, prefixes in _WAN_HALVES.items() if part not in parts for p in prefixes)


def _wan_parts(shapes: Shapes) -> set:
    return {p for p, k in (("encoder", "encoder.conv_in.weight"), ("decoder", "decoder.conv_in.weight"))
            if k in shapes}


def _wan_problem(config: dict, shapes: Shapes, shown: Callable[[str], str] = repr) -> str:
    """What keeps a file with these (AutoencoderKLWan-named) shapes from
    loading into AutoencoderKLWan(**config) strictly, or "". A file may hold
    the encoder (with quant_conv) or the decoder (with post_quant_conv)
    alone. The model is built on the meta device: no memory, whatever the
    config claims."""
    from diffusers import AutoencoderKLWan
    with torch.device("meta"):
        model = AutoencoderKLWan(**config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    absent = _wan_absent(_wan_parts(shapes))
    missing = [k for k in want if k not in shapes and not k.startswith(absent)]
    unexpected = [k for k in shapes if k not in want]
    wrong = [k for k in shapes if k in want and tuple(shapes[k]) != want[k]]
    what = _describe_wan(config)
    if unexpected:
        return f"tensor {shown(unexpected[0])} is not part of {what} ({len(unexpected)} such tensor(s))"
    if missing:
        return f"tensor {shown(missing[0])} of {what} is missing ({len(missing)} missing)"
    if wrong:
        k = wrong[0]
        return f"tensor {shown(k)} has shape {list(shapes[k])}, {what} needs {list(want[k])}"
    return ""


def _describe_wan(config: dict) -> str:
    return (f"AutoencoderKLWan base_dim={config['base_dim']}, dim_mult={config['dim_mult']}, num_res_blocks="
            f"{config['num_res_blocks']}, z_dim={config['z_dim']}, temperal_downsample="
            f"{config['temperal_downsample']}"
            + (f", decoder_base_dim={config['decoder_base_dim']}" if "decoder_base_dim" in config else "")
            + (f", is_residual=True, patch_size={config['patch_size']} (Wan 2.2)" if config.get("is_residual")
               else ""))


def _wan_geometry(name, shape):
    # An encoder resample zero-pads (0, 1, 0, 1) itself, then runs an
    # unpadded stride-2 conv; the decoder's upsample conv is 'same'.
    if name.startswith("encoder.") and ".resample." in name:
        return 2, 0
    return 1, shape[2] // 2


def _wan_geometry3d(name, shape):
    # A downsample3d's time conv runs unpadded at time stride 2 on its cached
    # frame and the new ones; every other conv is causal: 2p frames in front,
    # none behind, 'same' in space.
    if name.startswith("encoder.") and ".time_conv." in name:
        return (2, 1, 1), ((0, 0), (0, 0), (0, 0))
    kt, kh, kw = shape[2:5]
    return (1, 1, 1), ((2 * (kt // 2), 0), (kh // 2, kh // 2), (kw // 2, kw // 2))


def _wan_format(shapes: Shapes, rename: Optional[Dict[str, str]]) -> Format:
    """``rename``: the file's names to AutoencoderKLWan's (None: they are)."""
    names = rename or {k: k for k in shapes}
    back = {v: k for k, v in names.items()}

    def shown(name):
        """A tensor as the message names it: the file's own name where it has
        it (or its weight/bias sibling), else AutoencoderKLWan's, said so."""
        if name in back:
            return repr(back[name])
        for have, want in ((".bias", ".weight"), (".weight", ".bias")):
            sibling = name[: -len(want)] + have
            if name.endswith(want) and sibling in back:
                return repr(back[sibling][: -len(have)] + want)
        return repr(name) + (" (AutoencoderKLWan's name)" if rename else "")

    own = {names[k]: v for k, v in shapes.items()}
    label = "Wan video VAE, " + ("diffusers layout" if rename is None else "original Wan layout")
    try:
        config = _wan_config(own)
    except _Unsupported as e:
        return Format("unknown", f"{label}, but {e}: not supported end to end")
    except KeyError as e:  # a tensor the config is read from, or a block that is neither kind
        what = e.args[0] if e.args else "?"
        if isinstance(what, str) and what.endswith((".weight", ".bias", ".gamma")):
            what = f"tensor {shown(what)} is missing"
        return Format("wan-vae", label, problem=f"looks like a {label} but {what}")
    except (IndexError, TypeError, ValueError, ZeroDivisionError) as e:
        return Format("wan-vae", label, problem=f"looks like a {label} but its layout does not fit one "
                                                f"({type(e).__name__}: {e})")
    parts = _wan_parts(own)
    try:
        problem = _wan_problem(config, own, shown)
    except ImportError:
        problem = ""  # no diffusers: the end-to-end check says so
    except (RuntimeError, ValueError, TypeError) as e:
        problem = f"no AutoencoderKLWan fits its shapes ({type(e).__name__}: {str(e).strip()[:120]})"
    if problem:
        problem = f"looks like a {label} but {problem}"

    def build(state):
        from diffusers import AutoencoderKLWan
        model = AutoencoderKLWan(**config)
        state = {names.get(k, k): v for k, v in state.items()}
        # Strict, but for the half a one-half file does not hold.
        missing, unexpected = model.load_state_dict(state, strict=False)
        absent = _wan_absent(parts)
        if unexpected or any(not k.startswith(absent) for k in missing):
            raise ValueError(f"layout does not match {_describe_wan(config)}: {len(missing)} missing, "
                             f"{len(unexpected)} unexpected keys")
        return model

    def geometry(name, shape):
        return _wan_geometry(names.get(name, name), shape)

    def geometry3d(name, shape):
        return _wan_geometry3d(names.get(name, name), shape)

    return Format(
        kind="wan-vae", description=f"{label}, as {_describe_wan(config)}"
        + ("" if parts == {"encoder", "decoder"} else f" ({next(iter(parts))} only)"),
        geometry=geometry, geometry3d=geometry3d, build=build,
        decode=(lambda m, z: m.decode(z).sample) if "decoder" in parts else None,
        encode=(lambda m, x: m.encode(x).latent_dist.mode()) if "encoder" in parts else None,
        latent_channels=config["z_dim"], factor=config["scale_factor_spatial"], image_range=(-1.0, 1.0),
        # Wan encodes a first frame, then chunks of 4.
        latent_frames=2, video_frames=1 + max(4, config["scale_factor_temporal"]), problem=problem)


# diffusers' other video VAEs: (class, label, spatial factor, temporal factor,
# the constructor arguments a file must match: the released model's, its
# class defaults). A file is one of them where its tensors are exactly that
# model's (or one half's: the encoder with quant_conv, the decoder with
# post_quant_conv); nothing is inferred, so no file is taken for a model it
# is not.
VIDEO_DEFAULTS = (
    ("AutoencoderKLCogVideoX", "CogVideoX video VAE", 8, 4, {}),
    ("AutoencoderKLMochi", "Mochi 1 video VAE", 8, 6, {}),
    ("AutoencoderKLHunyuanVideo", "HunyuanVideo video VAE", 8, 4, {}),
    ("AutoencoderKLLTXVideo", "LTX-Video (0.9.0) video VAE", 32, 8, {}),
)
# Tensors of either half (LTX-Video's latent statistics).
_SHARED_BUFFERS = ("latents_mean", "latents_std")


# LTX-Video's original layout (its released single files, the VAE under
# ``vae.``, and the VAE alone, as ComfyUI loads them): a resnet's blocks are
# ``res_blocks``, where diffusers has ``resnets``.
_LTX_ORIGINAL = re.compile(r"(vae\.)?(encoder\.down_blocks|decoder\.up_blocks)\.\d+\.res_blocks\.")


def ltx_original_names(shapes: Shapes) -> Optional[Dict[str, str]]:
    """The file's names -> ``AutoencoderKLLTXVideo``'s, for a file in
    LTX-Video's original layout, as diffusers' own single-file converter
    renames them (run on the shapes alone, as meta tensors); None for any
    other file, a half it cannot convert (the converter reads the encoder),
    or without diffusers."""
    if not any(_LTX_ORIGINAL.match(k) for k in shapes):
        return None
    try:
        from diffusers.loaders.single_file_utils import convert_ltx_vae_checkpoint_to_diffusers
    except ImportError:
        return None
    full = any(k.startswith("vae.") for k in shapes)  # a whole checkpoint: its VAE alone
    mine = {k: torch.empty(v, device="meta") for k, v in shapes.items() if k.startswith("vae.") or not full}
    own = {id(t): k for k, t in mine.items()}
    try:
        out = convert_ltx_vae_checkpoint_to_diffusers({k if full else "vae." + k: t for k, t in mine.items()})
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError):
        return None
    return {own[id(t)]: k for k, t in out.items() if id(t) in own}


# The other video VAEs' original layouts, renamed to the diffusers class's
# names, written from the original modules' attribute names. A rename maps
# each of the file's names to the class's name, or, for a fused projection
# the class holds as several (Mochi's q/k/v), to a tuple of names: the
# tensor is split into that many equal parts along its first axis.
Names = Union[str, Tuple[str, ...]]


def _renamed_shapes(shapes: Shapes, rename: Dict[str, Names]) -> Shapes:
    """The shapes of the tensors ``rename`` names, under the names it gives them."""
    out = {}
    for k, new in rename.items():
        if k not in shapes:
            continue
        shape = tuple(shapes[k])
        if isinstance(new, tuple):
            n = len(new)
            part = (shape[0] // n,) + shape[1:] if shape and shape[0] % n == 0 else shape
            out.update((name, part) for name in new)
        else:
            out[new] = shape
    return out


def _renamed_state(state: Dict[str, torch.Tensor], rename: Dict[str, Names]) -> Dict[str, torch.Tensor]:
    """``state`` under the names ``rename`` gives its tensors (the others left out)."""
    out = {}
    for k, v in state.items():
        new = rename.get(k)
        if isinstance(new, tuple):
            out.update(zip(new, v.chunk(len(new), 0)))
        elif new is not None:
            out[new] = v
    return out


def _fits(have: tuple, want: tuple, original: bool) -> bool:
    """A file's tensor of shape ``have`` loads where the class has ``want``:
    the same, or (in an original layout) a 1x1(x1) convolution's weight
    where the class has a linear layer's (the LDM-style attention)."""
    return have == want or (original and len(want) == 2 and len(have) > 2 and have[:2] == want
                            and all(d == 1 for d in have[2:]))


# Mochi 1 in the original genmo layout (genmo's encoder/decoder files, bare;
# ComfyUI's mochi_vae.safetensors, under encoder./decoder.; comfy/ldm/genmo/
# vae/model.py). A residual block is ``stack`` = (norm, SiLU, conv, norm,
# SiLU, conv), its attention ``attn_block`` (norm, attn.qkv fused, attn.out).
# The encoder is one Sequential ``layers``: the input projection, the first
# residual blocks, the downsample blocks (``layers.N.layers``: the strided
# conv, then residual blocks), the last residual blocks; the decoder a list
# ``blocks``: (input conv, residual blocks), the upsample blocks (``blocks``
# and ``proj``), the last residual blocks.
_MOCHI_RES = (("stack.0.", "norm1.norm_layer."), ("stack.2.", "conv1.conv."), ("stack.3.", "norm2.norm_layer."),
              ("stack.5.", "conv2.conv."))
_MOCHI_MARK = re.compile(r"((encoder\.)?layers\.\d+\.(layers\.\d+\.)?|"
                         r"(decoder\.)?blocks\.\d+\.(blocks\.)?\d+\.)stack\.")


def _mochi_block(rest: str, dest: str, i: int) -> Optional[Names]:
    """A genmo residual block's tensor (``rest``: its name within the block)
    under diffusers' ``dest`` (a block of ``resnets``/``norms``/``attentions``)."""
    for old, new in _MOCHI_RES:
        if rest.startswith(old):
            return f"{dest}.resnets.{i}.{new}{rest[len(old):]}"
    if rest.startswith("attn_block.norm."):
        return f"{dest}.norms.{i}.norm_layer.{rest[len('attn_block.norm.'):]}"
    if rest.startswith("attn_block.attn.qkv."):
        end = rest[len("attn_block.attn.qkv."):]
        return tuple(f"{dest}.attentions.{i}.{p}.{end}" for p in ("to_q", "to_k", "to_v"))
    if rest.startswith("attn_block.attn.out."):
        return f"{dest}.attentions.{i}.to_out.0.{rest[len('attn_block.attn.out.'):]}"
    return None


def _mochi_encoder(keys) -> Dict[str, Names]:
    rx = re.compile(r"layers\.(\d+)\.(.*)")
    tops = _idx(keys, r"layers\.(\d+)\.")
    downs = [t for t in tops if any(k.startswith(f"layers.{t}.layers.") for k in keys)]
    out = {}
    for k in keys:
        m = rx.match(k)
        new = None
        if k.startswith("output_norm."):
            new = "norm_out.norm_layer." + k[len("output_norm."):]
        elif k.startswith("output_proj."):
            new = "proj_out." + k[len("output_proj."):]
        elif m and int(m.group(1)) == 0:
            new = "proj_in." + m.group(2)
        elif m:
            t, rest = int(m.group(1)), m.group(2)
            if t in downs:
                b = downs.index(t)
                sub = re.match(r"layers\.(\d+)\.(.*)", rest)
                if sub and sub.group(1) == "0":
                    new = f"down_blocks.{b}.conv_in.conv.{sub.group(2)}"
                elif sub:
                    new = _mochi_block(sub.group(2), f"down_blocks.{b}", int(sub.group(1)) - 1)
            elif not downs or t < downs[0]:
                new = _mochi_block(rest, "block_in", tops.index(t) - 1)
            else:
                new = _mochi_block(rest, "block_out", tops.index(t) - tops.index(downs[-1]) - 1)
        out[k] = new if new is not None else k
    return out


def _mochi_decoder(keys) -> Dict[str, Names]:
    rx = re.compile(r"blocks\.(\d+)\.(.*)")
    tops = _idx(keys, r"blocks\.(\d+)\.")
    ups = [t for t in tops if t and any(k.startswith((f"blocks.{t}.blocks.", f"blocks.{t}.proj.")) for k in keys)]
    out = {}
    for k in keys:
        m = rx.match(k)
        new = None
        if k.startswith("output_proj."):
            new = "proj_out." + k[len("output_proj."):]
        elif m:
            t, rest = int(m.group(1)), m.group(2)
            sub = re.match(r"(?:blocks\.)?(\d+)\.(.*)", rest)
            if t in ups:
                u = ups.index(t)
                if rest.startswith("proj."):
                    new = f"up_blocks.{u}.{rest}"
                elif sub and rest.startswith("blocks."):
                    new = _mochi_block(sub.group(2), f"up_blocks.{u}", int(sub.group(1)))
            elif sub and t == 0:
                i = int(sub.group(1))
                new = f"conv_in.{sub.group(2)}" if i == 0 else _mochi_block(sub.group(2), "block_in", i - 1)
            elif sub:
                new = _mochi_block(sub.group(2), "block_out", int(sub.group(1)))
        out[k] = new if new is not None else k
    return out


def mochi_original_names(keys) -> Optional[Dict[str, Names]]:
    """Original genmo layout name -> ``AutoencoderKLMochi`` name(s), for
    every key (a name it cannot place is left as it is); None where the
    file is not in that layout. A file of the encoder or the decoder alone
    may be bare (as genmo ships them: ``layers.``/``blocks.``)."""
    keys = list(keys)
    if not any(_MOCHI_MARK.match(k) for k in keys):
        return None
    prefixed = any(k.startswith(("encoder.", "decoder.")) for k in keys)
    if prefixed:
        halves = {h: [k[len(h) + 1:] for k in keys if k.startswith(h + ".")] for h in ("encoder", "decoder")}
    elif any(re.match(r"layers\.\d+\.", k) for k in keys):
        halves = {"encoder": keys, "decoder": []}
    else:
        halves = {"encoder": [], "decoder": keys}
    out = {k: k for k in keys}
    for half, names_of in (("encoder", _mochi_encoder), ("decoder", _mochi_decoder)):
        for k, new in names_of(halves[half]).items():
            new = tuple(f"{half}.{n}" for n in new) if isinstance(new, tuple) else f"{half}.{new}"
            out[f"{half}.{k}" if prefixed else k] = new
    return out


# The LDM-style layout with 3-D convolutions (``encoder.down.L.block.J``,
# ``decoder.up.L`` numbered from the output end, ``mid.block_1``/``_2``,
# ``nin_shortcut``): CogVideoX's original SAT VAE (sat/vae_modules/
# cp_enc_dec.py; diffusers' scripts/convert_cogvideox_to_diffusers.py renames
# it, dropping its ``loss.`` tensors), and HunyuanVideo's VAE as ComfyUI holds
# it (comfy/diffusers_convert.py turns the released file, which has
# diffusers' names, into these; ComfyUI saves it so): its ``norm_out`` is
# diffusers' ``conv_norm_out``, its middle attention ``mid.attn_1`` (norm,
# q, k, v, proj_out as 1x1x1 convolutions).
_LDM3D_MARK = re.compile(r"(encoder\.down|decoder\.up)\.\d+\.block\.\d+\.")
_LDM3D_RENAMES = [(re.compile(a), b) for a, b in (
    (r"^encoder\.down\.(\d+)\.block\.", r"encoder.down_blocks.\1.resnets."),
    (r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0."),
    (r"^(encoder|decoder)\.mid\.block_1\.", r"\1.mid_block.resnets.0."),
    (r"^(encoder|decoder)\.mid\.block_2\.", r"\1.mid_block.resnets.1."),
    (r"\.nin_shortcut\.", ".conv_shortcut."),
)]
_LDM3D_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _ldm3d_names(keys, hunyuan: bool) -> Dict[str, str]:
    ups = _idx(keys, r"decoder\.up\.(\d+)\.")
    top = max(ups, default=0)
    out = {}
    for k in keys:
        new = k
        m = re.match(r"decoder\.up\.(\d+)\.(block\.|upsample\.)?(.*)", k)
        if m:
            part = {"block.": "resnets.", "upsample.": "upsamplers.0.", None: ""}[m.group(2)]
            new = f"decoder.up_blocks.{top - int(m.group(1))}.{part}{m.group(3)}"
        for pattern, repl in _LDM3D_RENAMES:
            new = pattern.sub(repl, new)
        m = re.match(r"(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(.*)", k)
        if hunyuan and m:
            new = f"{m.group(1)}.mid_block.attentions.0.{_LDM3D_ATTN[m.group(2)]}.{m.group(3)}"
        if hunyuan:
            new = re.sub(r"^(encoder|decoder)\.norm_out\.", r"\1.conv_norm_out.", new)
        out[k] = new
    return out


def cogvideox_sat_names(keys) -> Optional[Dict[str, str]]:
    """CogVideoX's original SAT layout name -> ``AutoencoderKLCogVideoX``
    name, for every key but the training loss's (``loss.``); None where the
    file is not in that layout (no middle attention there)."""
    keys = [k for k in keys if not k.startswith("loss.")]
    if not any(_LDM3D_MARK.match(k) for k in keys) or any(".mid.attn_1." in k for k in keys):
        return None
    return _ldm3d_names(keys, hunyuan=False)


def hunyuan_comfy_names(keys) -> Optional[Dict[str, str]]:
    """HunyuanVideo's VAE as ComfyUI holds and saves it ->
    ``AutoencoderKLHunyuanVideo`` name, for every key; None where the file
    is not in that layout (it has the middle attention)."""
    keys = list(keys)
    if not any(_LDM3D_MARK.match(k) for k in keys) or not any(".mid.attn_1." in k for k in keys):
        return None
    return _ldm3d_names(keys, hunyuan=True)


# (the diffusers class, the layout's name, the rest of the words describing
# a file in it, its rename). HunyuanVideo's own original layout (Tencent's
# AutoencoderKLCausal3D, as Comfy-Org ships hunyuan_video_vae_bf16.safetensors)
# has diffusers' names: diffusers' converter renames nothing (its
# VAE_KEYS_RENAME_DICT is empty), so that file is read as diffusers' layout.
_ORIGINAL_VIDEO_LAYOUTS = (
    ("AutoencoderKLMochi", "original genmo layout", ", as released and as ComfyUI loads it", mochi_original_names),
    ("AutoencoderKLCogVideoX", "original SAT layout", ", as released", cogvideox_sat_names),
    ("AutoencoderKLHunyuanVideo", "ComfyUI's original-style (LDM) layout", ", as ComfyUI holds and saves it",
     hunyuan_comfy_names),
)
_LTX_LAYOUT = ("original layout", ", as released and as ComfyUI loads it")


def _video_default_format(shapes: Shapes, rename: Optional[Dict[str, Names]] = None,
                          family: Optional[str] = None, layout: Tuple[str, str] = _LTX_LAYOUT,
                          kind: Optional[str] = None) -> Optional[Format]:
    """The ``VIDEO_DEFAULTS`` model this file holds ("unknown" where it is
    none of them; None without diffusers). Each candidate
    is built on the meta device (no memory) and its state dict's shapes
    compared with the file's. ``rename``: the file's names to the diffusers
    class's, for a file in an original layout (``shapes`` then under the
    class's names); ``family``: the one class that layout can be; ``layout``:
    its name and the rest of its words in the description; ``kind``: the
    kind of a recognised file (by default diffusers' or an original layout).
    With a ``family``, a file that is not that model says why."""
    try:
        import diffusers
    except ImportError:
        return None
    parts = {p for p in ("encoder", "decoder") if any(k.startswith(p + ".") for k in shapes)}
    absent = _wan_absent(parts)
    why = ""
    for cls_name, label, spatial, temporal, config in VIDEO_DEFAULTS:
        if family is not None and cls_name != family:
            continue
        cls = getattr(diffusers, cls_name, None)
        if cls is None or not parts:
            continue
        with torch.device("meta"):
            model = cls(**config)
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        missing = [k for k in want if k not in shapes and not k.startswith(absent) and k not in _SHARED_BUFFERS]
        unexpected = [k for k in shapes if k not in want]
        wrong = [k for k in shapes if k in want and not _fits(tuple(shapes[k]), want[k], rename is not None)]
        if missing or unexpected or wrong:
            if family is not None:
                why = _not_as_released(f"{label} in the {layout[0]}", rename, shapes, want, missing, unexpected,
                                       wrong)
            continue
        latent = model.config["latent_channels"]
        # Each conv's own stride and padding, read off the model (the time
        # padding a causal conv adds in front is its caller's concatenation).
        geo2, geo3 = {}, {}
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Conv3d) and isinstance(mod.padding, tuple):
                geo3[f"{name}.weight"] = (tuple(mod.stride), tuple((p, p) for p in mod.padding))
            elif isinstance(mod, nn.Conv2d) and isinstance(mod.padding, tuple):
                geo2[f"{name}.weight"] = (mod.stride[0], mod.padding[0])

        def build(state, cls=cls, config=config):
            m = cls(**config)
            if rename is not None:
                state = _renamed_state(state, rename)
                # 1x1(x1) convolution weights of an LDM-style attention, for its linear layers.
                own = {k: v.shape for k, v in m.state_dict().items()}
                state = {k: (v.reshape(own[k]) if k in own and v.shape != own[k] and v.numel() == own[k].numel()
                             else v) for k, v in state.items()}
            missing, unexpected = m.load_state_dict(state, strict=False)
            if unexpected or any(not k.startswith(absent) and k not in _SHARED_BUFFERS for k in missing):
                raise ValueError(f"layout does not match {cls.__name__}: {len(missing)} missing, "
                                 f"{len(unexpected)} unexpected keys")
            return m

        names = rename or {}
        if rename is None or kind == "diffusers-video-vae":
            words = f"diffusers layout ({cls_name})"
        else:
            words = f"{layout[0]}{layout[1]} (read as diffusers' {cls_name})"
        if cls_name == "AutoencoderKLHunyuanVideo" and (rename is None or kind == "diffusers-video-vae"):
            words += ", which is HunyuanVideo's original layout too"
        return Format(
            kind=kind or ("diffusers-video-vae" if rename is None else "original-video-vae"),
            description=f"{label}, {words}"
            + ("" if parts == {"encoder", "decoder"} else f" ({next(iter(parts))} only)"),
            geometry=lambda name, shape, g=geo2: g.get(names.get(name, name)) or (1, shape[2] // 2),
            geometry3d=lambda name, shape, g=geo3: g.get(names.get(name, name)) or same_geometry3d(name, shape),
            build=build, decode=(lambda m, z: m.decode(z).sample) if "decoder" in parts else None,
            encode=(lambda m, x: m.encode(x).latent_dist.mode()) if "encoder" in parts else None,
            latent_channels=latent, factor=spatial, image_range=(-1.0, 1.0),
            latent_frames=2, video_frames=1 + temporal)
    if why:
        return Format("unknown", why)
    names = ", ".join(label for _, label, *_ in VIDEO_DEFAULTS)
    return Format("unknown", f"a video VAE (5-D convolution weights) that is none of the {names} as released")


def _not_as_released(what: str, rename, shapes: Shapes, want: Shapes, missing, unexpected, wrong) -> str:
    """Why a file in an original layout is not the released model: its
    first tensor too many, missing or of another shape, by the file's own
    name where it has one."""
    back = {}
    for k, new in (rename or {}).items():
        for n in (new if isinstance(new, tuple) else (new,)):
            back[n] = k

    def shown(name):
        return repr(back[name]) if name in back else f"{name!r} (diffusers' name)"

    if unexpected:
        reason = f"tensor {shown(unexpected[0])} is not part of it ({len(unexpected)} such tensor(s))"
    elif missing:
        reason = f"tensor {shown(missing[0])} is missing ({len(missing)} missing)"
    else:
        k = wrong[0]
        reason = f"tensor {shown(k)} has shape {list(shapes[k])}, the released model's is {list(want[k])}"
    return f"looks like a {what} but not as released: {reason}"


def _vae_part(shapes: Shapes) -> Tuple[Shapes, str]:
    """The video VAE inside a whole checkpoint (under ``first_stage_model.``
    or ``vae.``), without its prefix; the file itself where it has none."""
    for prefix in LDM_PREFIXES:
        sub = {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
        if any(len(v) == 5 for v in sub.values()):
            return sub, prefix
    return shapes, ""


def _video_format(shapes: Shapes) -> Optional[Format]:
    """A video VAE without Wan's RMS norms (``VIDEO_DEFAULTS``): in diffusers'
    layout, or in LTX-Video's, Mochi's, CogVideoX's or (as ComfyUI holds it)
    HunyuanVideo's original one; alone, or under ``first_stage_model.``/
    ``vae.`` in a whole checkpoint. Where the file is in an original layout
    but not the released model, the reason names that layout and the
    tensor. None without diffusers."""
    fmt = _video_default_format(shapes)
    if fmt is None or fmt.recognised:
        return fmt
    sub, prefix = _vae_part(shapes)
    tries = []
    if prefix:
        tries.append((None, _LTX_LAYOUT, {prefix + k: k for k in sub}, "diffusers-video-vae"))
    ltx = ltx_original_names(shapes)
    if ltx is not None:
        tries.append(("AutoencoderKLLTXVideo", _LTX_LAYOUT, ltx, None))
    for family, name, rest, names_of in _ORIGINAL_VIDEO_LAYOUTS:
        names = names_of(list(sub))
        if names is not None:
            tries.append((family, (name, rest), {prefix + k: v for k, v in names.items()}, None))
    why = None
    for family, layout, rename, kind in tries:
        got = _video_default_format(_renamed_shapes(shapes, rename), rename, family, layout, kind)
        if got is None:
            continue
        if got.recognised:
            if prefix and all(k.startswith(prefix) for k in rename):
                got.description += f", under '{prefix}' in a full checkpoint"
            return got
        if why is None and family is not None:
            why = got
    return why or fmt


def _is_5d(shapes: Shapes, *names) -> bool:
    return any(len(shapes.get(n, ())) == 5 for n in names)


# -- dispatch -------------------------------------------------------------------

def strip_ldm_prefix(shapes: Shapes) -> Tuple[Shapes, str]:
    """Keys of the VAE inside a full single-file checkpoint, without its prefix."""
    for prefix in LDM_PREFIXES:
        sub = {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
        if any(k.startswith(("encoder.", "decoder.")) for k in sub):
            return sub, prefix
    return shapes, ""


def recognise(shapes: Shapes) -> Format:
    """The format of a checkpoint given ``{name: shape}``; ``kind='unknown'``
    (per-layer checks only) when nothing matches."""
    try:
        plan = taesd_plan(shapes)
        if plan is not None:
            return _taesd_format(plan)
        enc = taesd_plan(shapes, "encoder.layers.", decoder=False)
        dec = taesd_plan(shapes, "decoder.layers.", decoder=True)
        if enc is not None and dec is not None:
            return _tiny_format(enc, dec)
        # Wan's marks: a 5-D first conv and RMS norms (``gamma``, where
        # other VAEs have GroupNorm weights).
        rms = any(k.endswith(".gamma") for k in shapes)
        if rms and _is_5d(shapes, "encoder.conv_in.weight", "decoder.conv_in.weight"):
            return _wan_format(shapes, None)
        if rms and _is_5d(shapes, "encoder.conv1.weight", "decoder.conv1.weight") and any(
                _WAN_ORIGINAL.match(k) for k in shapes):
            nested = any(_WAN22_NESTED.match(k) for k in shapes)
            return _wan_format(shapes, (wan22_original_names if nested else wan_original_names)(list(shapes)))
        if not rms and any(len(v) == 5 for v in shapes.values()):
            fmt = _video_format(shapes)
            if fmt is not None:
                return fmt
        if any(re.match(r"(encoder\.down_blocks|decoder\.up_blocks)\.\d+\.", k) for k in shapes):
            config = _kl_config(shapes, "diffusers")
            return _kl_format("diffusers-autoencoderkl", "diffusers " + _describe_kl(config), shapes, config)
        sub, prefix = strip_ldm_prefix(shapes)
        if any(re.match(r"(encoder\.down|decoder\.up)\.\d+\.block\.", k) for k in sub):
            config = _kl_config(sub, "ldm")
            fmt = _kl_format("ldm-vae", "single-file (ldm) VAE, as " + _describe_kl(config), sub, config,
                             convert=_ldm_to_diffusers(config))
            if prefix:
                fmt.description += f", under '{prefix}' in a full checkpoint"
            return fmt
    except (KeyError, IndexError, TypeError, ValueError) as e:
        return Format("unknown", f"not recognised ({type(e).__name__} while reading its layout)")
    return Format("unknown", "architecture not recognised")
