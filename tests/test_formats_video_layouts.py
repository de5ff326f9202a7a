"""The original layouts of the CogVideoX, Mochi 1 and HunyuanVideo video VAEs:
``formats.recognise`` reads each as the diffusers class, renames every one of
its tensors onto the class's, and the model built from the renamed tensors
is the one the file holds.

Each test builds a tiny seeded diffusers model (standing in for the released
configuration, as tests/test_verify_files.py's VIDEO_TINY), writes its
tensors under the original names (written here, independently of formats.py,
from the original modules' attribute names and the converters' rules), and
reads them back.
"""

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

diffusers = pytest.importorskip("diffusers")

from conv_patch.tools import cli, formats  # noqa: E402

# Tiny configurations: channels that change from level to level (so the
# shortcut convolutions and the channel-changing blocks are there), and
# uneven block counts (so a block misplaced by one shows).
TINY = {
    "AutoencoderKLCogVideoX": dict(block_out_channels=(8, 16, 16, 24), latent_channels=4, norm_num_groups=4,
                                   layers_per_block=1),
    "AutoencoderKLMochi": dict(encoder_block_out_channels=(32, 64, 64, 96), decoder_block_out_channels=(32, 64, 64, 96),
                               latent_channels=4, layers_per_block=(1, 2, 1, 1, 2)),
    "AutoencoderKLHunyuanVideo": dict(block_out_channels=(8, 16, 16, 24), latent_channels=4, layers_per_block=1,
                                      norm_num_groups=4),
}
LABEL = {"AutoencoderKLCogVideoX": "CogVideoX", "AutoencoderKLMochi": "Mochi 1",
         "AutoencoderKLHunyuanVideo": "HunyuanVideo"}


@pytest.fixture
def tiny(monkeypatch):
    """The tiny model of a family, seeded, with VIDEO_DEFAULTS taking its
    configuration for the released one."""
    def make(family, cfg=None):
        cfg = cfg or TINY[family]
        monkeypatch.setattr(formats, "VIDEO_DEFAULTS", tuple(
            (c, label, s, t, cfg if c == family else conf) for c, label, s, t, conf in formats.VIDEO_DEFAULTS))
        torch.manual_seed(0)
        return getattr(diffusers, family)(**cfg).eval()
    return make


# -- Mochi 1: genmo's layout, as ComfyUI's module tree names it ---------------

