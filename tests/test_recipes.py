"""VAE block recipes (conv_patch.recipes): each fused block against the
unpatched block, the folded upsample/pad ops against float64 references, the
fallbacks (training, grad, hooks, odd arguments), layouts at the boundary,
and remove/pickle/state_dict. Tiny awkward shapes; under the interpreter on
the CPU in CI."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conv_patch
from _util import poisoned, rel_err
from conv_patch.runtime import dispatch, passthrough
from conv_patch import functional
from conv_patch.tools import taesd
from conv_patch.recipes import catalog as recipes
from conv_patch.recipes import fuse
from conv_patch.recipes import diffusers as rdiff

diffusers = pytest.importorskip("diffusers")
from diffusers.models.downsampling import Downsample2D  # noqa: E402
from diffusers.models.resnet import ResnetBlock2D  # noqa: E402
from diffusers.models.upsampling import Upsample2D  # noqa: E402


def _seeded(m, seed=0):
    # Non-trivial norms and biases too (the defaults are 1 and 0).
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0))
    return m


@pytest.mark.parametrize("channels_last", [False, True])
def test_folded_pad_and_upsample_ops_match_float64(device, exact_fp32, channels_last):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, 7, 9, generator=g)
    w = torch.randn(10, 12, 3, 3, generator=g)
    b = torch.randn(10, generator=g)
    res = torch.randn(2, 10, 14, 18, generator=g)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    xd = x.to(device).contiguous(memory_format=fmt)
    # Downsample2D's F.pad (0, 1, 0, 1) + stride-2 conv, pad folded into the bounds.
    out = poisoned((2, 10, 3, 4), torch.float32, device, channels_last)
    functional.conv2d(xd, w.to(device), b.to(device), stride=2, padding=(0, 1, 0, 1), out=out)
    ref = F.conv2d(F.pad(x.double(), (0, 1, 0, 1)), w.double(), b.double(), stride=2)
    assert rel_err(out, ref) <= 1e-5
    # Asymmetric on both sides, stride 1.
    got = functional.conv2d(xd, w.to(device), None, padding=(2, 0, 1, 3))
    ref = F.conv2d(F.pad(x.double(), (2, 0, 1, 3)), w.double())
    assert rel_err(got, ref) <= 1e-5
    # Nearest x2 + 3x3 conv as four 2x2 convs, with the residual epilogue.
    out = poisoned((2, 10, 14, 18), torch.float32, device, channels_last)
    functional.upsample_conv2d(xd, w.to(device), b.to(device), residual=res.to(device), activation="silu", out=out)
    ref = F.silu(F.conv2d(F.interpolate(x.double(), scale_factor=2.0), w.double(), b.double(), padding=1)
                 + res.double())
    assert rel_err(out, ref) <= 1e-5
    got = functional.upsample_conv2d(xd, w.to(device))
    assert got.is_contiguous(memory_format=fmt)
    with pytest.raises(ValueError, match="3x3"):
        functional.upsample_conv2d(xd, w[:, :, :2, :2].to(device))
    with pytest.raises(ValueError, match="negative"):
        functional.conv2d(xd, w.to(device), padding=(0, -1, 0, 1))


@pytest.mark.parametrize("band_rows", [1, 3, None], ids=["1row", "3rows", "whole"])
def test_group_norm_conv_in_bands_matches_float64(device, exact_fp32, band_rows):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 12, 11, 7, generator=g) * 2 + 0.5).to(device).contiguous(memory_format=torch.channels_last)
    gw, gb = torch.randn(12, generator=g) * 0.5 + 1, torch.randn(12, generator=g) * 0.5
    w, b = torch.randn(10, 12, 3, 3, generator=g), torch.randn(10, generator=g)
    # band_bytes counts the halo rows: rows + 2 of them per band.
    band = 1 << 30 if band_rows is None else (band_rows + 2) * 7 * 12 * 4
    y = functional.group_norm_conv2d(x, 3, gw.to(device), gb.to(device), 1e-6, "silu", w.to(device), b.to(device),
                              band_bytes=band)
    ref = F.conv2d(F.silu(F.group_norm(x.double().cpu(), 3, gw.double(), gb.double(), 1e-6)), w.double(),
                   b.double(), padding=1)
    assert rel_err(y, ref) <= 1e-5 and y.is_contiguous(memory_format=torch.channels_last)
    # NCHW: not banded (a row band of NCHW is not dense), same answer.
    y = functional.group_norm_conv2d(x.contiguous(), 3, gw.to(device), gb.to(device), 1e-6, "silu", w.to(device),
                              b.to(device), band_bytes=band)
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("route", ["igemm", "cudnn"])
def test_group_norm_conv_bands_run_the_whole_convs_route(device, exact_fp32, monkeypatch, route):
    """Each band runs the config the table gives the unbanded conv (a
    band's own shape has no exact entry and would take a bucket), bands
    are of equal height, and the answer is the unbanded one; also where
    that route is cuDNN's (F.conv2d, here on the CPU too, then the epilogue
    into the band's rows of the output)."""
    from conv_patch.routing import tables as config_tables
    from conv_patch.specs import ConvSpec
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(1, 12, 11, 7, generator=g) + 0.5).to(device).contiguous(memory_format=torch.channels_last)
    gw, gb = torch.randn(12, generator=g) * 0.5 + 1, torch.randn(12, generator=g) * 0.5
    w, b = torch.randn(10, 12, 3, 3, generator=g), torch.randn(10, generator=g)
    spec = ConvSpec(False, 12, 10, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (0, 0), 1, "zeros", True)
    whole = {"route": "igemm", "BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    if route == "cudnn":
        # The router offers cuDNN to CUDA calls only; the bands' side of it
        # runs anywhere.
        whole = {"route": "cudnn"}
        monkeypatch.setattr(functional, "_band_config", lambda *a: dict(whole))
    table = config_tables.load_user_table({"schema": 1, "arch": "test", "conv2d": {
        "exact": {config_tables.shape_key(spec, tuple(x.shape), "nhwc", torch.float32): whole},
        "any": {"route": "igemm", "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}}})
    seen = []
    orig = functional.conv2d
    monkeypatch.setattr(functional, "conv2d", lambda src, *a, **k: seen.append((src.shape[2], k.get("config")))
                        or orig(src, *a, **k))
    # At most 5 rows a band: 11 rows make bands of 4, 4 and 3 rows (plus
    # their 2 halo rows each), not 5, 5 and a 1-row tail.
    y = functional.group_norm_conv2d(x, 3, gw.to(device), gb.to(device), 1e-6, "silu", w.to(device), b.to(device),
                              band_bytes=(5 + 2) * 7 * 12 * 4, table=table)
    assert [rows for rows, _ in seen] == [6, 6, 5] and all(cfg == whole for _, cfg in seen)
    ref = F.conv2d(F.silu(F.group_norm(x.double().cpu(), 3, gw.double(), gb.double(), 1e-6)), w.double(),
                   b.double(), padding=1)
    assert rel_err(y, ref) <= 1e-5


def test_in_place_group_norm_and_conv_into_its_residual(device, exact_fp32):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 6, 5, 7, generator=g).to(device)
    ref = F.silu(F.group_norm(x.double(), 3, None, None, 1e-5))
    y = x.clone()
    assert functional.group_norm(y, 3, activation="silu", out=y) is y and rel_err(y, ref) <= 1e-5
    with pytest.raises(ValueError, match="out must match"):
        functional.group_norm(x, 3, out=y.contiguous(memory_format=torch.channels_last)[:, :, :, :6])
    # A patched conv writing over its own residual (the epilogue reads each
    # residual element before writing that element).
    m = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1)).to(device)
    conv_patch.apply(m)
    res = torch.randn(2, 6, 5, 7, generator=g).to(device)
    with torch.no_grad():
        want = F.conv2d(x.double(), m[0].weight.double(), m[0].bias.double(), padding=1) + res.double()
        r = res.clone()
        assert m[0](x, residual=r, out=r) is r
    assert rel_err(r, want) <= 1e-5


def test_subpixel_weights_fold_the_taps_exactly():
    w = torch.randn(3, 5, 3, 3, dtype=torch.float64)
    x = torch.randn(1, 5, 4, 6, dtype=torch.float64)
    subs = functional.subpixel_weights(w)
    ref = F.conv2d(F.interpolate(x, scale_factor=2.0), w, padding=1)
    for a in (0, 1):
        for b in (0, 1):
            part = F.conv2d(F.pad(x, (1 - b, b, 1 - a, a)), subs[a, b].permute(0, 3, 1, 2))
            assert torch.allclose(part, ref[:, :, a::2, b::2], rtol=1e-12, atol=1e-12)


def _resnet(cin, cout, osf=1.0, groups=2):
    return _seeded(ResnetBlock2D(in_channels=cin, out_channels=cout, temb_channels=None, groups=groups,
                                 eps=1e-6, output_scale_factor=osf)).eval()


@pytest.mark.parametrize("cin,cout,osf,cl", [(6, 10, 1.0, False), (10, 10, 2.0, True), (12, 6, 1.0, True)])
def test_diffusers_resnet_block_fused_matches_unpatched(device, exact_fp32, cin, cout, osf, cl, no_fallback):
    block = _resnet(cin, cout, osf).to(device)
    x = torch.randn(2, cin, 7, 5, device=device) * 2 + 0.5
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = block(x, None)
        report = conv_patch.apply(block)
        assert report.fused[""].startswith("diffusers.ResnetBlock2D")
        assert type(block).__name__ == "FusedResnetBlock2D" and isinstance(block, ResnetBlock2D)
        out = block(x, None)
    assert rel_err(out, ref) <= 1e-5
    assert out.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


@pytest.mark.parametrize("cin,cout,skip_act", [(6, 10, False), (8, 8, True)])
def test_unet_resnet_block_adds_its_time_embedding_in_conv1s_epilogue(device, exact_fp32, cin, cout, skip_act,
                                                                      no_fallback, monkeypatch):
    """A UNet's ResnetBlock2D (a temb): its projection is added to conv1's
    output through the epilogue, as a [B, C, 1, 1] residual broadcast over
    the image (read with zero strides, never expanded in memory)."""
    block = _seeded(ResnetBlock2D(in_channels=cin, out_channels=cout, temb_channels=12, groups=2, eps=1e-6,
                                  skip_time_act=skip_act)).eval().to(device)
    x = torch.randn(2, cin, 7, 5, device=device) * 2 + 0.5
    temb = torch.randn(2, 12, device=device) * 3
    seen = []
    real = dispatch.conv

    def spy(m, call):
        if m is block.conv1:
            seen.append(None if call.residual is None else call.residual.stride())
        return real(m, call)

    # As on the graph path (launched on a GPU the block runs its own forward:
    # the next test).
    monkeypatch.setattr(rdiff, "launched_on_gpu", lambda x: False)
    with torch.no_grad():
        ref = block(x, temb)
        conv_patch.apply(block)
        monkeypatch.setattr(dispatch, "conv", spy)
        out = block(x, temb)
    assert seen and seen[0][2:] == (0, 0)
    assert rel_err(out, ref) <= 1e-5
    # A temb of another dtype: the block's own forward (no_fallback says so).
    with torch.no_grad(), pytest.raises(AssertionError, match="fell back"):
        block(x, temb.double())


def test_unet_resnet_block_launched_on_a_gpu_runs_its_own_forward(device, exact_fp32, monkeypatch):
    """Launched eagerly on a GPU a UNet's block (a temb) is host-bound: its
    own forward runs, with its GroupNorms as their own class (no GroupNorm
    kernel, no recipe step), the convs still patched; a VAE's block (no
    temb) and a call on the graph path run the recipe."""
    block = _seeded(ResnetBlock2D(in_channels=6, out_channels=10, temb_channels=12, groups=2, eps=1e-6)).eval()
    block = block.to(device)
    x = torch.randn(2, 6, 7, 5, device=device) * 2 + 0.5
    temb = torch.randn(2, 12, device=device) * 3
    with torch.no_grad():
        ref = block(x, temb)
        conv_patch.apply(block, config=conv_patch.PatchConfig(passthrough=False))
    monkeypatch.setattr(rdiff, "launched_on_gpu", lambda x: True)
    steps, norms, convs = [], [], []
    real_resnet, real_gn, real_conv = fuse.resnet, dispatch.group_norm, dispatch.conv
    monkeypatch.setattr(rdiff, "resnet", lambda *a, **k: steps.append(1) or real_resnet(*a, **k))
    monkeypatch.setattr(dispatch, "group_norm", lambda *a, **k: norms.append(1) or real_gn(*a, **k))
    monkeypatch.setattr(dispatch, "conv", lambda m, c: convs.append(m) or real_conv(m, c))
    recipe = type(block).cp_recipe
    with torch.no_grad():
        out = block(x, temb)
        assert not steps and not norms and convs  # its own forward, its convs patched
        assert fuse.is_fused(block.norm1) and fuse.is_fused(block.norm2)  # their classes given back
        assert rel_err(out, ref) <= 1e-5
        swaps = recipe.unfused(block, (x, temb), {})
        assert {id(c) for c, _, _ in swaps} == {id(block.norm1), id(block.norm2)}
        assert recipe.unfused(block, (x, temb), {}) is swaps  # kept while its children are
        assert recipe.unfused(block, (x, None), {}) is None  # a VAE's block: the recipe
        monkeypatch.setattr(rdiff, "launched_on_gpu", lambda x: False)
        assert recipe.unfused(block, (x, temb), {}) is None  # the graph path
        steps.clear()
        assert rel_err(block(x, temb), ref) <= 1e-5 and steps


@pytest.mark.parametrize("cin,cout,osf,skip_act,temb_ch,cl", [(6, 10, 1.0, False, 12, False), (8, 8, 2.0, True, 12, True),
                                                            (6, 14, 1.0, False, None, False)])
def test_lean_resnet_block_computes_its_own_forward_bit_for_bit(device, cin, cout, osf, skip_act, temb_ch, cl,
                                                                 monkeypatch):
    """The class a passed-through resnet block runs as (``LeanResnet`` in
    front of its own): the block's values bit for bit, without its own
    forward; with a gradient recorded, a hook, a training block or an odd
    argument, its own forward."""
    block = _seeded(ResnetBlock2D(in_channels=cin, out_channels=cout, temb_channels=temb_ch, groups=2, eps=1e-6,
                                  output_scale_factor=osf, skip_time_act=skip_act)).eval().to(device)
    x = torch.randn(2, cin, 7, 5, device=device) * 2 + 0.5
    if cl:
        x = x.to(memory_format=torch.channels_last)
        # As on a GPU, whose GroupNorm hands a channels_last input back
        # contiguous: the sums' operands then differ in layout.
        gn = F.group_norm
        monkeypatch.setattr(F, "group_norm", lambda *a, **k: gn(*a, **k).contiguous())
    temb = torch.randn(2, 12, device=device) * 3 if temb_ch else None
    with torch.no_grad():
        ref = block(x, temb)
    conv_patch.apply(block)
    lean = type(block).cp_own_class(block)
    assert lean is fuse.lean_class(ResnetBlock2D, rdiff.LeanResnet) and issubclass(lean, ResnetBlock2D)
    assert lean.__name__ == "ResnetBlock2D"
    # As the passthrough runs an idle block: it and everything under it as their own classes.
    for c, own, _ in passthrough.own_class_swaps(list(block.modules())):
        object.__setattr__(c, "__class__", own)
    assert type(block) is lean
    own_calls = []
    real = ResnetBlock2D.forward
    monkeypatch.setattr(ResnetBlock2D, "forward", lambda *a, **k: own_calls.append(1) or real(*a, **k))
    with torch.no_grad():
        out = block(x, temb)
    assert not own_calls and torch.equal(out, ref) and out.stride() == ref.stride()
    with torch.no_grad():
        x0 = x.clone()
        block(x, temb)
        assert torch.equal(x, x0)  # the input is not written
    # Its own forward where the lean one may not run.
    with torch.enable_grad():
        assert torch.equal(block(x, temb), ref) and len(own_calls) == 1
    seen = []
    h = block.norm2.register_forward_hook(lambda m, a, o: seen.append(1))
    with torch.no_grad():
        assert torch.equal(block(x, temb), ref) and len(own_calls) == 2 and seen
    h.remove()
    block.dropout.train()
    with torch.no_grad():
        assert torch.equal(block(x, temb), ref) and len(own_calls) == 3
    block.dropout.eval()
    if temb is not None:
        with torch.no_grad(), pytest.raises(Exception):
            block(x, None)  # diffusers' own error: its projection needs a temb
        assert len(own_calls) == 4


def _patched_resnet(device):
    """A 6->8 resnet block, an input, its unpatched answer; then patched."""
    block = _resnet(6, 8).to(device)
    x = torch.randn(1, 6, 5, 6, device=device)
    with torch.no_grad():
        ref = block(x, None)
    conv_patch.apply(block)
    return block, x, ref


def test_fused_block_falls_back_where_it_must(device, exact_fp32):
    block, x, ref = _patched_resnet(device)
    # Autograd needed: the class's own forward, gradients flow.
    xg = x.clone().requires_grad_()
    y = block(xg, None)
    y.sum().backward()
    assert xg.grad is not None and rel_err(y, ref) <= 1e-5
    # A hook on a module the fused forward bypasses must see it run.
    seen = []
    h = block.norm2.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        assert rel_err(block(x, None), ref) <= 1e-5
    assert seen == [torch.Size([1, 8, 5, 6])]
    h.remove()
    # Training-mode dropout with p > 0 is random: the class's own forward.
    block.dropout.p = 0.5
    block.train()
    calls = []
    block.dropout.register_forward_hook(lambda m, i, o: calls.append(1))
    with torch.no_grad():
        block(x, None)
    assert calls == [1]


def test_recipes_off_remove_pickle_and_state_dict(device, exact_fp32):
    block = _resnet(6, 8).to(device)
    keys = list(block.state_dict())
    report = conv_patch.apply(block, recipes=False)
    assert report.fused == {} and type(block) is ResnetBlock2D
    conv_patch.remove(block)
    report = conv_patch.apply(block)
    assert "" in report.fused and "norm1" in report.fused and "conv1" in report.patched
    assert "blocks fused" in str(report) and "fused    <root>" in str(report)
    assert list(block.state_dict()) == keys
    x = torch.randn(1, 6, 4, 4, device=device)
    with torch.no_grad():
        ref = block(x, None)
        for clone in (copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
            assert type(clone) is type(block)
            assert rel_err(clone(x, None), ref) <= 1e-5
        buf = io.BytesIO()
        torch.save(block, buf)
    assert conv_patch.apply(block).fused == {}  # idempotent
    restored = conv_patch.remove(block)
    assert "" in restored and "norm1" in restored
    assert type(block) is ResnetBlock2D and type(block.norm1) is nn.GroupNorm
    with conv_patch.patched(block) as rep:
        assert "" in rep.fused and recipes.is_fused(block)
    assert type(block) is ResnetBlock2D


def test_upsample_and_downsample_blocks(device, exact_fp32):
    up = _seeded(Upsample2D(6, use_conv=True, out_channels=10)).to(device).eval()
    down = _seeded(Downsample2D(6, use_conv=True, out_channels=6, padding=0)).to(device).eval()
    x = torch.randn(2, 6, 5, 7, device=device)
    with torch.no_grad():
        ref_up, ref_down = up(x), down(x)
        ref_sized = up(x, output_size=(11, 15))
        assert conv_patch.apply(up).fused[""].startswith("diffusers.Upsample2D")
        assert conv_patch.apply(down).fused[""].startswith("diffusers.Downsample2D")
        assert rel_err(up(x), ref_up) <= 1e-5 and rel_err(down(x), ref_down) <= 1e-5
        assert rel_err(up(x, output_size=(11, 15)), ref_sized) <= 1e-5  # not the x2 case: unfused


def _small_kl(device):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
        norm_num_groups=4, sample_size=16)
    return _seeded(vae).to(device).eval()


@pytest.fixture
def no_fallback(monkeypatch):
    """Fused forwards must not fall back to the block's own forward."""
    from conv_patch.recipes import common, diffusers as rdiff, ldm

    def refuse(m, *a, **k):
        raise AssertionError(f"{type(m).__name__} fell back to its own forward")
    for mod in (common, rdiff, ldm):
        monkeypatch.setattr(mod, "base", refuse)


def test_autoencoder_kl_decode_encode_fused_keeps_layouts(device, exact_fp32, no_fallback):
    vae = _small_kl(device)
    img = torch.randn(1, 3, 14, 10, device=device)
    z = torch.randn(1, 4, 7, 5, device=device)
    with torch.no_grad():
        ref_enc = vae.encode(img).latent_dist.mean
        ref_dec = vae.decode(z).sample
        report = conv_patch.apply(vae)
        for name, m in vae.named_modules():
            if type(m).__name__ == "ResnetBlock2D":
                raise AssertionError(f"{name} not fused")
        names = {v.split()[0] for v in report.fused.values()}
        assert {"diffusers.ResnetBlock2D", "diffusers.Upsample2D", "diffusers.Downsample2D",
                "diffusers.Attention", "diffusers.Decoder", "diffusers.Encoder", "group_norm"} <= names
        enc, dec = vae.encode(img).latent_dist.mean, vae.decode(z).sample
        assert rel_err(enc, ref_enc) <= 1e-5 and rel_err(dec, ref_dec) <= 1e-5
        assert enc.is_contiguous() and dec.is_contiguous()
        dec_cl = vae.decode(z.contiguous(memory_format=torch.channels_last)).sample
        assert dec_cl.is_contiguous(memory_format=torch.channels_last) and rel_err(dec_cl, ref_dec) <= 1e-5
    # Nothing of the model was converted to channels_last.
    assert all(p.is_contiguous() for p in vae.parameters())


def test_encoder_enters_through_conv_in_in_the_callers_layout(device, exact_fp32, no_fallback, monkeypatch):
    """The Encoder recipe's own walk (conv_in reads the image as given and
    writes NHWC), not the generic NHWC-inside forward."""
    from conv_patch.recipes import diffusers as rdiff
    vae = _small_kl(device)
    img = torch.randn(2, 3, 12, 10, device=device)
    with torch.no_grad():
        ref = vae.encode(img).latent_dist.mean
        conv_patch.apply(vae)

        def refuse(*a, **k):
            raise AssertionError("the Encoder took the generic NHWC-inside forward")
        monkeypatch.setattr(rdiff.NHWCInside, "forward", refuse)
        seen, real = [], rdiff.conv

        def spy(m, x, **kw):
            if m is vae.encoder.conv_in:
                seen.append((x.is_contiguous(), kw["out"].is_contiguous()))
            return real(m, x, **kw)
        monkeypatch.setattr(rdiff, "conv", spy)
        for x in (img, img.contiguous(memory_format=torch.channels_last)):
            lat = vae.encode(x).latent_dist.mean
            assert rel_err(lat, ref) <= 1e-5
            assert vae.encoder(x).is_contiguous(memory_format=(
                torch.contiguous_format if x.is_contiguous() else torch.channels_last))
    assert seen == [(True, False), (True, False), (False, False), (False, False)]  # the image as given, NHWC out


def test_decoder_walks_up_blocks_and_bands_large_inputs(device, exact_fp32, no_fallback, monkeypatch):
    from conv_patch.recipes import fuse as _fuse
    vae = _small_kl(device)
    z = torch.randn(1, 4, 7, 5, device=device)
    with torch.no_grad():
        ref = vae.decode(z).sample
        conv_patch.apply(vae)
        # Every normalised conv input of this tiny decoder counts as large,
        # in bands of 2 rows.
        monkeypatch.setattr(_fuse, "BAND_FROM_BYTES", 0)
        monkeypatch.setattr(_fuse, "BAND_BYTES", 4 * 16 * 14 * 4)
        calls = []
        orig = functional.group_norm_conv2d
        monkeypatch.setattr(functional, "group_norm_conv2d", lambda *a, **k: calls.append(a[0].shape) or orig(*a, **k))
        out = vae.decode(z).sample
    assert rel_err(out, ref) <= 1e-5 and out.is_contiguous()
    # The first conv of all six resnets (mid block and up blocks) and the
    # tail (conv_norm_out -> conv_out, 8 channels in).
    assert len(calls) == 7 and calls[-1][1] == 8


def test_in_place_reuse_spares_tensors_a_hook_holds(device, exact_fp32):
    block, x, ref = _patched_resnet(device)
    held = []
    block.conv1.register_forward_hook(lambda m, i, o: held.append((o, o.clone())))
    block.conv_shortcut.register_forward_hook(lambda m, i, o: held.append((o, o.clone())))
    with torch.no_grad():
        assert rel_err(block(x, None), ref) <= 1e-5
    assert len(held) == 2 and all(torch.equal(o, copy_) for o, copy_ in held)


def test_taesd_blocks_and_chains(device, exact_fp32, no_fallback):
    torch.manual_seed(0)
    dec = taesd.seeded_(taesd.decoder(latent_channels=4, channels=8, pool=True)).to(device).eval()
    enc = taesd.seeded_(taesd.encoder(latent_channels=4, channels=8, pool=True)).to(device).eval()
    z = torch.randn(1, 4, 3, 5, device=device)
    img = torch.randn(1, 3, 16, 24, device=device)
    with torch.no_grad():
        ref_d, ref_e = dec(z), enc(img)
        rd, re_ = conv_patch.apply(dec), conv_patch.apply(enc)
        assert rd.fused[""].startswith("sequential_chain") and rd.fused["3"].startswith("tiny.Block")
        assert re_.fused["1"].startswith("tiny.Block")
        assert rel_err(dec(z), ref_d) <= 1e-5 and rel_err(enc(img), ref_e) <= 1e-5
        assert dec(z).is_contiguous()


def test_autoencoder_tiny(device, exact_fp32, no_fallback):
    torch.manual_seed(0)
    vae = _seeded(diffusers.AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                                            num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1),
                                            latent_channels=4)).to(device).eval()
    img = torch.randn(1, 3, 12, 12, device=device)
    with torch.no_grad():
        ref_z = vae.encode(img).latents
        ref = vae.decode(ref_z).sample
        report = conv_patch.apply(vae)
        assert any(v.startswith("tiny.Block") for v in report.fused.values())
        assert any(v.startswith("sequential_chain") for v in report.fused.values())
        assert rel_err(vae.encode(img).latents, ref_z) <= 1e-5
        assert rel_err(vae.decode(ref_z).sample, ref) <= 1e-5


