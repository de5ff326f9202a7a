"""The model zoo: every model family users point conv-patch at, unpatched
against patched (and patched with ``PatchConfig(cuda_graphs=True)``), each
call launched eagerly the way diffusers and ComfyUI run it.

    python -m bench.zoo [--only NAME ...] [--runs 7] [--min-seconds 0.5] [--max-runs 51]
                        [--set quick|full|host|untuned] [--convs-only] [--no-passthrough]
                        [--cudnn-benchmark] [--tiny]

Per (model, size, batch, dtype) one row: ``baseline_ms`` (the unpatched
model), ``ours_ms`` (after ``conv_patch.apply``), ``graph_ms`` (with CUDA
graphs), ``speedup``, ``host_ms`` (how long the patched call takes to
return, before its GPU work is waited for), ``noise`` (the spread of the
unpatched model's own timed calls, (max - min) / median), ``noise_iqr``
(their quartiles over the median) and ``speedup_round_iqr`` (the quartiles
of the per-round speedups). The timed rounds are ``--runs`` at least and
more for fast models, until they span ``--min-seconds`` of the unpatched
model's time (``runs`` says how many), at most ``--max-runs``. With
``--convs-only`` the model patched with ``recipes=False`` runs in the same
rounds (``convs_only_ms``, ``convs_only_speedup``,
``convs_only_round_iqr``): what the block recipes add or cost; with
``--no-passthrough`` the model patched with ``PatchConfig(passthrough=False)``
(``no_passthrough_ms``, ...): what passing through the idle parts saves.
``passed_through`` counts the components the patched model runs as their
own classes at the row's signature. Variants run
interleaved, A B C A B C ..., each call timed from a synchronised GPU to
its finished output (wall clock: host and GPU time as the user waits for
them), medians after warm-up (the first calls compile the kernels). UNets,
ControlNet and AutoencoderKL use diffusers' configs with seeded random
weights (speed does not depend on the values); TAEF2 loads its real weights
from ``../shared/models``. ``--tiny`` shrinks every model to a few channels
so the logic runs on the CPU under the Triton interpreter (the tests).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import conv_patch
from conv_patch.runtime.state import state_of

from .common import bench_device, peak_gib, print_table, rotated, sync, write_results

SHARED = Path(os.environ.get("CONV_PATCH_SHARED") or Path(__file__).resolve().parents[2] / "shared")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def seeded(model: nn.Module) -> nn.Module:
    from conv_patch.tools.taesd import seeded_
    seeded_(model)
    return model


# -- models --------------------------------------------------------------------
# Each builder returns (model, make_inputs(size, batch, generator) -> (args, kwargs), run(model, args, kwargs)).

def _unet_inputs(latent, ctx_dim, seq, extra=None):
    def make(size, batch, g, device, dtype):
        s = size // 8
        args = (torch.randn(batch, latent, s, s, generator=g, device=device, dtype=dtype),
                torch.full((batch,), 500.0, device=device))
        kw = {"encoder_hidden_states": torch.randn(batch, seq, ctx_dim, generator=g, device=device, dtype=dtype)}
        if extra:
            kw["added_cond_kwargs"] = {k: torch.randn(batch, *shape, generator=g, device=device, dtype=dtype)
                                       for k, shape in extra.items()}
        return args, kw
    return make


def sd15_unet(tiny):
    from diffusers import UNet2DConditionModel
    if tiny:
        cfg = dict(block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                   up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1, cross_attention_dim=32,
                   attention_head_dim=4, norm_num_groups=8, sample_size=8)
        return UNet2DConditionModel(**cfg), _unet_inputs(4, 32, 7)
    return UNet2DConditionModel(cross_attention_dim=768), _unet_inputs(4, 768, 77)


def sdxl_unet(tiny):
    from diffusers import UNet2DConditionModel
    common = dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                  addition_embed_type="text_time", use_linear_projection=True)
    if tiny:
        cfg = dict(block_out_channels=(16, 32, 32), transformer_layers_per_block=(1, 1, 1), attention_head_dim=(2, 4, 4),
                   cross_attention_dim=32, addition_time_embed_dim=8, projection_class_embeddings_input_dim=80,
                   layers_per_block=1, norm_num_groups=8, **common)
        return UNet2DConditionModel(**cfg), _unet_inputs(4, 32, 7, {"text_embeds": (32,), "time_ids": (6,)})
    cfg = dict(block_out_channels=(320, 640, 1280), transformer_layers_per_block=(1, 2, 10),
               attention_head_dim=(5, 10, 20), cross_attention_dim=2048, addition_time_embed_dim=256,
               projection_class_embeddings_input_dim=2816, sample_size=128, **common)
    return UNet2DConditionModel(**cfg), _unet_inputs(4, 2048, 77, {"text_embeds": (1280,), "time_ids": (6,)})


def controlnet(tiny):
    from diffusers import ControlNetModel
    if tiny:
        cfg = dict(block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                   layers_per_block=1, cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
                   conditioning_embedding_out_channels=(8, 16, 32, 32))
        base = _unet_inputs(4, 32, 7)
    else:
        cfg = {"cross_attention_dim": 768}
        base = _unet_inputs(4, 768, 77)

    def make(size, batch, g, device, dtype):
        args, kw = base(size, batch, g, device, dtype)
        kw["controlnet_cond"] = torch.randn(batch, 3, size, size, generator=g, device=device, dtype=dtype)
        return args, kw
    return ControlNetModel(**cfg), make


class ResidualDenseBlock_5C(nn.Module):
    """ESRGAN's residual dense block (its new-arch form, as basicsr builds
    it): 5 convs, each reading the input and every earlier output,
    LeakyReLU(0.2), residual scale 0.2."""

    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, gc, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf + gc, gc, 3, 1, 1)
        self.conv3 = nn.Conv2d(nf + 2 * gc, gc, 3, 1, 1)
        self.conv4 = nn.Conv2d(nf + 3 * gc, gc, 3, 1, 1)
        self.conv5 = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        return x5 * 0.2 + x


class RRDB(nn.Module):
    """ESRGAN's residual-in-residual dense block: 3 dense blocks, residual
    scale 0.2."""

    def __init__(self, nf, gc=32):
        super().__init__()
        self.RDB1 = ResidualDenseBlock_5C(nf, gc)
        self.RDB2 = ResidualDenseBlock_5C(nf, gc)
        self.RDB3 = ResidualDenseBlock_5C(nf, gc)

    def forward(self, x):
        out = self.RDB1(x)
        out = self.RDB2(out)
        out = self.RDB3(out)
        return out * 0.2 + x


class RRDBNet(nn.Module):
    """An ESRGAN x4 upscaler (RRDBNet: 23 blocks, 64 features, 32 growth:
    351 convolutions), laid out as ESRGAN's new-arch RRDBNet."""

    def __init__(self, nf=64, nb=23, gc=32):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.RRDB_trunk = nn.Sequential(*[RRDB(nf, gc) for _ in range(nb)])
        self.trunk_conv = nn.Conv2d(nf, nf, 3, 1, 1)
        self.upconv1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.upconv2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.HRconv = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def forward(self, x):
        fea = self.conv_first(x)
        fea = fea + self.trunk_conv(self.RRDB_trunk(fea))
        fea = self.lrelu(self.upconv1(nn.functional.interpolate(fea, scale_factor=2.0, mode="nearest")))
        fea = self.lrelu(self.upconv2(nn.functional.interpolate(fea, scale_factor=2.0, mode="nearest")))
        return self.conv_last(self.lrelu(self.HRconv(fea)))