def genmo_names(sd):
    """diffusers AutoencoderKLMochi state -> the original genmo layout
    (encoder: one Sequential ``layers``; decoder: a list ``blocks``), with
    the attention's q, k, v fused into one ``qkv``."""
    res = {"norm1.norm_layer.": "stack.0.", "conv1.conv.": "stack.2.", "norm2.norm_layer.": "stack.3.",
           "conv2.conv.": "stack.5."}
    n_in = 1 + max(int(m.group(1)) for k in sd for m in [re.match(r"encoder\.block_in\.resnets\.(\d+)\.", k)] if m)
    n_down = 1 + max(int(m.group(1)) for k in sd for m in [re.match(r"encoder\.down_blocks\.(\d+)\.", k)] if m)
    n_up = 1 + max(int(m.group(1)) for k in sd for m in [re.match(r"decoder\.up_blocks\.(\d+)\.", k)] if m)
    out, qkv = {}, {}

    def block(rest):
        """A resnet/norm/attention's tail (``resnets.3.conv1.conv.weight``)
        -> (index, the residual block's own name of it)."""
        kind, i, tail = re.match(r"(resnets|norms|attentions)\.(\d+)\.(.*)", rest).groups()
        if kind == "resnets":
            part = next(p for p in res if tail.startswith(p))
            return int(i), res[part] + tail[len(part):]
        if kind == "norms":
            return int(i), "attn_block.norm." + tail[len("norm_layer."):]
        if tail.startswith("to_out.0."):
            return int(i), "attn_block.attn.out." + tail[len("to_out.0."):]
        return int(i), "attn_block.attn.qkv." + tail.split(".", 1)[1] + "|" + tail.split(".", 1)[0]

    for k, v in sd.items():
        half, rest = k.split(".", 1)
        if half == "encoder":
            if rest.startswith("proj_in."):
                name = "layers.0." + rest[len("proj_in."):]
            elif rest.startswith("block_in."):
                i, tail = block(rest[len("block_in."):])
                name = f"layers.{1 + i}.{tail}"
            elif rest.startswith("down_blocks."):
                b, tail = re.match(r"down_blocks\.(\d+)\.(.*)", rest).groups()
                if tail.startswith("conv_in.conv."):
                    name = f"layers.{1 + n_in + int(b)}.layers.0.{tail[len('conv_in.conv.'):]}"
                else:
                    i, tail = block(tail)
                    name = f"layers.{1 + n_in + int(b)}.layers.{1 + i}.{tail}"
            elif rest.startswith("block_out."):
                i, tail = block(rest[len("block_out."):])
                name = f"layers.{1 + n_in + n_down + i}.{tail}"
            elif rest.startswith("norm_out.norm_layer."):
                name = "output_norm." + rest[len("norm_out.norm_layer."):]
            else:
                name = "output_proj." + rest[len("proj_out."):]
        else:
            if rest.startswith("conv_in."):
                name = "blocks.0.0." + rest[len("conv_in."):]
            elif rest.startswith("block_in."):
                i, tail = block(rest[len("block_in."):])
                name = f"blocks.0.{1 + i}.{tail}"
            elif rest.startswith("up_blocks."):
                b, tail = re.match(r"up_blocks\.(\d+)\.(.*)", rest).groups()
                if tail.startswith("proj."):
                    name = f"blocks.{1 + int(b)}.{tail}"
                else:
                    i, tail = block(tail)
                    name = f"blocks.{1 + int(b)}.blocks.{i}.{tail}"
            elif rest.startswith("block_out."):
                i, tail = block(rest[len("block_out."):])
                name = f"blocks.{1 + n_up}.{i}.{tail}"
            else:
                name = "output_proj." + rest[len("proj_out."):]
        name = f"{half}.{name}"
        if "|" in name:  # one of q, k, v: fused below, in that order
            name, which = name.split("|")
            qkv.setdefault(name, {})[which] = v
        else:
            out[name] = v
    for name, parts in qkv.items():
        out[name] = torch.cat([parts["to_q"], parts["to_k"], parts["to_v"]], 0)
    return out