def test_structure_not_name_decides():
    # A block named like a recipe's but built differently is left alone.
    class ResnetBlock2D(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(4)
            self.conv1 = nn.Conv2d(4, 4, 3, padding=1)

    assert recipes.recipe_for(ResnetBlock2D()) is None
    # A Sequential with a GELU after its conv: no fused activation.
    seq = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU())
    assert recipes.recipe_for(seq) is None
    assert recipes.recipe_for(nn.GroupNorm(2, 4)).name == "group_norm"


def test_ldm_blocks_are_fused(device, exact_fp32, no_fallback):
    ldm = pytest.importorskip("ldm.modules.diffusionmodules.model")
    torch.manual_seed(0)
    cfg = dict(ch=32, out_ch=3, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=[], in_channels=3,
               resolution=16, z_channels=4)
    enc = _seeded(ldm.Encoder(double_z=True, **cfg)).to(device).eval()
    dec = _seeded(ldm.Decoder(**cfg)).to(device).eval()
    x = torch.randn(1, 3, 12, 14, device=device)
    with torch.no_grad():
        ref_z = enc(x)
        ref = dec(ref_z[:, :4])
        fused = list(conv_patch.apply(enc).fused.values()) + list(conv_patch.apply(dec).fused.values())
        names = {v.split()[0] for v in fused}
        assert {"ldm.ResnetBlock", "ldm.AttnBlock", "ldm.Upsample", "ldm.Downsample", "ldm.Encoder",
                "ldm.Decoder"} <= names
        z = enc(x)
        assert rel_err(z, ref_z) <= 1e-5 and rel_err(dec(z[:, :4]), ref) <= 1e-5


