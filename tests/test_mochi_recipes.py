"""Mochi 1's VAE resnet block (recipes/mochi.py) against the block's own
forward in float64: every frame's GroupNorm and the SiLU as one pass of the
GroupNorm kernels (no chunk outputs, no concatenation), the causal convs and
their conv caches as the block calls them. A tiny Mochi VAE's decode with
its resnets fused: test_conv3d_patch's."""

import copy

import pytest
import torch

import conv_patch
from conv_patch.ops import group_norm as group_norm_op
from conv_patch.recipes import mochi
from conv_patch.target import interpreter_enabled
from _util import TOL, perturbed, refuse_fallback, rel_err

mv = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_mochi")


@pytest.mark.parametrize("channels,frames", [(32, 3), (32, 10)])  # 10 frames: over the module's chunks of 8
def test_the_resnet_block_against_its_own_forward(channels, frames, exact_fp32, monkeypatch):
    torch.manual_seed(channels)
    block = perturbed(mv.MochiResnetBlock3D(channels), channels)
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("mochi.ResnetBlock3D")
    refuse_fallback(monkeypatch, mochi)
    launched = []
    real = group_norm_op.kernels().launch_group_norm
    monkeypatch.setattr(group_norm_op.kernels(), "launch_group_norm",
                        lambda x, *a, **k: (launched.append(tuple(x.shape)), real(x, *a, **k))[1])
    g = torch.Generator().manual_seed(frames)
    x = torch.randn(1, channels, frames, 4, 5, generator=g) + 2.0
    x[0, :, -1, 1, 2] *= 30  # an outlier in the last frame: its own statistics
    cache = ref_cache = None
    with torch.no_grad():
        for _ in range(2):  # a second chunk after cached frames
            (y, cache), (r, ref_cache) = block(x, cache), ref(x.double(), ref_cache)
            assert rel_err(y, r) <= TOL[torch.float32]
            assert all(rel_err(cache[k], ref_cache[k]) <= TOL[torch.float32] for k in cache if cache[k] is not None)
    if interpreter_enabled():
        assert launched and launched[0] == (frames, channels, 4, 5)


def test_the_resnet_block_frees_conv1s_output_before_conv2_runs():
    """The block's own forward rebinds its intermediate before each conv,
    so conv1's output is gone while conv2 runs; the fused block must hold no
    more than that (at Mochi's 480x848 decode one more clip is 2.3 GiB)."""
    import weakref
    torch.manual_seed(0)
    block = mv.MochiResnetBlock3D(32)
    assert conv_patch.apply(block).fused[""].startswith("mochi.ResnetBlock3D")
    seen = {}
    block.conv1.register_forward_hook(lambda m, a, o: seen.__setitem__("conv1_out", weakref.ref(o[0])))
    block.conv2.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("alive_at_conv2", seen["conv1_out"]() is not None))
    with torch.no_grad():
        block(torch.randn(1, 32, 3, 4, 5))
    assert seen["alive_at_conv2"] is False
