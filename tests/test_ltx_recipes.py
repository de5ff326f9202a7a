"""LTX-Video's VAE resnet block (recipes/ltx.py) against the block's own
forward in float64: diffusers' RMSNorm over the channels as one pass of the
RMS-norm kernel (no permuted copies), the causal convs' first-frame padding
read as the Conv3d's cached frames, the shortcut in conv2's epilogue."""

import copy

import pytest
import torch

import conv_patch
from conv_patch.recipes import ltx
from conv_patch.runtime.state import peek, state_of
from conv_patch.target import interpreter_enabled
from _util import TOL, perturbed, refuse_fallback, rel_err

lv = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_ltx")


@pytest.fixture
def no_fallback(monkeypatch):
    refuse_fallback(monkeypatch, ltx)


def _block(cin, cout, seed, **kw):
    torch.manual_seed(seed)
    return perturbed(lv.LTXVideoResnetBlock3d(cin, cout, **kw), seed)


@pytest.mark.parametrize("cin,cout,frames,affine", [(6, 6, 3, False), (4, 10, 1, True), (6, 8, 4, False)])
def test_the_resnet_block_against_its_own_forward(cin, cout, frames, affine, exact_fp32, no_fallback):
    block = _block(cin, cout, cin * 10 + cout, elementwise_affine=affine)
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("ltx.ResnetBlock3d")
    g = torch.Generator().manual_seed(frames)
    x = torch.randn(1, cin, frames, 5, 7, generator=g) + 1.0
    x[0, :, -1, 2, 3] *= 40  # an outlier
    x[0, :, 0, 1, 1] *= 1e-5  # a position whose norm is tiny (where the RMS forms differ)
    with torch.no_grad():
        y = block(x)
        assert rel_err(y, ref(x.double())) <= TOL[torch.float32]
    if interpreter_enabled():
        assert state_of(block.norm1).norm_plan.kernel and state_of(block.conv2.conv).last.is_kernel


def test_conditioned_or_non_causal_blocks(exact_fp32, monkeypatch):
    """Timestep conditioning: the block's own forward; a non-causal block's
    convs: the modules' own padding (both pads), the rest fused."""
    block = _block(4, 4, 3, timestep_conditioning=True)
    ref = copy.deepcopy(block)
    conv_patch.apply(block)
    x, temb = torch.randn(1, 4, 3, 4, 4), torch.randn(1, 16, 1, 1, 1)
    with torch.no_grad():
        assert rel_err(block(x, temb), ref(x, temb)) <= TOL[torch.float32]
    block = _block(4, 4, 4, is_causal=False)
    ref = copy.deepcopy(block).double()
    conv_patch.apply(block)
    monkeypatch.setattr(ltx, "base", lambda *a, **k: pytest.fail("fell back"))
    with torch.no_grad():
        assert rel_err(block(x), ref(x.double())) <= TOL[torch.float32]


def test_a_tiny_ltx_video_vae_fuses_its_resnets_and_decodes_as_before(exact_fp32):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTXVideo(block_out_channels=(8, 8, 8, 8), latent_channels=4,
                                          decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1,) * 5,
                                          decoder_layers_per_block=(1,) * 5).eval()
    ref = copy.deepcopy(vae).double()
    report = conv_patch.apply(vae)
    resnets = [n for n, m in ref.named_modules() if type(m).__name__ == "LTXVideoResnetBlock3d"]
    assert resnets and all(report.fused[n].startswith("ltx.") for n in resnets)
    z = torch.randn(1, 4, 2, 3, 3)
    with torch.no_grad():
        assert rel_err(vae.decode(z).sample, ref.decode(z.double()).sample) <= TOL[torch.float32]
    if interpreter_enabled():
        # Every norm the kernel takes replays a recorded plan at later calls
        # (the first resnet after a time upsample normalises a slice of the
        # clip; the norms have no weight): none takes the op's whole path.
        plans = [p for m in vae.modules() if getattr(peek(m), "plans", None)
                 for p in peek(m).plans.values() if getattr(p, "kernel", False) is True]
        assert len(plans) >= 8 and all(p.program is not None for p in plans)