def test_subpixel_only_where_it_pays(monkeypatch):
    from conv_patch import target as tgt
    monkeypatch.setattr(dispatch, "target_for", lambda d: tgt.Target("sm90", True))
    w = torch.empty(64, 64, 3, 3)
    assert not dispatch.subpixel_pays(torch.empty(1, 64, 512, 512), w)  # TAEF2: host-bound, unfolded
    assert dispatch.subpixel_pays(torch.empty(1, 512, 128, 128), torch.empty(512, 512, 3, 3))  # FLUX
    # Captured into a CUDA graph, launches cost nothing at replay: folded.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = torch.empty(1, 64, 512, 512)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert dispatch.subpixel_pays(x, w)


def test_a_recipe_step_whose_kernel_cannot_run_falls_back_once(device, exact_fp32, monkeypatch):
    """The subpixel upsample's weight fold runs on a kernel outside the conv
    plans: a kernel that cannot be built here (OutOfResources) gives
    PyTorch's answer with one KernelFailureWarning, and later calls do not
    try it again."""
    from triton.runtime.errors import OutOfResources
    up = _seeded(Upsample2D(6, use_conv=True, out_channels=10)).to(device).eval()
    x = torch.randn(2, 6, 5, 7, device=device)
    tries = []

    def fails(*a, **k):
        tries.append(1)
        raise OutOfResources(262144, 232448, "shared memory")
    with torch.no_grad():
        ref = up(x)
        conv_patch.apply(up)
        monkeypatch.setattr(conv_patch.runtime.dispatch, "subpixel_weights", fails)
        monkeypatch.setattr(dispatch, "subpixel_pays", lambda x, w: True)  # (a GPU would not fold this small one)
        with pytest.warns(conv_patch.runtime.plans.KernelFailureWarning, match="OutOfResources"):
            assert rel_err(up(x), ref) <= 1e-5
        assert rel_err(up(x), ref) <= 1e-5
    assert len(tries) == 1


