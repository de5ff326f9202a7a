"""CogVideoX's VAE resnet block (recipes/cogvideox.py) against the block's
own forward in float64: GroupNorm+SiLU as one pass (the encoder's), the
decoder's spatial norm with its modulation in that pass, the causal convs and
their conv caches as the block calls them (a clip decoded in chunks, an odd
frame count whose first frame the spatial norm resizes on its own)."""

import copy

import pytest
import torch

import conv_patch
from conv_patch.recipes import cogvideox
from conv_patch.runtime.state import state_of
from conv_patch.target import interpreter_enabled
from _util import TOL, perturbed, refuse_fallback, rel_err

cv = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_cogvideox")


@pytest.fixture
def no_fallback(monkeypatch):
    refuse_fallback(monkeypatch, cogvideox)


def _block(cin, cout, seed, **kw):
    torch.manual_seed(seed)
    return perturbed(cv.CogVideoXResnetBlock3D(cin, cout, groups=2, **kw), seed)


def _same(a, b):
    """Two (output, conv cache) results alike: the output, and every cached tensor."""
    assert rel_err(a[0], b[0]) <= TOL[torch.float32]
    assert list(a[1]) == list(b[1])
    for k in a[1]:
        x, y = a[1][k], b[1][k]
        if isinstance(x, dict):
            assert list(x) == list(y) and all(rel_err(x[j], y[j]) <= TOL[torch.float32] for j in x if x[j] is not None)
        elif x is not None:
            assert rel_err(x, y) <= TOL[torch.float32]


@pytest.mark.parametrize("cin,cout,shortcut", [(6, 6, False), (4, 8, False), (4, 6, True)])
def test_the_decoders_block_with_its_spatial_norm_over_chunks(cin, cout, shortcut, exact_fp32, no_fallback):
    block = _block(cin, cout, cin + cout, temb_channels=0, spatial_norm_dim=3, conv_shortcut=shortcut)
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("cogvideox.ResnetBlock3D")
    g = torch.Generator().manual_seed(cout)
    zq = torch.randn(1, 3, 2, 3, 4, generator=g)
    cache = ref_cache = None
    with torch.no_grad():
        for frames in (3, 2):  # an odd first chunk, then one after cached frames
            x = torch.randn(1, cin, frames, 6, 8, generator=g) + 2.0
            x[0, :, 0, 1, 2] *= 30  # an outlier
            got = block(x, None, zq, cache)
            want = ref(x.double(), None, zq.double(), ref_cache)
            _same(got, want)
            cache, ref_cache = got[1], want[1]
    if interpreter_enabled():
        assert all(p.kernel for p in state_of(block.norm2.norm_layer).plans.values())


def test_the_encoders_block_with_a_time_embedding(exact_fp32, no_fallback):
    block = _block(4, 6, 7, temb_channels=5)
    ref = copy.deepcopy(block).double()
    conv_patch.apply(block)
    x, temb = torch.randn(2, 4, 3, 5, 5), torch.randn(2, 5)
    with torch.no_grad():
        _same(block(x, temb), ref(x.double(), temb.double()))


def test_the_block_runs_its_own_forward_where_it_must(exact_fp32):
    block = _block(4, 4, 3, temb_channels=0, spatial_norm_dim=3)
    ref = copy.deepcopy(block)
    conv_patch.apply(block)
    x, zq = torch.randn(1, 4, 2, 4, 4), torch.randn(1, 3, 1, 2, 2)
    calls = []
    block.norm1.register_forward_hook(lambda *a: calls.append(1))  # the norm the recipe would not call
    with torch.no_grad():
        _same(block(x, None, zq), ref(x, None, zq))
    assert calls


def test_a_tiny_cogvideox_vae_fuses_its_resnets_and_codes_as_before(exact_fp32):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLCogVideoX(block_out_channels=(8,) * 4, latent_channels=4, norm_num_groups=4,
                                           layers_per_block=1).eval()
    ref = copy.deepcopy(vae).double()
    report = conv_patch.apply(vae)
    resnets = [n for n, m in ref.named_modules() if type(m).__name__ == "CogVideoXResnetBlock3D"]
    assert resnets and all(report.fused[n].startswith("cogvideox.") for n in resnets)
    z, x = torch.randn(1, 4, 3, 2, 3), torch.randn(1, 3, 5, 16, 16)
    with torch.no_grad():
        assert rel_err(vae.decode(z).sample, ref.decode(z.double()).sample) <= TOL[torch.float32]
        assert rel_err(vae.encode(x).latent_dist.mean, ref.encode(x.double()).latent_dist.mean) <= TOL[torch.float32]
