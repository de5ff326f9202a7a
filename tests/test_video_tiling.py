"""A video VAE's tiled decode (``enable_tiling()``) after ``apply``: the
tiles run through the patched convs and fused blocks and the decode equals
the unpatched tiled one. LTX-Video's tiny config (the cheapest family under
the interpreter). HunyuanVideo's, CogVideoX's and Mochi's tiled decodes
run their decoders per tile the same way; too slow to test here."""

import copy

import pytest
import torch

import conv_patch
from conv_patch.runtime.state import state_of
from conv_patch.target import interpreter_enabled
from _util import TOL, rel_err

pytest.importorskip("diffusers")


def test_a_tiled_ltx_video_decode_runs_patched_and_decodes_as_before(exact_fp32, monkeypatch):
    from bench.video import latents, new_vae
    torch.manual_seed(0)
    vae = new_vae("ltx-video", True).eval()
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                      tile_sample_stride_width=32)
    # A 3x2 latent: tiles overlapping along both axes (rows and columns
    # blended), six of them; each tile's convs are a kernel launch apiece.
    z = latents(vae, 9, 96, 64, torch.device("cpu"), torch.float32)
    tiles = []
    tiled_decode = type(vae).tiled_decode

    def counted(self, *a, **k):
        tiles.append(1)
        return tiled_decode(self, *a, **k)
    with torch.no_grad():
        ref = vae.decode(z).sample
        patched = copy.deepcopy(vae)
        report = conv_patch.apply(patched)
        monkeypatch.setattr(type(vae), "tiled_decode", counted)
        out = patched.decode(z).sample
    assert rel_err(out, ref) <= TOL[torch.float32]
    assert tiles  # the tiled path ran
    convs = [m for m in vae.modules() if isinstance(m, torch.nn.Conv3d)]
    assert len(report.patched) >= 0.9 * len(convs) and not report.skipped and report.fused
    if interpreter_enabled():
        ran = [m for m in patched.modules() if getattr(state_of(m), "last", None) is not None]
        assert sum(state_of(m).last.is_kernel for m in ran) >= 10