def test_fused_resnet_keeps_an_nhwc_input_nhwc_whatever_its_norm_returns(device, exact_fp32, monkeypatch):
    """On the GPU PyTorch's own GroupNorm (taken below the kernels'
    crossover) returns NCHW for an NHWC input; the fused block's output
    must still take the input's layout, as the unpatched ``x + h`` does."""
    from conv_patch.recipes import fuse as _fuse
    block = _resnet(10, 10, 2.0).to(device)
    x = (torch.randn(2, 10, 7, 5, device=device) * 2 + 0.5).contiguous(memory_format=torch.channels_last)
    real = _fuse.group_norm
    monkeypatch.setattr(_fuse, "group_norm", lambda *a, **k: real(*a, **k).contiguous())
    with torch.no_grad():
        ref = block(x, None)
        conv_patch.apply(block)
        out = block(x, None)
    assert rel_err(out, ref) <= 1e-5
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_folded_upsample_of_a_weight_normed_conv_runs_its_own_computation(device, exact_fp32):
    """A parametrization registered after apply(): the conv's weight is no
    registered Parameter any more; the folded upsample is not taken and the
    block computes from the parametrized weight."""
    up = _seeded(Upsample2D(6, use_conv=True, out_channels=10)).to(device).eval()
    twin = copy.deepcopy(up)
    conv_patch.apply(up)
    torch.nn.utils.parametrizations.weight_norm(up.conv)
    torch.nn.utils.parametrizations.weight_norm(twin.conv)
    x = torch.randn(2, 6, 5, 7, device=device)
    with torch.no_grad():
        assert rel_err(up(x), twin(x)) <= 1e-5


