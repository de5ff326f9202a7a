"""Sana's DC-AE (recipes/dcae.py) against its own forward in float64:
diffusers' ``AutoencoderDC`` decoder with both upsampling forms, its
ResBlocks and up blocks fused (their own forward made to fail), and the
blocks the recipes leave alone."""

import copy

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.recipes import dcae
from _util import TOL, perturbed, refuse_fallback, rel_err

diffusers = pytest.importorskip("diffusers")

TYPES = ("ResBlock", "ResBlock", "EfficientViTBlock")


def _model(upsample="interpolate", act="silu", norm="rms_norm"):
    m = diffusers.AutoencoderDC(latent_channels=8, attention_head_dim=4, encoder_block_types=TYPES,
                                decoder_block_types=TYPES, encoder_block_out_channels=(8, 16, 32),
                                decoder_block_out_channels=(8, 16, 32), encoder_layers_per_block=(1, 1, 1),
                                decoder_layers_per_block=(1, 2, 1), encoder_qkv_multiscales=((), (), (5,)),
                                decoder_qkv_multiscales=((), (), (5,)), upsample_block_type=upsample,
                                downsample_block_type="Conv", decoder_act_fns=act, decoder_norm_types=norm)
    return perturbed(m, 3, 0.05)


def _latent(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 8, 5, 3, generator=g) + 2.0  # a large mean
    z[0, 3, 2, 1] = 25.0  # and an outlier
    return z


@pytest.mark.parametrize("upsample", ["interpolate", "pixel_shuffle"])
@pytest.mark.parametrize("act", ["silu", "relu"])
def test_the_decoder_against_its_own_forward(upsample, act, device, exact_fp32, monkeypatch):
    model = _model(upsample, act)
    ref = copy.deepcopy(model).double()
    report = conv_patch.apply(model)
    fused = {k: v.split()[0] for k, v in report.fused.items() if k.startswith("decoder")}
    assert fused == {"decoder": "dcae.Decoder", "decoder.up_blocks.0.0": "dcae.DCUpBlock2d",
                     "decoder.up_blocks.0.1": "dcae.ResBlock", "decoder.up_blocks.1.0": "dcae.DCUpBlock2d",
                     "decoder.up_blocks.1.1": "dcae.ResBlock", "decoder.up_blocks.1.2": "dcae.ResBlock",
                     "decoder.up_blocks.2.0.attn.to_qkv_multiscale.0": "dcae.SanaMultiscaleAttentionProjection"}, fused
    z = _latent()
    expected = ref.decode(z.double()).sample
    tol = TOL[torch.float32]
    if device.type != "cpu":  # bf16, DC-AE's dtype, where the kernels run
        model, z, tol = model.to(device, torch.bfloat16), z.to(device, torch.bfloat16), TOL[torch.bfloat16] * 3
    refuse_fallback(monkeypatch, dcae)
    rms = []
    real = diffusers.models.normalization.RMSNorm.forward
    monkeypatch.setattr(diffusers.models.normalization.RMSNorm, "forward",
                        lambda *a, **k: (rms.append(1), real(*a, **k))[1])
    with torch.no_grad():
        y = model.decode(z).sample
    # Every RMS norm of the decoder but the EfficientViT blocks' ran as the kernel's pass.
    evit = [n for b in model.decoder.modules() if type(b).__name__ == "EfficientViTBlock"
            for n in b.modules() if type(n).__name__ == "RMSNorm"]
    assert len(rms) == len(evit)
    assert y.is_contiguous() and rel_err(y, expected) <= tol


def test_the_encoder_resblocks_and_an_nhwc_input(exact_fp32):
    model = _model()
    ref = copy.deepcopy(model).double()
    conv_patch.apply(model)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 3, 20, 12, generator=g).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        y = model(x).sample
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(y, ref(x.double()).sample) <= TOL[torch.float32]


def test_the_multiscale_projection_runs_its_convs_as_one_launch_each(device, exact_fp32, monkeypatch):
    """The linear attention's multiscale branch: its own forward's answer,
    the depthwise proj_in and grouped 1x1 proj_out in the kernels on an NHWC
    input (never the modules' calls), the modules' own calls on an NCHW one
    and on a hooked proj_in."""
    from conv_patch.ops import grouped_conv
    from conv_patch.target import target_for
    proj = next(m for m in _model().modules() if type(m).__name__ == "SanaMultiscaleAttentionProjection")
    proj = copy.deepcopy(proj).to(device)
    ref = copy.deepcopy(proj)
    assert dcae.MULTISCALE_PROJECTION.match(proj)
    conv_patch.apply(proj)
    calls = []
    real = torch.nn.Conv2d.forward
    monkeypatch.setattr(torch.nn.Conv2d, "forward",
                        lambda m, x: (calls.append(m.kernel_size), real(m, x))[1])
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, proj.proj_in.in_channels, 7, 5, generator=g) + 2.0).to(device)
    with torch.no_grad():
        want = ref(x)
        calls.clear()
        y = proj(x.contiguous(memory_format=torch.channels_last))
        kernel = target_for(x.device).kernels
        assert calls == ([] if kernel else [(5, 5), (1, 1)]) and rel_err(y, want) <= TOL[torch.float32]
        calls.clear()
        assert rel_err(proj(x), want) <= TOL[torch.float32] and calls == [(5, 5), (1, 1)]
        calls.clear()
        seen = []
        proj.proj_in.register_forward_hook(lambda m, a, y: seen.append(y.shape))
        y = proj(x.contiguous(memory_format=torch.channels_last))
        assert seen and calls == ([(5, 5)] if kernel else [(5, 5), (1, 1)]) and rel_err(y, want) <= TOL[torch.float32]
    assert grouped_conv.problem(proj.proj_out, x) is not None


def test_what_the_recipes_leave_alone():
    """A batch-norm ResBlock (its norm is not an RMS norm over channels),
    a bilinear up block, a ResBlock-named block of another library."""
    bn = _model(norm="batch_norm")
    assert not any(dcae.RESBLOCK.match(m) for m in bn.decoder.modules())
    up = next(m for m in _model().modules() if type(m).__name__ == "DCUpBlock2d")
    up.interpolation_mode = "bilinear"
    assert not dcae.UP_BLOCK.match(up)

    class ResBlock(nn.Module):  # same parts, another forward
        def __init__(self):
            super().__init__()
            src = next(m for m in _model().modules() if type(m).__name__ == "ResBlock")
            self.__dict__.update({k: v for k, v in src.__dict__.items() if k != "forward"})

        def forward(self, x):
            return self.conv2(self.conv1(x)) + x
    assert not dcae.RESBLOCK.match(ResBlock())


def test_training_runs_the_blocks_own_forward():
    model = _model()
    conv_patch.apply(model)
    y = model.decode(_latent(1)).sample
    y.square().mean().backward()
    assert model.decoder.up_blocks[1][1].conv1.weight.grad is not None
