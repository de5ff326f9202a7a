"""HunyuanVideo's VAE resnet block (recipes/hunyuan.py) against the block's
own forward in float64: GroupNorm+SiLU through the GroupNorm kernels on the
5-D input's 4-D view, the replicate-padded causal convs on the Conv3d
kernel (the interpreter on the CPU), the shortcut in conv2's epilogue."""

import copy

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.recipes import hunyuan
from conv_patch.runtime.state import state_of
from _util import TOL, perturbed, refuse_fallback, rel_err

hv = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_hunyuan_video")


@pytest.fixture
def no_fallback(monkeypatch):
    refuse_fallback(monkeypatch, hunyuan)


def _block(cin, cout, seed):
    torch.manual_seed(seed)
    return perturbed(hv.HunyuanVideoResnetBlockCausal3D(cin, cout, groups=2), seed)


@pytest.mark.parametrize("cin,cout,frames", [(6, 6, 3), (4, 10, 1), (6, 8, 4)])
def test_the_resnet_block_against_its_own_forward(cin, cout, frames, exact_fp32, no_fallback):
    block = _block(cin, cout, cin * 10 + cout)
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("hunyuan.ResnetBlockCausal3D")
    g = torch.Generator().manual_seed(frames)
    x = torch.randn(1, cin, frames, 5, 7, generator=g) + 3.0
    x[0, :, -1, 2, 3] *= 40  # an outlier
    with torch.no_grad():
        y = block(x)
        assert rel_err(y, ref(x.double())) <= TOL[torch.float32]
    if conv_patch.target.interpreter_enabled():
        assert state_of(block.conv2.conv).last.is_kernel
        assert all(p.kernel for p in state_of(block.norm1).plans.values())


def test_the_block_runs_its_own_forward_where_it_must(exact_fp32):
    block = _block(4, 4, 1)
    ref = copy.deepcopy(block)
    conv_patch.apply(block)
    x = torch.randn(1, 4, 2, 3, 4)
    calls = []
    block.conv1.register_forward_hook(lambda *a: calls.append(1))  # a hook on a conv the block calls around
    with torch.no_grad():
        assert rel_err(block(x), ref(x)) <= TOL[torch.float32] and calls
    block = _block(4, 4, 2)
    ref = copy.deepcopy(block)
    conv_patch.apply(block)
    x = torch.randn(1, 4, 2, 3, 4, requires_grad=True)  # autograd: the fused steps have no backward
    y = block(x)
    y.sum().backward()
    assert rel_err(y, ref(x)) <= TOL[torch.float32] and x.grad is not None


def test_a_tiny_hunyuan_video_vae_fuses_its_resnets_and_decodes_as_before(exact_fp32):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8, 8), latent_channels=4,
                                              layers_per_block=1, norm_num_groups=4).eval()
    ref = copy.deepcopy(vae).double()
    report = conv_patch.apply(vae)
    resnets = [n for n, m in ref.named_modules() if type(m).__name__ == "HunyuanVideoResnetBlockCausal3D"]
    assert resnets and all(report.fused[n].startswith("hunyuan.") for n in resnets)
    n3d = sum(isinstance(m, nn.Conv3d) for m in ref.modules())
    assert sum(isinstance(m, nn.Conv3d) and n in report.patched for n, m in vae.named_modules()) == n3d
    z = torch.randn(1, 4, 2, 3, 3)
    with torch.no_grad():
        assert rel_err(vae.decode(z).sample, ref.decode(z.double()).sample) <= TOL[torch.float32]