class _LayoutProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.nhwc = []

    def forward(self, x):
        self.nhwc.append(not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last))
        return x


@pytest.mark.parametrize("eager_norm", [False, True])
def test_a_chain_with_a_pytorch_group_norm_inside_stays_nchw(device, exact_fp32, eager_norm, monkeypatch):
    """A stack runs NHWC inside unless a GroupNorm in it would run as
    PyTorch's (which hands NHWC back as NCHW): TAEF2's pooled blocks at
    256-512 px (docs/performance.md). The output is the same either way."""
    from conv_patch.recipes import common
    torch.manual_seed(0)
    probe = _LayoutProbe()
    stack = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), probe, taesd.Block(8, 8, pool=True),
                          nn.Conv2d(8, 3, 3, padding=1), nn.ReLU()).to(device)
    ref = copy.deepcopy(stack)
    conv_patch.apply(stack, config=conv_patch.PatchConfig(passthrough=False))
    monkeypatch.setattr(common, "norm_is_eager", lambda x, numel=None, groups=None: eager_norm)
    x = torch.randn(1, 3, 6, 5, device=device)
    with torch.no_grad():
        assert rel_err(stack(x), ref(x)) < 1e-5
    assert probe.nhwc == [not eager_norm]


def test_a_chain_judges_its_norms_by_their_groups_too(device, monkeypatch):
    """The stack asks the size rule about the GroupNorm with the fewest
    channels per group (PyTorch's kernel gives each (sample, group) row
    one block: few long rows go to the kernels, ``costs.group_norm_pays``),
    at the stack input's resolution, with that norm's group count."""
    from conv_patch.recipes import common
    asked = []
    monkeypatch.setattr(common, "norm_is_eager",
                        lambda x, numel=None, groups=None: asked.append((numel, groups)) or False)
    # The pool's GroupNorm(4, 32) has 8 channels a group, the GroupNorm(2, 8) 4: that one is judged.
    for extra, judged in ((nn.GroupNorm(2, 8), (8, 2)), (nn.Identity(), (32, 4))):
        asked.clear()
        stack = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), taesd.Block(8, 8, pool=True), extra,
                              nn.Conv2d(8, 3, 3, padding=1)).to(device)
        conv_patch.apply(stack, config=conv_patch.PatchConfig(passthrough=False))
        with torch.no_grad():
            stack(torch.randn(2, 3, 6, 5, device=device))
        assert (2 * 6 * 5 * judged[0], judged[1]) in asked, asked


