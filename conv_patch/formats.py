"""Which VAE a checkpoint holds, from tensor names and shapes alone.

Recognised: diffusers ``AutoencoderKL`` (SD1.5/SDXL/SD3/FLUX.1 layouts), the
original single-file layout (ComfyUI, the SD repositories, FLUX ``ae``; bare
or under ``first_stage_model.``/``vae.``), TAESD-format ``nn.Sequential``
encoders/decoders, and diffusers ``AutoencoderTiny``. Each recognised format
knows how to build its model (the diffusers class or the package's own TAESD
module), how to decode/encode with it, and the geometry of each convolution
weight for the per-layer check. Anything else gets the per-layer check alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

Shapes = Dict[str, tuple]
LDM_PREFIXES = ("first_stage_model.", "vae.")


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
    from . import taesd
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