def image_inputs(channels=3, scale=1):
    def make(size, batch, g, device, dtype):
        s = size // scale
        return (torch.randn(batch, channels, s, s, generator=g, device=device, dtype=dtype),), {}
    return make


def rrdb(tiny):
    # Tiny: one RRDB in the trunk, enough for the rows' logic (RRDBs
    # chained in NHWC are tests/test_esrgan_recipes.py's, spandrel's stack).
    return (RRDBNet(16, 1, 8) if tiny else RRDBNet()), image_inputs()


def spandrel_rrdbnet(nf=64, nb=23, gc=32) -> nn.Module:
    """The same x4 ESRGAN laid out as spandrel (and so ComfyUI's upscale
    model loader) builds it from a checkpoint: one flattened
    ``nn.Sequential`` (stem conv, a shortcut around the RRDB trunk and its
    conv, ``nn.Upsample`` + conv + LeakyReLU twice, the HR convs), each
    dense-block conv an ``nn.Sequential`` of the conv and its LeakyReLU
    (conv5's the conv alone)."""

    def cna(cin, cout, act=True):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), *([nn.LeakyReLU(0.2, inplace=True)] if act else []))

    class ResidualDenseBlock_5C(nn.Module):  # noqa: N801 - spandrel's class name
        def __init__(self):
            super().__init__()
            self.conv1x1 = None
            self.conv1, self.conv2, self.conv3, self.conv4 = (cna(nf + k * gc, gc) for k in range(4))
            self.conv5 = cna(nf + 4 * gc, nf, act=False)

        def forward(self, x):
            x1 = self.conv1(x)
            x2 = self.conv2(torch.cat((x, x1), 1))
            x3 = self.conv3(torch.cat((x, x1, x2), 1))
            x4 = self.conv4(torch.cat((x, x1, x2, x3), 1))
            x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
            return x5 * 0.2 + x

    class RRDB(nn.Module):
        def __init__(self):
            super().__init__()
            self.RDB1, self.RDB2, self.RDB3 = ResidualDenseBlock_5C(), ResidualDenseBlock_5C(), ResidualDenseBlock_5C()

        def forward(self, x):
            return self.RDB3(self.RDB2(self.RDB1(x))) * 0.2 + x

    class ShortcutBlock(nn.Module):
        def __init__(self, sub):
            super().__init__()
            self.sub = sub

        def forward(self, x):
            return x + self.sub(x)

    def up():
        return [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(nf, nf, 3, 1, 1), nn.LeakyReLU(0.2, True)]

    return nn.Sequential(nn.Conv2d(3, nf, 3, 1, 1),
                         ShortcutBlock(nn.Sequential(*[RRDB() for _ in range(nb)], nn.Conv2d(nf, nf, 3, 1, 1))),
                         *up(), *up(), nn.Conv2d(nf, nf, 3, 1, 1), nn.LeakyReLU(0.2, True), nn.Conv2d(nf, 3, 3, 1, 1))