def _ran(code, *others):
    """A list that a profile hook fills with one entry per call of ``code``,
    and one for the calls of any of ``others`` (a spy put in a forward's
    place would be another forward)."""
    import sys
    calls, other = [], []
    others = set(others)
    old = sys.getprofile()

    def hook(frame, event, arg):
        if event == "call":
            if frame.f_code is code:
                calls.append(1)
            elif frame.f_code in others:
                other.append(frame.f_code.co_qualname)

    sys.setprofile(hook)
    return calls, other, lambda: sys.setprofile(old)


@pytest.mark.parametrize("which,cin,cout,cl", [("diffusers", 6, 10, False), ("diffusers", 8, 8, True),
                                               ("taesd", 6, 6, False), ("taesd-pool", 6, 6, True)])
def test_lean_tiny_block_computes_its_own_forward_bit_for_bit(device, which, cin, cout, cl):
    """AutoencoderTiny's and TAESD's block passed through (``LeanTinyBlock``):
    its own values bit for bit without its own forward; a hooked part runs
    as a module; with a gradient recorded, its own forward."""
    from diffusers.models.unets.unet_2d_blocks import AutoencoderTinyBlock
    if which == "diffusers":
        block, cls = AutoencoderTinyBlock(cin, cout, "relu"), AutoencoderTinyBlock
    else:
        block, cls = taesd.Block(cin, cout, pool=which == "taesd-pool"), taesd.Block
    block = _seeded(block).eval().to(device)
    x = torch.randn(2, cin, 7, 5, device=device) * 2 + 0.5
    if cl:
        x = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = block(x)
    conv_patch.apply(block)
    lean = type(block).cp_own_class(block)
    assert lean is fuse.lean_class(cls, rdiff.LeanTinyBlock) and lean.__name__ == cls.__name__
    for c, own, _ in passthrough.own_class_swaps(list(block.modules())):
        object.__setattr__(c, "__class__", own)
    assert type(block) is lean
    # (Its parts, the pool's GroupNorm among them, as the functions their
    # forwards call: no module forward runs.)
    calls, parts, stop = _ran(cls.forward.__code__, nn.Sequential.forward.__code__, nn.GroupNorm.forward.__code__,
                              nn.Conv2d.forward.__code__, nn.ReLU.forward.__code__)
    try:
        x0 = x.clone()
        with torch.no_grad():
            out = block(x)
        assert not calls and not parts, parts
        assert torch.equal(out, ref) and out.stride() == ref.stride() and torch.equal(x, x0)
        seen = []
        h = block.conv[2].register_forward_hook(lambda m, a, o: seen.append(1))
        with torch.no_grad():
            assert torch.equal(block(x), ref) and not calls and seen == [1]
        h.remove()
        with torch.enable_grad():
            assert torch.equal(block(x).detach(), ref) and len(calls) == 1
    finally:
        stop()