def genmo_module_tree(cfg, in_channels=15, out_channels=3):
    """The module tree of ComfyUI's comfy/ldm/genmo/vae/model.py (Encoder:
    ``layers`` = 1x1 input projection, residual blocks, DownsampleBlocks
    (``layers``: strided conv, residual blocks), residual blocks, then
    ``output_norm``/``output_proj``; Decoder: ``blocks`` = (1x1x1 conv,
    residual blocks), CausalUpsampleBlocks (``blocks``, ``proj``), residual
    blocks, then ``output_proj``), rebuilt with plain layers for its names
    and shapes alone."""
    def resblock(c, attention):
        m = nn.Module()
        m.stack = nn.Sequential(nn.GroupNorm(1, c), nn.SiLU(), nn.Conv3d(c, c, 3), nn.GroupNorm(1, c), nn.SiLU(),
                                nn.Conv3d(c, c, 3))
        if attention:
            m.attn_block = nn.Module()
            m.attn_block.norm = nn.GroupNorm(1, c)
            m.attn_block.attn = nn.Module()
            m.attn_block.attn.qkv = nn.Linear(c, 3 * c, bias=False)
            m.attn_block.attn.out = nn.Linear(c, c)
        return m

    nrb, attn = cfg["layers_per_block"], (False, True, True, True, True)
    te, se = (1, 2, 3), (2, 2, 2)
    ch = cfg["encoder_block_out_channels"]
    layers = [nn.Linear(in_channels, ch[0])] + [resblock(ch[0], attn[0]) for _ in range(nrb[0])]
    for i in range(len(ch) - 1):
        down = nn.Module()
        down.layers = nn.Sequential(nn.Conv3d(ch[i], ch[i + 1], (te[i], se[i], se[i]), (te[i], se[i], se[i])),
                                    *[resblock(ch[i + 1], attn[i + 1]) for _ in range(nrb[i + 1])])
        layers.append(down)
    layers += [resblock(ch[-1], attn[-1]) for _ in range(nrb[-1])]
    enc = nn.Module()
    enc.layers = nn.Sequential(*layers)
    enc.output_norm = nn.GroupNorm(1, ch[-1])
    enc.output_proj = nn.Linear(ch[-1], 2 * cfg["latent_channels"], bias=False)
    ch = cfg["decoder_block_out_channels"]
    blocks = [nn.Sequential(nn.Conv3d(cfg["latent_channels"], ch[-1], 1), *[resblock(ch[-1], False)
                                                                           for _ in range(nrb[-1])])]
    for i in range(len(ch) - 1):
        up = nn.Module()
        up.blocks = nn.Sequential(*[resblock(ch[-i - 1], False) for _ in range(nrb[-i - 2])])
        up.proj = nn.Linear(ch[-i - 1], ch[-i - 2] * te[-i - 1] * se[-i - 1] ** 2)
        blocks.append(up)
    blocks.append(nn.Sequential(*[resblock(ch[0], False) for _ in range(nrb[0])]))
    dec = nn.Module()
    dec.blocks = nn.ModuleList(blocks)
    dec.output_proj = nn.Linear(ch[0], out_channels)
    vae = nn.Module()
    vae.encoder, vae.decoder = enc, dec
    return vae


# -- CogVideoX: the SAT layout (diffusers' convert_cogvideox_to_diffusers.py) --

def sat_names(sd):
    """diffusers AutoencoderKLCogVideoX state -> the SAT layout: LDM names
    (``down.L.block.J``, ``up.L`` numbered from the output end,
    ``mid.block_1``/``_2``, ``nin_shortcut``), convs keeping ``.conv``."""
    n_up = 1 + max(int(m.group(1)) for k in sd for m in [re.match(r"decoder\.up_blocks\.(\d+)\.", k)] if m)
    out = {}
    for k, v in sd.items():
        name = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", k)
        name = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", name)
        name = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.",
                      lambda m: f"decoder.up.{n_up - 1 - int(m.group(1))}.block.", name)
        name = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                      lambda m: f"decoder.up.{n_up - 1 - int(m.group(1))}.upsample.", name)
        name = re.sub(r"\.mid_block\.resnets\.(\d)\.", lambda m: f".mid.block_{int(m.group(1)) + 1}.", name)
        out[name.replace(".conv_shortcut.", ".nin_shortcut.")] = v
    return out


def sat_to_diffusers_by_the_converter_rules(names):
    """What diffusers' scripts/convert_cogvideox_to_diffusers.py does to SAT
    names (its VAE_KEYS_RENAME_DICT replacements in order, then the ``up.``
    keys' reversed index; ``loss`` keys dropped), for 4 levels."""
    rules = [("block.", "resnets."), ("down.", "down_blocks."), ("downsample", "downsamplers.0"),
             ("upsample", "upsamplers.0"), ("nin_shortcut", "conv_shortcut"),
             ("encoder.mid.block_1", "encoder.mid_block.resnets.0"),
             ("encoder.mid.block_2", "encoder.mid_block.resnets.1"),
             ("decoder.mid.block_1", "decoder.mid_block.resnets.0"),
             ("decoder.mid.block_2", "decoder.mid_block.resnets.1")]
    out = []
    for k in names:
        if "loss" in k:
            continue
        for a, b in rules:
            k = k.replace(a, b)
        if "up." in k:
            parts = k.split(".")
            parts[1], parts[2] = "up_blocks", str(4 - 1 - int(parts[2]))
            k = ".".join(parts)
        out.append(k)
    return out