def rrdb_spandrel(tiny):
    return (spandrel_rrdbnet(16, 2, 8) if tiny else spandrel_rrdbnet()), image_inputs()


def autoencoder_tiny(tiny):
    from diffusers import AutoencoderTiny
    m = AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8)) if tiny \
        else AutoencoderTiny()
    return _Part(m.decoder), image_inputs(4, 8)


def taef2(tiny):
    from conv_patch.tools import taesd
    if tiny:
        return taesd.decoder(32, channels=8), image_inputs(32, 8)
    from safetensors.torch import load_file
    dec = taesd.decoder(32)
    dec.load_state_dict(load_file(str(SHARED / "models" / "taef2_decoder.safetensors")))
    return dec, image_inputs(32, 8)


class _Part(nn.Module):
    """One part (decoder or encoder) of a VAE as the model to time."""

    def __init__(self, part):
        super().__init__()
        self.part = part

    def forward(self, x):
        return self.part(x)


def kl_vae(latent, tiny):
    from diffusers import AutoencoderKL
    if tiny:
        return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent, block_out_channels=(8, 16),
                             down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                             layers_per_block=1, norm_num_groups=4)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent,
                         down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                         block_out_channels=[128, 256, 512, 512], layers_per_block=2)


def sd_vae_decode(tiny):  # SD1.5 and SDXL share the VAE's shapes
    return _Part(kl_vae(4, tiny).decoder), image_inputs(4, 8 if not tiny else 2)


def sd_vae_encode(tiny):
    return _Part(kl_vae(4, tiny).encoder), image_inputs(3)


def flux_vae_decode(tiny):
    return _Part(kl_vae(16, tiny).decoder), image_inputs(16, 8 if not tiny else 2)


def flux_vae_encode(tiny):
    return _Part(kl_vae(16, tiny).encoder), image_inputs(3)


# -- architectures no recipe or table entry was written for (issue 44's
# "models nobody tuned for"): published configs, seeded weights. Their rows
# show what conv-patch does to a model it was not tuned on; they are never
# tuned on as models (tables are tuned on layers).

def dc_ae_decode(tiny):
    """Sana's DC-AE (``AutoencoderDC``, f32c32: ResBlocks, then
    EfficientViT blocks with multi-scale linear attention)."""
    from diffusers import AutoencoderDC
    types = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    if tiny:
        m = AutoencoderDC(latent_channels=8, attention_head_dim=4, encoder_block_types=types[:1] + types[-1:],
                          decoder_block_types=types[:1] + types[-1:], encoder_block_out_channels=(8, 16),
                          decoder_block_out_channels=(8, 16), encoder_layers_per_block=(1, 1),
                          decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), (5,)),
                          decoder_qkv_multiscales=((), (5,)), upsample_block_type="interpolate",
                          downsample_block_type="Conv")
        return _Part(m.decoder), image_inputs(8, 2)
    m = AutoencoderDC(encoder_block_types=types, decoder_block_types=types, upsample_block_type="interpolate",
                      downsample_block_type="Conv", scaling_factor=0.41407)
    return _Part(m.decoder), image_inputs(32, 32)


def ddpm_unet(tiny):
    """An unconditional pixel-space ``UNet2DModel`` (DDPM's 256² church
    config: six levels, one of them with attention)."""
    from diffusers import UNet2DModel
    if tiny:
        m = UNet2DModel(block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), layers_per_block=1, norm_num_groups=4,
                        attention_head_dim=4)
    else:
        m = UNet2DModel(block_out_channels=(128, 128, 256, 256, 512, 512), layers_per_block=2,
                        down_block_types=("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4, sample_size=256)

    def make(size, batch, g, device, dtype):
        x = torch.randn(batch, 3, size, size, generator=g, device=device, dtype=dtype)
        return (x, torch.full((batch,), 500.0, device=device)), {}
    return m, make


class _VQDecode(nn.Module):
    """A VQ model's decode of continuous latents (no codebook lookup), as a
    diffusion pipeline calls it."""

    def __init__(self, vq):
        super().__init__()
        self.vq = vq

    def forward(self, z):
        return self.vq.decode(z, force_not_quantize=True).sample


def movq_decode(tiny):
    """Kandinsky 2.2's MoVQ (``VQModel`` with spatially conditioned norms)."""
    from diffusers import VQModel
    if tiny:
        # (SpatialNorm's GroupNorm has 32 groups whatever the config says.)
        m = VQModel(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
                    up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"), latent_channels=4, layers_per_block=1,
                    norm_num_groups=8, norm_type="spatial", num_vq_embeddings=32, vq_embed_dim=4)
        return _VQDecode(m), image_inputs(4, 2)
    m = VQModel(block_out_channels=(128, 256, 256, 512), latent_channels=4, layers_per_block=2, norm_type="spatial",
                down_block_types=("DownEncoderBlock2D",) * 3 + ("AttnDownEncoderBlock2D",),
                up_block_types=("AttnUpDecoderBlock2D",) + ("UpDecoderBlock2D",) * 3,
                num_vq_embeddings=16384, vq_embed_dim=4)
    return _VQDecode(m), image_inputs(4, 8)


def asym_vae_decode(tiny):
    """The asymmetric SD VAE (``AsymmetricAutoencoderKL``, x-1-5: a wider,
    deeper decoder with a masked-image condition, here unconditioned)."""
    from diffusers import AsymmetricAutoencoderKL
    if tiny:
        m = AsymmetricAutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, down_block_out_channels=(8, 16),
                                    up_block_types=("UpDecoderBlock2D",) * 2, up_block_out_channels=(8, 16),
                                    layers_per_up_block=2, norm_num_groups=4)
        return _Part(m.decoder), image_inputs(4, 2)
    m = AsymmetricAutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, down_block_out_channels=(128, 256, 512, 512),
                                up_block_types=("UpDecoderBlock2D",) * 4, up_block_out_channels=(192, 384, 768, 768),
                                layers_per_up_block=3)
    return _Part(m.decoder), image_inputs(4, 8)