def test_lean_tiny_block_only_for_the_classes_it_was_written_from():
    from diffusers.models.unets.unet_2d_blocks import AutoencoderTinyBlock
    recipe = rdiff.TINY_BLOCK
    assert recipe.lean_for(AutoencoderTinyBlock) is rdiff.LeanTinyBlock
    assert recipe.lean_for(taesd.Block) is rdiff.LeanTinyBlock
    # Another package's copy (ComfyUI's, a user's): its own forward, unread.
    copy_cls = type("Block", (nn.Module,), {"__module__": "comfy.taesd.taesd", "forward": taesd.Block.forward})
    assert recipe.lean_for(copy_cls) is None
    sub = type("AutoencoderTinyBlock", (AutoencoderTinyBlock,), {"forward": lambda self, x: x})
    assert recipe.lean_for(sub) is None


def _movq(device):
    """A tiny MoVQ (Kandinsky's ``VQModel``, spatially conditioned norms:
    ``ResnetBlockCondNorm2D`` blocks, ``SpatialNorm`` in the decoder's
    attention and output norm), seeded. (SpatialNorm's GroupNorm has 32
    groups whatever the config says: 32 channels.)"""
    from diffusers import VQModel
    vq = VQModel(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
                 up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"), latent_channels=3,
                 layers_per_block=1, norm_num_groups=8, norm_type="spatial", num_vq_embeddings=16, vq_embed_dim=3)
    return _seeded(vq).to(device).eval()


