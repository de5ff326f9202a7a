"""Patched vs unpatched on real model code: diffusers AutoencoderKL and
AutoencoderTiny in small configs, and the real trained TAEF2 weights from
../shared/models on a real photo."""

import math
import os
from pathlib import Path

import pytest
import torch

import conv_patch
from conv_patch.tools import taesd
from conv_patch.runtime.state import state_of
from _util import TOL, rel_err

# ../shared beside the checkout; CONV_PATCH_SHARED points elsewhere (a copy
# carried to a GPU machine).
SHARED = Path(os.environ.get("CONV_PATCH_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")


def _dense_convs(model):
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)}


def _check_patched(model, run, device, tol):
    keys = list(model.state_dict())
    with torch.no_grad():
        ref = run()
        report = conv_patch.apply(model)
        out = run()
    assert list(model.state_dict()) == keys
    assert set(report.patched) == _dense_convs(model)
    kernel_runs = [m for m in model.modules() if conv_patch.is_patched(m) and state_of(m).last is not None]
    assert kernel_runs and all(state_of(m).last.is_kernel for m in kernel_runs)
    assert rel_err(out, ref) <= tol
    originals = {n: state_of(m).original for n, m in model.named_modules() if conv_patch.is_patched(m)}
    conv_patch.remove(model)
    assert all(model.get_submodule(n) is o for n, o in originals.items())
    return report


def test_diffusers_autoencoder_kl(device, exact_fp32):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
        norm_num_groups=32, sample_size=32).to(device).eval()
    x = torch.randn(1, 3, 32, 32, device=device)
    report = _check_patched(vae, lambda: vae.decode(vae.encode(x).latent_dist.mode()).sample,
                            device, TOL[torch.float32])
    assert "decoder.conv_in" in report.patched and "encoder.down_blocks.0.downsamplers.0.conv" in report.patched
    # Grad enabled: every conv falls back and says why.
    conv_patch.apply(vae)
    vae.decoder.conv_in(torch.randn(1, 4, 8, 8, device=device))
    assert "autograd" in state_of(vae.decoder.conv_in).last.reason


def test_diffusers_autoencoder_tiny(device, exact_fp32):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderTiny(
        encoder_block_out_channels=(16, 16, 16, 16), decoder_block_out_channels=(16, 16, 16, 16),
        num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1), latent_channels=4).to(device).eval()
    z = torch.randn(1, 4, 4, 4, device=device)
    _check_patched(vae, lambda: vae.decode(z).sample, device, TOL[torch.float32])


def _astronaut(device, size):
    np = pytest.importorskip("numpy")
    from PIL import Image
    img = Image.open(SHARED / "images" / "astronaut.png").convert("RGB")
    t = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)[None].float() / 255
    top = (t.shape[-1] - size) // 2
    return t[:, :, top:top + size, top:top + size].contiguous().to(device)


def _psnr(a, b):
    return -10 * math.log10(((a - b) ** 2).mean().item())


@pytest.mark.skipif(not (SHARED / "models" / "taef2_decoder.safetensors").exists(),
                    reason="../shared/models not present")
def test_taef2_real_weights_on_real_photo(device, exact_fp32):
    from safetensors.torch import load_file
    enc, dec = taesd.encoder(), taesd.decoder()
    enc.load_state_dict(load_file(SHARED / "models" / "taef2_encoder.safetensors"))
    dec.load_state_dict(load_file(SHARED / "models" / "taef2_decoder.safetensors"))
    enc, dec = enc.float().to(device).eval(), dec.float().to(device).eval()
    img = _astronaut(device, 64 if device.type == "cpu" else 512)
    with torch.no_grad():
        lat = enc(img)
        rec = dec(lat).clamp(0, 1)
        conv_patch.apply(enc)
        conv_patch.apply(dec)
        lat_p = enc(img)
        rec_p = dec(lat_p).clamp(0, 1)
    # (The upsample convs run as four 2x2 kernels through ops, not their module.)
    ran = [state_of(m).last for m in dec.modules() if conv_patch.is_patched(m) and state_of(m).last is not None]
    assert ran and all(d.is_kernel for d in ran)
    assert rel_err(lat_p, lat) <= TOL[torch.float32]
    assert rel_err(rec_p, rec) <= TOL[torch.float32]
    assert abs(_psnr(rec_p, img) - _psnr(rec, img)) < 0.01
    assert _psnr(rec, img) > 20  # a real reconstruction, not noise
