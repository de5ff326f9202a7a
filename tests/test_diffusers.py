"""diffusers one-liners: ``apply(pipe)``, and what diffusers does to a VAE
after it is patched (tiling, slicing, ``to()``, ``save_pretrained``,
``from_pretrained(torch_dtype=)`` then apply). Tiny configs; under the
interpreter on the CPU."""

import pytest
import torch

import conv_patch
from _util import rel_err

diffusers = pytest.importorskip("diffusers")


def _vae(device, seed=0):
    torch.manual_seed(seed)
    return diffusers.AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
        norm_num_groups=4, sample_size=16).to(device).eval()


def test_apply_pipe_patches_every_module_component(device, exact_fp32):
    vae = _vae(device)
    unet = diffusers.UNet2DModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(8, 16), norm_num_groups=4,
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D")).to(device).eval()
    pipe = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler())
    z = torch.randn(1, 4, 8, 8, device=device)
    with torch.no_grad():
        ref = unet(z, 3).sample
        report = conv_patch.apply(pipe)
        assert report.patched and all(k.startswith("unet.") for k in report.patched)
        assert rel_err(unet(z, 3).sample, ref) <= 1e-5
        assert conv_patch.apply(pipe).patched == {}  # idempotent
    restored = conv_patch.remove(pipe)
    assert set(restored) == set(report.patched) | set(report.fused)
    assert not any(conv_patch.is_patched(m) for m in unet.modules())
    # Any object whose `components` dict holds modules is a pipeline here.
    fake = type("Pipe", (), {"components": {"vae": vae, "tokenizer": "not a module"}})()
    assert all(k.startswith("vae.") for k in conv_patch.apply(fake).patched)
    conv_patch.remove(fake)
    with pytest.raises(TypeError, match="nn.Module"):
        conv_patch.apply(object())


def test_tiling_slicing_and_to_after_apply(device, exact_fp32):
    vae = _vae(device)
    z = torch.randn(2, 4, 12, 12, device=device)
    with torch.no_grad():
        vae.enable_tiling()  # sample_size 16: a 12x12 latent is decoded in 4 tiles
        vae.enable_slicing()  # and the batch one sample at a time
        ref = vae.decode(z).sample
        conv_patch.apply(vae)
        out = vae.decode(z).sample
        assert rel_err(out, ref) <= 1e-5
        vae.disable_tiling()
        vae.to(torch.float64).to(torch.float32)
        z = torch.randn(1, 4, 3, 3, device=device)
        assert rel_err(vae.decode(z).sample, conv_patch.remove(vae) and vae.decode(z).sample) <= 1e-5


def test_save_pretrained_after_apply_matches_unpatched(tmp_path, device):
    from safetensors.torch import load_file
    plain, patched = _vae(device, seed=1), _vae(device, seed=1)
    conv_patch.apply(patched)
    plain.save_pretrained(tmp_path / "plain")
    patched.save_pretrained(tmp_path / "patched")
    a = load_file(str(tmp_path / "plain" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(tmp_path / "patched" / "diffusion_pytorch_model.safetensors"))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "plain" / "config.json").read_text() == (tmp_path / "patched" / "config.json").read_text()
    # from_pretrained with a dtype, then apply: the usual script.
    vae = diffusers.AutoencoderKL.from_pretrained(tmp_path / "patched", torch_dtype=torch.bfloat16).to(device)
    report = conv_patch.apply(vae)
    assert report.patched and all(m.weight.dtype is torch.bfloat16 for m in vae.modules()
                                  if conv_patch.is_patched(m))


def test_without_kernels_a_patched_model_computes_exactly_what_unpatched_does(monkeypatch):
    """A CPU machine without the interpreter (a user's laptop): no kernel
    runs, and the patched models compute bit for bit what the unpatched
    ones do (the recipes' own layout would change the CPU's rounding, so
    fused blocks run their own forward there); the report says so."""
    import copy

    from conv_patch import target
    from conv_patch.tools import taesd
    monkeypatch.setattr(target, "interpreter_enabled", lambda: False)
    torch.manual_seed(0)
    tiny = diffusers.AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                                     latent_channels=4).eval()
    cases = [(tiny, lambda m, z: m.decode(z).sample, (1, 4, 6, 5)), (_vae("cpu"), lambda m, z: m.decode(z).sample,
             (1, 4, 5, 6)), (taesd.seeded_(taesd.decoder()).eval(), lambda m, z: m(z), (1, 32, 4, 3))]
    for model, run, shape in cases:
        plain = copy.deepcopy(model)
        report = conv_patch.apply(model)
        assert report.fused and "no CUDA GPU" in report.here and "no CUDA GPU" in str(report)
        assert all(v.startswith("pytorch here (") for v in report.patched.values())
        z = torch.randn(shape)
        with torch.no_grad():
            for _ in range(3):  # the first call, the watched one, and one passing idle parts through
                assert torch.equal(run(model, z), run(plain, z))