# -- HunyuanVideo: as ComfyUI holds it (comfy/diffusers_convert.py) -------------

def comfy_hunyuan_names(sd):
    """diffusers (= the released, Tencent) HunyuanVideo VAE state -> the
    names ComfyUI converts it to on loading (and saves it under): LDM names,
    ``norm_out`` for ``conv_norm_out``, the middle attention ``mid.attn_1``
    with q/k/v/proj_out as 1x1x1 convolution weights."""
    n_up = 1 + max(int(m.group(1)) for k in sd for m in [re.match(r"decoder\.up_blocks\.(\d+)\.", k)] if m)
    attn = {"group_norm.": "norm.", "to_q.": "q.", "to_k.": "k.", "to_v.": "v.", "to_out.0.": "proj_out."}
    out = {}
    for k, v in sd.items():
        name = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", k)
        name = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", name)
        name = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.",
                      lambda m: f"decoder.up.{n_up - 1 - int(m.group(1))}.block.", name)
        name = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                      lambda m: f"decoder.up.{n_up - 1 - int(m.group(1))}.upsample.", name)
        name = re.sub(r"\.mid_block\.resnets\.(\d)\.", lambda m: f".mid.block_{int(m.group(1)) + 1}.", name)
        name = name.replace(".conv_shortcut.", ".nin_shortcut.").replace(".conv_norm_out.", ".norm_out.")
        m = re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", name)
        if m:
            part = next(p for p in attn if m.group(2).startswith(p))
            name = f"{m.group(1)}.mid.attn_1.{attn[part]}{m.group(2)[len(part):]}"
            if name.endswith("weight") and v.ndim == 2:
                v = v.reshape(*v.shape, 1, 1, 1)
        out[name] = v
    return out


ORIGINAL = {
    "AutoencoderKLMochi": (genmo_names, formats.mochi_original_names),
    "AutoencoderKLCogVideoX": (sat_names, formats.cogvideox_sat_names),
    "AutoencoderKLHunyuanVideo": (comfy_hunyuan_names, formats.hunyuan_comfy_names),
}


def flat(names):
    return [n for v in names for n in (v if isinstance(v, tuple) else (v,))]


def outputs(fmt, model):
    """Seeded decode and encode through the format's own calls."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(1, fmt.latent_channels, 2, 2, 2, generator=g)
    x = torch.rand(1, 3, fmt.video_frames, fmt.factor * 2, fmt.factor * 2, generator=g) * 2 - 1
    with torch.no_grad():
        return fmt.decode(model, z), fmt.encode(model, x)


@pytest.mark.parametrize("prefix", ["", "vae.", "first_stage_model."])
@pytest.mark.parametrize("family", sorted(ORIGINAL))
def test_original_layout_is_recognised_and_builds_the_same_model(family, prefix, tiny):
    """An original-layout file (alone, or under vae./first_stage_model. with
    other tensors beside it) is recognised as its family's class; the rename
    takes every one of the file's VAE tensors onto the class's state dict,
    none left over, none missing; the model built from the file's tensors
    decodes and encodes exactly as the diffusers model they came from."""
    vae = tiny(family)
    to_original, names_of = ORIGINAL[family]
    sd = {k: v.contiguous() for k, v in vae.state_dict().items()}
    state = {prefix + k: v.contiguous() for k, v in to_original(sd).items()}
    if family == "AutoencoderKLCogVideoX":
        state[prefix + "loss.discriminator.blocks.0.weight"] = torch.randn(4, 3, 3, 3, 3)  # SAT's training loss
    if prefix:
        state["model.diffusion_model.patch_embed.proj.weight"] = torch.randn(8, 4, 1, 2, 2)  # a transformer's
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    fmt = formats.recognise(shapes)
    assert fmt.kind == "original-video-vae" and f"diffusers' {family}" in fmt.description, fmt.description
    assert LABEL[family] in fmt.description and not fmt.problem and fmt.decode and fmt.encode
    assert (f"under '{prefix}'" in fmt.description) == bool(prefix)

    rename = names_of([k[len(prefix):] for k in state if k.startswith(prefix)])
    assert sorted(flat(rename.values())) == sorted(sd), sorted(set(flat(rename.values())) ^ set(sd))[:6]
    assert all(k.startswith("loss.") or k in rename for k in (k[len(prefix):] for k in state if k.startswith(prefix)))

    built = fmt.build(state).eval()
    for got, want in zip(outputs(fmt, built), outputs(fmt, vae)):
        assert torch.equal(got, want)


def test_mochi_original_names_are_comfyuis_module_tree(tiny):
    """The genmo names this file writes are exactly (names and shapes) those
    of ComfyUI's Mochi VAE module tree, for the tiny configuration."""
    vae = tiny("AutoencoderKLMochi")
    ours = {k: tuple(v.shape) for k, v in genmo_names(vae.state_dict()).items()}
    theirs = {k: tuple(v.shape) for k, v in genmo_module_tree(TINY["AutoencoderKLMochi"]).state_dict().items()}
    assert ours == theirs, sorted(set(ours.items()) ^ set(theirs.items()))[:6]