class _TemporalDecode(nn.Module):
    """A clip's decode by Stable Video Diffusion's VAE: the latents of
    ``frames`` frames as a batch, mixed in time by its Conv3d blocks."""

    def __init__(self, vae, frames):
        super().__init__()
        self.vae, self.frames = vae, frames

    def forward(self, z):
        return self.vae.decode(z, num_frames=self.frames).sample


def svd_vae_decode(tiny):
    """``AutoencoderKLTemporalDecoder`` (SVD's config), 8 frames a call:
    the zoo row's batch is the frame count."""
    from diffusers import AutoencoderKLTemporalDecoder
    if tiny:
        m = AutoencoderKLTemporalDecoder(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,  # (32 groups)
                                         layers_per_block=1)
        return _TemporalDecode(m, 2), image_inputs(4, 2)
    m = AutoencoderKLTemporalDecoder(block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                                     down_block_types=("DownEncoderBlock2D",) * 4)
    return _TemporalDecode(m, 8), image_inputs(4, 8)


class SRVGGNetCompact(nn.Module):
    """Real-ESRGAN's compact upscaler (realesr-general-x4v3: 64 features,
    32 hidden 3x3 convs, each with per-channel PReLU, pixel shuffle, plus
    the nearest upsampled input), laid out as Real-ESRGAN and spandrel
    build it (``body``, ``upsampler``, ``upscale``)."""

    def __init__(self, num_feat=64, num_conv=32, upscale=4):
        super().__init__()
        self.upscale = upscale
        layers = [nn.Conv2d(3, num_feat, 3, 1, 1), nn.PReLU(num_feat)]
        for _ in range(num_conv):
            layers += [nn.Conv2d(num_feat, num_feat, 3, 1, 1), nn.PReLU(num_feat)]
        layers.append(nn.Conv2d(num_feat, 3 * upscale * upscale, 3, 1, 1))
        self.body = nn.ModuleList(layers)
        self.upsampler = nn.PixelShuffle(upscale)

    def forward(self, x):
        out = x
        for layer in self.body:
            out = layer(out)
        return self.upsampler(out) + nn.functional.interpolate(x, scale_factor=self.upscale, mode="nearest")


def srvgg_x4(tiny):
    return (SRVGGNetCompact(8, 3) if tiny else SRVGGNetCompact()), image_inputs()


def hunyuan_image_vae_decode(tiny):
    """HunyuanImage 2.1's VAE (``AutoencoderKLHunyuanImage``: 32x
    compression, 64 latent channels, six levels up to 1024 channels), its
    2-D decoder."""
    from diffusers import AutoencoderKLHunyuanImage
    if tiny:
        m = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(32, 64),  # (32 groups)
                                      layers_per_block=1, spatial_compression_ratio=2, sample_size=16)
        return _Part(m.decoder), image_inputs(8, 2)
    m = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=64,
                                  block_out_channels=(128, 256, 512, 512, 1024, 1024), layers_per_block=2,
                                  spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289)
    return _Part(m.decoder), image_inputs(64, 32)


class ResidualBlockNoBN(nn.Module):
    """EDSR's block: conv, ReLU, conv, scaled, plus the input."""

    def __init__(self, num_feat=64, res_scale=1.0):
        super().__init__()
        self.res_scale = res_scale
        self.conv1 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv2 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return x + self.conv2(self.relu(self.conv1(x))) * self.res_scale


