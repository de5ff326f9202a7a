"""The original latent-diffusion VAE modules (``Encoder``/``Decoder`` with
``ResnetBlock`` norm1/conv1/norm2/conv2/nin_shortcut, ``Upsample``,
``Downsample`` with its asymmetric pad, ``AttnBlock``): what ComfyUI's
``comfy.ldm.modules.diffusionmodules.model`` implements, here from the
third-party copy in stable-diffusion-sdkit. Patched vs unpatched."""

import pytest
import torch

import conv_patch
from _util import rel_err

ldm = pytest.importorskip("ldm.modules.diffusionmodules.model")


def _pair(device):
    torch.manual_seed(0)
    cfg = dict(ch=32, out_ch=3, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=[8], in_channels=3,
               resolution=16, z_channels=4)
    enc = ldm.Encoder(double_z=True, **cfg).to(device).eval()
    dec = ldm.Decoder(**cfg).to(device).eval()
    return enc, dec


def test_ldm_encoder_decoder_patched_vs_unpatched(device, exact_fp32):
    enc, dec = _pair(device)
    x = torch.randn(1, 3, 16, 16, device=device)
    with torch.no_grad():
        ref_z = enc(x)
        ref = dec(ref_z[:, :4])
        r_enc, r_dec = conv_patch.apply(enc), conv_patch.apply(dec)
        z = enc(x)
        out = dec(z[:, :4])
    assert rel_err(z, ref_z) <= 1e-5 and rel_err(out, ref) <= 1e-5
    # Every conv, the attention's 1x1 q/k/v/proj_out and the resnets'
    # nin_shortcut included, is patched.
    n_convs = lambda m: sum(isinstance(c, torch.nn.Conv2d) for c in m.modules())  # noqa: E731
    assert len(r_enc.patched) == n_convs(enc) and len(r_dec.patched) == n_convs(dec)
    assert any("nin_shortcut" in k for k in r_enc.patched) and any(".attn." in k for k in r_dec.patched)
    assert any("downsample.conv" in k for k in r_enc.patched)


def test_ldm_upsample_convs_are_the_ones_the_tracer_folds():
    from conv_patch.recipes.catalog import upsample_convs
    _, dec = _pair("cpu")
    ups = [m.upsample.conv for m in dec.up if hasattr(m, "upsample")]
    assert ups and upsample_convs(dec) == {id(c) for c in ups}