def test_mochi_halves_as_genmo_ships_them(tiny):
    """genmo ships the encoder and the decoder as two bare files (``layers.``,
    ``blocks.``): each is recognised as that half alone, and builds."""
    vae = tiny("AutoencoderKLMochi")
    state = genmo_names({k: v.contiguous() for k, v in vae.state_dict().items()})
    for half, other in (("encoder", "decoder"), ("decoder", "encoder")):
        bare = {k[len(half) + 1:]: v for k, v in state.items() if k.startswith(half + ".")}
        fmt = formats.recognise({k: tuple(v.shape) for k, v in bare.items()})
        assert fmt.kind == "original-video-vae" and f"({half} only)" in fmt.description, fmt.description
        assert (fmt.decode is None) == (half == "encoder") and (fmt.encode is None) == (half == "decoder")
        built = fmt.build(bare)
        mine = {k: v for k, v in built.state_dict().items() if k.startswith(half + ".")}
        assert all(torch.equal(v, vae.state_dict()[k]) for k, v in mine.items())


def test_cogvideox_sat_names_are_the_diffusers_converters():
    """The SAT names this file writes go back to diffusers' by the rules of
    diffusers' own converter script (its rename table and reversed up
    index), for the released 4 levels."""
    with torch.device("meta"):
        vae = diffusers.AutoencoderKLCogVideoX(**TINY["AutoencoderKLCogVideoX"])
    sd = vae.state_dict()
    sat = list(sat_names(sd)) + ["loss.perceptual_loss.net.0.weight"]
    assert sorted(sat_to_diffusers_by_the_converter_rules(sat)) == sorted(sd)
    ours = formats.cogvideox_sat_names(sat)
    assert sorted(ours.values()) == sorted(sd) and "loss.perceptual_loss.net.0.weight" not in ours