class EDSR(nn.Module):
    """EDSR (Lim et al., 2017) laid out as basicsr builds it: the image
    centred on the dataset mean, ``conv_first``, a body of residual blocks,
    ``conv_after_body`` plus the body's input, conv + pixel-shuffle
    upsampling by 2 per step, ``conv_last``. The baseline x4 config (16
    blocks of 64 features) with the large model's residual scale, 0.1:
    with seeded weights, scale 1 grows the activations ~1.4x a block and the
    input's 255 range overflows fp16 (trained weights keep the branches
    small)."""

    def __init__(self, num_feat=64, num_block=16, upscale=4, res_scale=0.1, img_range=255.0):
        super().__init__()
        self.img_range = img_range
        self.register_buffer("mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.conv_first = nn.Conv2d(3, num_feat, 3, 1, 1)
        self.body = nn.Sequential(*[ResidualBlockNoBN(num_feat, res_scale) for _ in range(num_block)])
        self.conv_after_body = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        steps = []
        for _ in range(int(math.log2(upscale))):
            steps += [nn.Conv2d(num_feat, 4 * num_feat, 3, 1, 1), nn.PixelShuffle(2)]
        self.upsample = nn.Sequential(*steps)
        self.conv_last = nn.Conv2d(num_feat, 3, 3, 1, 1)

    def forward(self, x):
        x = (x - self.mean) * self.img_range
        x = self.conv_first(x)
        res = self.conv_after_body(self.body(x)) + x
        return self.conv_last(self.upsample(res)) / self.img_range + self.mean


def edsr_x4(tiny):
    return (EDSR(8, 2) if tiny else EDSR()), image_inputs()


# name -> (builder, default dtype)
MODELS = {
    "sd15-unet": (sd15_unet, "fp16"), "sdxl-unet": (sdxl_unet, "fp16"), "controlnet": (controlnet, "fp16"),
    "rrdb-x4": (rrdb, "fp16"), "rrdb-spandrel-x4": (rrdb_spandrel, "fp16"), "autoencoder-tiny": (autoencoder_tiny, "fp16"), "taef2": (taef2, "fp16"),
    "sd-vae-decode": (sd_vae_decode, "fp16"), "sd-vae-encode": (sd_vae_encode, "fp16"),
    "flux-vae-decode": (flux_vae_decode, "bf16"), "flux-vae-encode": (flux_vae_encode, "bf16"),
    "dc-ae-decode": (dc_ae_decode, "bf16"), "ddpm-unet": (ddpm_unet, "fp16"), "movq-decode": (movq_decode, "fp16"),
    "asym-vae-decode": (asym_vae_decode, "fp16"), "svd-vae-decode": (svd_vae_decode, "fp16"),
    "srvgg-x4": (srvgg_x4, "fp16"), "hunyuan-image-vae-decode": (hunyuan_image_vae_decode, "bf16"),
    "edsr-x4": (edsr_x4, "fp16"),
}
# The architectures above that nobody tuned for, at their usual sizes: no
# table entry was measured on them. Recipes were written later for DC-AE,
# the SRVGG compact net and (through the dense blocks) spandrel's RRDB; the
# DDPM UNet, MoVQ, the asymmetric VAE, SVD's temporal decoder, HunyuanImage's
# VAE and EDSR have none of their own.
UNTUNED = [("dc-ae-decode", 1024, 1, None), ("ddpm-unet", 256, 1, None), ("movq-decode", 512, 1, None),
           ("asym-vae-decode", 512, 1, None), ("svd-vae-decode", 512, 8, None), ("srvgg-x4", 256, 1, None),
           ("rrdb-spandrel-x4", 256, 1, None), ("hunyuan-image-vae-decode", 1024, 1, None), ("edsr-x4", 256, 1, None)]
# (model, image size in pixels, batch, dtype or None for the model's own)
QUICK = [
    ("sd15-unet", 512, 2, None), ("sdxl-unet", 1024, 1, None), ("controlnet", 512, 2, None),
    ("rrdb-x4", 256, 1, None), ("autoencoder-tiny", 512, 1, None),
    ("taef2", 512, 1, None), ("taef2", 2048, 1, None), ("taef2", 2048, 1, "bf16"),
    ("sd-vae-decode", 1024, 1, None), ("sd-vae-encode", 1024, 1, None),
    ("flux-vae-decode", 512, 1, None), ("flux-vae-decode", 1024, 1, None), ("flux-vae-decode", 2048, 1, None),
    ("flux-vae-encode", 1024, 1, None),
]
FULL = QUICK + [
    ("sd15-unet", 512, 1, None), ("sdxl-unet", 1024, 2, None), ("autoencoder-tiny", 1024, 1, None),
    ("taef2", 256, 1, None), ("taef2", 1024, 1, None),
    ("sd-vae-decode", 512, 1, None), ("sd-vae-decode", 512, 4, None), ("sd-vae-decode", 2048, 1, None),
    ("sd-vae-decode", (832, 1216), 1, None), ("sd-vae-decode", 1024, 1, "bf16"),
    ("sd-vae-encode", 512, 4, None), ("flux-vae-decode", 512, 4, None), ("flux-vae-decode", 1024, 1, "fp16"),
    ("flux-vae-encode", 512, 1, None), ("flux-vae-encode", 2048, 1, None), ("flux-vae-decode", (832, 1216), 1, None),
] + UNTUNED
# The rows that are host-bound when launched eagerly (their GPU work is
# shorter than the Python and launches around it): where host-time changes
# show, and where a run of the full set takes too long to repeat.
HOST = [("sd15-unet", 512, 2, None), ("sd15-unet", 512, 1, None), ("controlnet", 512, 2, None),
        ("rrdb-x4", 256, 1, None), ("autoencoder-tiny", 512, 1, None), ("taef2", 256, 1, None),
        ("taef2", 512, 1, None), ("flux-vae-decode", 512, 1, None)]
TINY = [("sd15-unet", 16, 1, "fp32"), ("rrdb-x4", 8, 1, "fp32"), ("taef2", 16, 1, "fp32"),
        ("flux-vae-decode", 16, 1, "fp32"), ("dc-ae-decode", 16, 1, "fp32"), ("ddpm-unet", 8, 1, "fp32"),
        ("movq-decode", 16, 1, "fp32"), ("asym-vae-decode", 16, 1, "fp32"), ("svd-vae-decode", 16, 2, "fp32"),
        ("srvgg-x4", 8, 1, "fp32"), ("rrdb-spandrel-x4", 8, 1, "fp32"), ("hunyuan-image-vae-decode", 16, 1, "fp32"),
        ("edsr-x4", 8, 1, "fp32")]


def _timed(fn):
    """(wall ms to the finished output, ms until the call returned)."""
    sync()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    sync()
    return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3


def interleaved(variants: dict, runs: int, warmup: int) -> dict:
    """name -> {"ms": median, "host_ms": median, "samples": [...]}: the
    variants called in turn, the order rotated each round (A B C, B C A,
    ...: ``common.rotated``), ``warmup`` rounds untimed."""
    out = {k: {"samples": [], "host": []} for k in variants}
    names = list(variants)
    for i in range(warmup + runs):
        for j in rotated(len(names), i):
            k = names[j]
            ms, host = _timed(variants[k])
            if i >= warmup:
                out[k]["samples"].append(ms)
                out[k]["host"].append(host)
    for v in out.values():
        v["ms"] = statistics.median(v["samples"])
        v["host_ms"] = statistics.median(v["host"])
    return out


def size_name(size):
    return f"{size[0]}x{size[1]}" if isinstance(size, tuple) else f"{size}x{size}"


def inputs_for(make, size, batch, device, dtype, n=3):
    """``n`` different inputs (rotated through, so no call reuses the last
    one's cache lines); non-square sizes as (height, width)."""
    out = []
    for i in range(n):
        g = torch.Generator(device=device).manual_seed(1000 + i)
        if isinstance(size, tuple):
            args, kw = make(max(size), batch, g, device, dtype)
            h, w = size
            s = args[0].shape[-1] / max(size)
            args = (args[0][..., :round(h * s), :round(w * s)].contiguous(),) + tuple(args[1:])
        else:
            args, kw = make(size, batch, g, device, dtype)
        out.append((args, kw))
    return out


def load_case(name, size, batch, dtype_name, tiny, device, n_inputs=3):
    """(row fields, unpatched model, inputs) of zoo case ``name``: built on
    ``device`` in its dtype, seeded random weights (TAEF2 its real ones,
    except tiny), ``n_inputs`` different inputs (``_inputs``). The row
    fields: name, model, size, batch, dtype."""
    build, default_dtype = MODELS[name]
    dtype_label = dtype_name or default_dtype
    dtype = DTYPES[dtype_label]
    with torch.device(device):
        # Built on the device: a random init of SDXL's 2.6B parameters on the CPU takes minutes.
        model, make = build(tiny)
    model = seeded(model) if name != "taef2" or tiny else model
    model = model.to(device, dtype).eval()
    fields = {"name": f"{name} {size_name(size)} b{batch} {dtype_label}", "model": name, "size": size_name(size),
              "batch": batch, "dtype": dtype_label}
    return fields, model, inputs_for(make, size, batch, device, dtype, n_inputs)


def case_args(ap, name: str) -> None:
    """The options every zoo-case benchmark takes: --only, --tiny, --out, --name."""
    ap.add_argument("--only", nargs="+", choices=sorted(MODELS), default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (the tests)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--name", default=name, help="result file stem")


def selected(cases, only):
    """The cases of the models ``only`` names (all where None)."""
    return [c for c in cases if c[0] in only] if only else cases


# The timed rounds of a row span at least MIN_SECONDS of the unpatched
# model's time (a 4 ms TAEF2 call gets many more than a 400 ms decode, whose
# rounds barely vary), at most MAX_RUNS.
MIN_SECONDS = 0.5
MAX_RUNS = 51


def runs_for(one_ms: float, runs: int, min_seconds: float, max_runs: int = MAX_RUNS) -> int:
    """Timed rounds for a model whose call takes ``one_ms``: ``runs`` at
    least, more until they span ``min_seconds``, never above ``max_runs``."""
    if min_seconds <= 0 or one_ms <= 0:
        return runs
    return max(runs, min(max_runs, math.ceil(min_seconds * 1e3 / one_ms)))


def _quartiles(xs) -> list:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return [q[0], q[2]]


def _round_iqr(base: dict, other: dict) -> list:
    """Quartiles of the per-round speedups of ``other`` over ``base``
    (``interleaved`` results: a round's calls run back to back)."""
    return _quartiles([u / p for u, p in zip(base["samples"], other["samples"])])


# Extra variants patched otherwise, timed in the same rounds (``--convs-only``,
# ``--no-passthrough``): name -> apply()'s keyword arguments.
EXTRA_VARIANTS = {
    "convs_only": lambda: {"recipes": False},
    "no_passthrough": lambda: {"config": conv_patch.PatchConfig(passthrough=False)},
}


def bench_row(name, size, batch, dtype_name, runs, warmup, tiny, device, min_seconds=0.0, max_runs=MAX_RUNS,
              extra=()):
    """One zoo row; ``extra`` names models patched otherwise
    (``EXTRA_VARIANTS``: ``convs_only``, ``recipes=False``, what the recipes
    add or cost; ``no_passthrough``) timed in the same rounds, A against B;
    each adds ``<name>_ms``, ``<name>_speedup``, ``<name>_round_iqr`` and
    ``<name>_rel_err_vs_unpatched``."""
    fields, model, inputs = load_case(name, size, batch, dtype_name, tiny, device)
    patched = copy.deepcopy(model)
    report = conv_patch.apply(patched)
    graphed = copy.deepcopy(model)
    conv_patch.apply(graphed, config=conv_patch.PatchConfig(cuda_graphs=True))
    others = {}
    for v in dict.fromkeys(extra):
        others[v] = copy.deepcopy(model)
        conv_patch.apply(others[v], **EXTRA_VARIANTS[v]())
    state = {"i": 0}

    def call(m):
        def fn():
            args, kw = inputs[state["i"] % len(inputs)]
            m(*args, **kw)
        return fn

    variants = {"unpatched": call(model), "patched": call(patched), "graphed": call(graphed)}
    variants.update({k: call(m) for k, m in others.items()})
    with torch.inference_mode():
        # The first patched call compiles the kernels the model needs; the
        # second captures the blocks cuda_graphs="auto" graphs (and compiles
        # the graph path's kernels where the cache lacks them).
        calls_s = []
        for _ in range(2):
            t0 = time.perf_counter()
            variants["patched"]()
            sync()
            calls_s.append(time.perf_counter() - t0)
        first = calls_s[0]

        def rotating(fn):
            def f():
                fn()
                state["i"] += 1
            return f
        for k in others:
            variants[k]()
        runs = runs_for(min(_timed(variants["unpatched"])[0] for _ in range(2)), runs, min_seconds, max_runs)
        res = interleaved({k: rotating(v) for k, v in variants.items()}, runs, warmup)
        ref = model_output(model, inputs[0])
        err = {k: rel_err(model_output(m, inputs[0]), ref)
               for k, m in (("patched", patched), ("graphed", graphed), *others.items())}
        fp32 = fp32_errors(model, patched, inputs[0])
        args, kw = inputs[0]
        held = tensor_bytes((args, kw))
        peak = {k: peak_gib(lambda m=m: m(*args, **kw), m, held) for k, m in (("unpatched", model),
                                                                             ("patched", patched))}
    base = res["unpatched"]
    row = {
        **fields,
        "baseline": "unpatched, launched eagerly", "baseline_ms": base["ms"], "ours_ms": res["patched"]["ms"],
        "speedup": base["ms"] / res["patched"]["ms"], "graph_ms": res["graphed"]["ms"],
        "graph_speedup": base["ms"] / res["graphed"]["ms"], "host_ms": res["patched"]["host_ms"],
        "baseline_host_ms": base["host_ms"],
        "noise": (max(base["samples"]) - min(base["samples"])) / base["ms"], "runs": runs,
        # The quartiles of the unpatched samples over their median, and of the
        # per-round speedups (the variants of a round run back to back, so a
        # slow stretch of the host hits both sides of each ratio).
        "noise_iqr": [q / base["ms"] for q in _quartiles(base["samples"])],
        "speedup_round_iqr": _round_iqr(base, res["patched"]),
        "first_call_s": first, "second_call_s": calls_s[1], "rel_err_vs_unpatched": err["patched"], "graph_rel_err_vs_unpatched": err["graphed"],
        # Issue 44's error check: against the model in float32 (inputs cast
        # up), the patched model's error at most 1.5x the unpatched one's.
        **fp32,
        # A process holding only that model (common.peak_gib): weights, packs, input, the call's high water.
        "peak_gib": peak["patched"], "baseline_peak_gib": peak["unpatched"],
        "patched_convs": len(report.patched), "fused_blocks": len(report.fused),
        "kernel_convs": _kernel_convs(patched), "routes": route_counts(patched),
        "passed_through": sum(n for _, n in conv_patch.runtime.passthrough.learned(patched)),
    }
    for k in others:
        c = res[k]
        row.update({f"{k}_ms": c["ms"], f"{k}_speedup": base["ms"] / c["ms"], f"{k}_round_iqr": _round_iqr(base, c),
                    f"{k}_rel_err_vs_unpatched": err[k]})
    del model, patched, graphed, others
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def as_float32(obj):
    """A call's inputs with every floating tensor in float32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: as_float32(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(as_float32(v) for v in obj)
    return obj


def fp32_errors(model, patched, inp) -> dict:
    """``rel_err_vs_fp32`` (patched) and ``baseline_rel_err_vs_fp32``
    (unpatched) against a float32 copy of the unpatched model on the same
    inputs cast up, and ``err_ok``: patched <= 1.5 x unpatched + a float32
    floor (1e-5; a float32 model's own error is 0)."""
    ref_model = copy.deepcopy(model).float()
    args, kw = inp
    ref = model_output(ref_model, (as_float32(args), as_float32(kw)))
    del ref_model
    mine, theirs = rel_err(model_output(patched, inp), ref), rel_err(model_output(model, inp), ref)
    return {"rel_err_vs_fp32": mine, "baseline_rel_err_vs_fp32": theirs, "err_ok": mine <= 1.5 * theirs + 1e-5}


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in nested tuples, lists and dicts (a call's inputs)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def output_tensor(y):
    """The tensor a zoo model's call returns: the first of a tuple, a
    diffusers output's ``sample``, a ControlNet's mid-block residual."""
    if isinstance(y, tuple):
        y = y[0]
    if hasattr(y, "sample"):
        y = y.sample
    if hasattr(y, "down_block_res_samples"):
        y = y.mid_block_res_sample
    return y


def model_output(m, inp):
    args, kw = inp
    return output_tensor(m(*args, **kw)).float()


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _kernel_convs(model) -> int:
    """Patched convs whose last call ran a conv-patch kernel."""
    return sum(1 for m in model.modules() if conv_patch.is_patched(m)
               and state_of(m).last is not None and state_of(m).last.is_kernel)


def route_counts(model) -> dict:
    """How many patched convs last ran each route ("lean" for the lean one)."""
    out = {}
    for m in model.modules():
        last = state_of(m).last if conv_patch.is_patched(m) else None
        if last is not None:
            name = "lean" if last.tier == "lean" else last.route.value
            out[name] = out.get(name, 0) + 1
    return out


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("quick", "full", "host", "untuned"), default="quick",
                    help="host: the host-bound rows alone; untuned: the architectures nobody tuned for")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-seconds", type=float, default=None,
                    help=f"more rounds until they span this much of the unpatched model's time "
                         f"(default {MIN_SECONDS}; 0 with --tiny), at most --max-runs")
    ap.add_argument("--max-runs", type=int, default=MAX_RUNS, help=f"at most this many rounds (default {MAX_RUNS})")
    ap.add_argument("--convs-only", action="store_true",
                    help="also time the model patched with recipes=False in the same rounds")
    ap.add_argument("--no-passthrough", action="store_true",
                    help="also time the model patched with PatchConfig(passthrough=False) in the same rounds")
    ap.add_argument("--cudnn-benchmark", action="store_true",
                    help="torch.backends.cudnn.benchmark on for every variant (as many users set it: the "
                         "stronger baseline)")
    case_args(ap, "zoo")
    args = ap.parse_args(argv)
    device = bench_device()
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    cases = selected(TINY if args.tiny else {"full": FULL, "quick": QUICK, "host": HOST, "untuned": UNTUNED}[args.set], args.only)
    min_seconds = args.min_seconds if args.min_seconds is not None else (0.0 if args.tiny else MIN_SECONDS)
    rows = []
    for name, size, batch, dt in cases:
        try:
            row = bench_row(name, size, batch, dt, args.runs, args.warmup, args.tiny, device, min_seconds,
                            args.max_runs, [v for v, on in (("convs_only", args.convs_only),
                                                            ("no_passthrough", args.no_passthrough)) if on])
        except torch.cuda.OutOfMemoryError:
            print(f"{name} {size_name(size)} b{batch}: out of memory, skipped", flush=True)
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        print(f"{row['name']}: unpatched {row['baseline_ms']:.2f} ms, patched {row['ours_ms']:.2f} "
              f"(x{row['speedup']:.2f}), graphs {row['graph_ms']:.2f} (x{row['graph_speedup']:.2f}), "
              f"host {row['host_ms']:.2f}, noise {row['noise']:.2f}"
              + "".join(f", {k} {row[k + '_ms']:.2f} (x{row[k + '_speedup']:.2f})"
                        for k in EXTRA_VARIANTS if k + "_ms" in row), flush=True)
        write_results(args.name, rows, {"geomean_speedup": geomean(r["speedup"] for r in rows)}, args.out)
    extra = {"geomean_speedup": geomean(r["speedup"] for r in rows),
             "geomean_graph_speedup": geomean(r["graph_speedup"] for r in rows),
             "cudnn_benchmark": torch.backends.cudnn.benchmark}
    path = write_results(args.name, rows, extra, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "graph_ms", "graph_speedup", "host_ms", "noise"])
    print(f"geomean x{extra['geomean_speedup']:.3f} (graphs x{extra['geomean_graph_speedup']:.3f})")
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