@pytest.mark.parametrize("cl", [False, True])
def test_movq_decoder_spatial_norms_fused_match_unpatched(device, exact_fp32, cl, monkeypatch):
    """MoVQ's decoder: every ``ResnetBlockCondNorm2D`` and ``SpatialNorm``
    fused (the modulation and the SiLU in the GroupNorm's pass, the residual
    in conv2's epilogue), none falling back to its own forward, at an odd
    latent size; the output in the layout the unpatched decoder gives
    (diffusers' attention hands back a channels_last-strided tensor)."""
    vq = _movq(device)
    z = torch.randn(1, 3, 5, 7, device=device) * 2 + 0.3
    if cl:
        z = z.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = vq.decode(z, force_not_quantize=True).sample
        report = conv_patch.apply(vq)
        fused = {k: v.split()[0] for k, v in report.fused.items()}
        conds = [k for k, m in vq.named_modules() if type(m).__name__.endswith("ResnetBlockCondNorm2D")]
        norms = [k for k, m in vq.named_modules() if type(m).__name__.endswith("SpatialNorm")]
        assert conds and all(fused.get(k) == "diffusers.ResnetBlockCondNorm2D" for k in conds)
        assert norms and all(fused.get(k) == "diffusers.SpatialNorm" for k in norms)

        def refuse(m, *a, **k):
            raise AssertionError(f"{type(m).__name__} fell back to its own forward")
        monkeypatch.setattr(rdiff, "base", refuse)
        out = vq.decode(z, force_not_quantize=True).sample
    assert rel_err(out, ref) <= 1e-5 and out.stride() == ref.stride()


def test_movq_spatial_norm_blocks_fall_back_where_they_must(device, exact_fp32):
    """A call the fused forwards do not take runs the block's own forward:
    a gradient recorded, a hook on a spatial norm's conv."""
    vq = _movq(device)
    z = torch.randn(1, 3, 4, 4, device=device)
    ref = vq.decode(z, force_not_quantize=True).sample.detach()
    conv_patch.apply(vq)
    block = vq.decoder.up_blocks[0].resnets[0]
    zq = torch.randn(1, 3, 4, 4, device=device)
    x = torch.randn(1, 32, 4, 4, device=device, requires_grad=True)
    with torch.no_grad():
        want = block.cp_own_forward(x, zq)
    y = block(x, zq)
    y.sum().backward()  # the block's own forward: autograd recorded
    assert x.grad is not None and rel_err(y.detach(), want) <= 1e-5
    seen = []
    handle = block.norm1.conv_y.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    with torch.no_grad():
        out = vq.decode(z, force_not_quantize=True).sample
    handle.remove()
    assert seen and rel_err(out, ref) <= 1e-5