@pytest.mark.parametrize("prefix", ["", "vae."])
def test_hunyuan_released_layout_is_diffusers_alone_or_under_a_prefix(prefix, tiny):
    """HunyuanVideo's released VAE (Tencent's layout, as Comfy-Org ships
    hunyuan_video_vae_bf16.safetensors) has diffusers' names: recognised as
    such, alone or under vae. in a whole checkpoint, and said to be the
    original layout too."""
    vae = tiny("AutoencoderKLHunyuanVideo")
    state = {prefix + k: v.contiguous() for k, v in vae.state_dict().items()}
    if prefix:
        state["model.diffusion_model.img_in.proj.weight"] = torch.randn(8, 4, 1, 2, 2)
    fmt = formats.recognise({k: tuple(v.shape) for k, v in state.items()})
    assert fmt.kind == "diffusers-video-vae" and "(AutoencoderKLHunyuanVideo)" in fmt.description, fmt.description
    assert "original layout too" in fmt.description and (f"under '{prefix}'" in fmt.description) == bool(prefix)
    for got, want in zip(outputs(fmt, fmt.build(state).eval()), outputs(fmt, vae)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", sorted(ORIGINAL))
def test_broken_original_file_is_not_recognised_and_says_why(family, tiny):
    """One tensor missing, one too many, or one of another shape: not taken
    for the model (per-layer checks only), with the family, the layout and
    the file's own name of the tensor in the reason; never an exception."""
    vae = tiny(family)
    to_original, _ = ORIGINAL[family]
    shapes = {k: tuple(v.shape) for k, v in to_original(vae.state_dict()).items()}
    conv = next(k for k, v in shapes.items() if k.startswith("decoder.") and len(v) == 5 and k.endswith("weight"))

    cut = {k: v for k, v in shapes.items() if k != conv}
    fmt = formats.recognise(cut)
    assert fmt.kind == "unknown" and not fmt.recognised, fmt.description
    assert LABEL[family] in fmt.description and "not as released" in fmt.description
    assert "missing" in fmt.description

    extra = dict(shapes, **{"decoder.stray.weight": (4, 4, 1, 1, 1)})
    fmt = formats.recognise(extra)
    assert fmt.kind == "unknown" and "'decoder.stray.weight' is not part of it" in fmt.description, fmt.description

    wrong = dict(shapes)
    wrong[conv] = (wrong[conv][0] + 1,) + wrong[conv][1:]
    fmt = formats.recognise(wrong)
    assert fmt.kind == "unknown" and repr(conv) in fmt.description and "shape" in fmt.description, fmt.description

    # Whatever is left of it, down to nothing of a model at all.
    for n in (len(shapes) // 2, 3, 1):
        fmt = formats.recognise(dict(list(shapes.items())[-n:]))
        assert fmt.kind == "unknown"


def test_truncated_original_file_verifies_per_layer_only(tmp_path, capsys, tiny):
    """``convpatch verify`` on a Mochi file in the original layout with one
    tensor missing: no traceback, the reason it is not the model, and the
    per-layer checks alone."""
    vae = tiny("AutoencoderKLMochi")
    state = genmo_names({k: v.contiguous() for k, v in vae.state_dict().items()})
    state = {k: v for k, v in state.items() if k not in ("encoder.output_proj.weight",)}
    path = tmp_path / "mochi_vae.safetensors"
    save_file(state, str(path))
    code = cli.main(["verify", str(path), "--size", "16", "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in out + err, out + err
    report = json.loads((tmp_path / "r.json").read_text())["reports"][0]
    assert report["end_to_end"] == []
    notes = " ".join(report["notes"])
    assert "Mochi 1" in notes and "missing" in notes and "per-layer checks only" in notes, notes


def test_original_layout_verifies_end_to_end_under_its_own_names(tmp_path, capsys, tiny):
    """``convpatch verify`` on a CogVideoX VAE in the SAT layout: built,
    decoded and encoded end to end, every layer reported under the file's
    own name. (Narrower still than TINY, to verify in seconds under the
    Triton interpreter.)"""
    vae = tiny("AutoencoderKLCogVideoX", dict(block_out_channels=(8, 8, 8, 16), latent_channels=4, norm_num_groups=4,
                                              layers_per_block=1))
    state = sat_names({k: v.contiguous() for k, v in vae.state_dict().items()})
    path = tmp_path / "cogvideox_vae.safetensors"
    save_file(state, str(path))
    code = cli.main(["verify", str(path), "--size", "16", "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    report = json.loads((tmp_path / "r.json").read_text())["reports"][0]
    assert [e["what"].split(" ")[0] for e in report["end_to_end"]] == ["decode", "encode"]
    assert all(e["passed"] for e in report["end_to_end"]) and all(r["passed"] for r in report["layers"])
    assert {r["name"] + ".weight" for r in report["layers"]} <= set(state)
    assert any(".nin_shortcut" in r["name"] for r in report["layers"])
