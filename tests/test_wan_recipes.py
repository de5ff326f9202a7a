"""The Wan-family recipes (recipes/wan.py) against the unpatched blocks in
float64: diffusers' Wan and Qwen-Image residual blocks over a chunked causal
decode (the feature cache carried from chunk to chunk exactly as the block
keeps it), a ComfyUI-style block (its ``residual`` Sequential and the
``cache_list`` call of its causal convs), the RMS norms alone, the resample's
upsample chain, and where a fused block must run its own forward. The
blocks' own forwards are made to fail where the fused path must be taken.
On the CPU the kernels run under the interpreter."""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conv_patch
from conv_patch.recipes import wan
from conv_patch.runtime.state import state_of
from _util import TOL, ComfyCausalConv3d, rel_err

diffusers = pytest.importorskip("diffusers")
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen  # noqa: E402
from diffusers.models.autoencoders import autoencoder_kl_wan as dwan  # noqa: E402

# The ComfyUI-style classes below keep this many frames per chunk, as the family does.
CACHE_T = 2


@pytest.fixture
def no_fallback(monkeypatch):
    def refuse(m, *a, **k):
        raise AssertionError(f"{type(m).__name__} fell back to its own forward")
    monkeypatch.setattr(wan, "base", refuse)


def _seeded(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4 + (1.0 if p.dim() == 4 and p.shape[1:] == (1, 1, 1)
                                                                 else 0.0))
    return m.eval()


def _chunks(seed, c, h=5, w=4):
    """A causal decode's chunks: one frame, then two chunks of two (as the
    decoder feeds them), with outliers."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, c, t, h, w, generator=g) for t in (1, 2, 2)]
    xs[1][0, :, 1, 2, 3] *= 50
    return xs


def _run_chunks(block, xs, slots):
    cache, outs = [None] * slots, []
    for x in xs:
        idx = [0]
        outs.append(block(x, cache, idx))
        assert idx[0] == slots
    return outs, cache


@pytest.mark.parametrize("cls", [dwan.WanResidualBlock, qwen.QwenImageResidualBlock])
@pytest.mark.parametrize("cin,cout", [(5, 5), (3, 6)])
def test_diffusers_residual_blocks_over_a_chunked_decode(cls, cin, cout, exact_fp32, no_fallback):
    block = _seeded(cls(cin, cout), cin + cout)
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("wan.ResidualBlock")
    xs = _chunks(cin, cin)
    with torch.no_grad():
        outs, cache = _run_chunks(block, xs, 2)
        refs, ref_cache = _run_chunks(ref, [x.double() for x in xs], 2)
        for y, r in zip(outs, refs):
            assert rel_err(y, r) <= TOL[torch.float32]
        for c, r in zip(cache, ref_cache):
            assert rel_err(c, r) <= TOL[torch.float32]  # the cache handed to the next chunk
        # Without a cache: the plain (zero-padded in time) block.
        assert rel_err(block(xs[1]), ref(xs[1].double())) <= TOL[torch.float32]
    assert state_of(block.conv1).last.reason == "interpreter"


def test_a_fused_block_runs_its_own_forward_where_it_must(exact_fp32):
    block = _seeded(dwan.WanResidualBlock(4, 4), 1)
    twin = copy.deepcopy(block)
    conv_patch.apply(block)
    x = torch.randn(1, 4, 2, 3, 5)
    calls = []
    block.norm1.register_forward_hook(lambda m, a, y: calls.append(1))
    with torch.no_grad():
        assert rel_err(block(x), twin(x)) <= TOL[torch.float32]
    assert calls == [1]  # the norm ran as a module: its hook saw it
    block = _seeded(dwan.WanResidualBlock(4, 4), 1)
    conv_patch.apply(block)
    # Autograd: the block's own forward.
    x.requires_grad_(True)
    block(x).sum().backward()
    assert x.grad is not None


class RMS_norm(nn.Module):
    """ComfyUI's WanVAE norm contract (normalises in the input's dtype, bias None)."""

    def __init__(self, dim, images=True):
        super().__init__()
        self.channel_first = True
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1) if images else (1, 1, 1))))
        self.bias = None

    def forward(self, x):
        return F.normalize(x, dim=1) * self.scale * self.gamma.to(x) + (self.bias if self.bias is not None else 0)


class CausalConv3d(ComfyCausalConv3d, nn.Conv3d):
    """ComfyUI's causal conv contract on a plain Conv3d."""


class ResidualBlock(nn.Module):
    """ComfyUI's WanVAE residual block contract: a ``residual`` Sequential and a ``shortcut``."""

    def __init__(self, cin, cout):
        super().__init__()
        self.residual = nn.Sequential(RMS_norm(cin, images=False), nn.SiLU(), CausalConv3d(cin, cout, 3, padding=1),
                                      RMS_norm(cout, images=False), nn.SiLU(), nn.Dropout(0.0),
                                      CausalConv3d(cout, cout, 3, padding=1))
        self.shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, feat_cache=None, feat_idx=[0]):
        old_x = x
        for layer in self.residual:
            if isinstance(layer, CausalConv3d) and feat_cache is not None:
                idx = feat_idx[0]
                cache_x = x[:, :, -CACHE_T:].clone()
                if cache_x.shape[2] < 2 and feat_cache[idx] is not None:
                    cache_x = torch.cat([feat_cache[idx][:, :, -1:], cache_x], dim=2)
                x = layer(x, cache_list=feat_cache, cache_idx=idx)
                feat_cache[idx] = cache_x
                feat_idx[0] += 1
            else:
                x = layer(x)
        return x + self.shortcut(old_x)


def test_comfy_style_residual_block_and_its_cache_list_convs(exact_fp32, no_fallback):
    assert sys.modules[ResidualBlock.__module__].CACHE_T == 2
    block = _seeded(ResidualBlock(3, 5), 7)
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("wan.comfy.ResidualBlock")
    assert {"residual.2", "residual.6", "shortcut"} <= set(report.patched)
    xs = _chunks(2, 3)
    with torch.no_grad():
        outs, cache = _run_chunks(block, xs, 2)
        refs, ref_cache = _run_chunks(ref, [x.double() for x in xs], 2)
        for y, r in zip(outs + cache, refs + ref_cache):
            assert rel_err(y, r) <= TOL[torch.float32]
        # The patched conv takes the cache_list call on its own too.
        conv, slot = block.residual[2], [torch.randn(1, 3, 2, 5, 4)]
        want = ref.residual[2](xs[1].double(), slot[0].double())
        assert rel_err(conv(xs[1], cache_list=slot, cache_idx=0), want) <= TOL[torch.float32]
        assert slot == [None]


def test_rms_norms_alone_and_the_upsample_chain(exact_fp32):
    torch.manual_seed(0)
    norm = _seeded(dwan.WanRMS_norm(6, images=True), 3)
    net = nn.ModuleDict({"norm": norm, "up": _seeded(nn.Sequential(
        dwan.WanUpsample(scale_factor=(2.0, 2.0), mode="nearest-exact"), nn.Conv2d(6, 4, 3, padding=1)), 4)})
    ref = copy.deepcopy(net).double()
    report = conv_patch.apply(net)
    assert report.fused["norm"].startswith("wan.RMS_norm") and report.fused["up"].startswith("sequential_chain")
    x = torch.randn(2, 6, 5, 7)
    with torch.no_grad():
        assert rel_err(net["norm"](x), ref["norm"](x.double())) <= TOL[torch.float32]
        assert state_of(net["norm"]).norm_plan.kernel
        assert rel_err(net["up"](x), ref["up"](x.double())) <= TOL[torch.float32]
        # A 5-D input to an image norm broadcasts gamma differently: its own forward.
        x5 = torch.randn(1, 6, 6, 5, 7)
        assert rel_err(net["norm"](x5), ref["norm"](x5.double())) <= TOL[torch.float32]


@pytest.mark.parametrize("cls", [dwan.WanAttentionBlock, qwen.QwenImageAttentionBlock])
def test_mid_block_attention_per_frame(cls, exact_fp32, no_fallback):
    block = _seeded(cls(12), 5)
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("wan.AttentionBlock")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 12, 3, 4, 5, generator=g)
    with torch.no_grad():
        want = ref(x.double())
        for fmt in (torch.contiguous_format, torch.channels_last_3d):
            y = block(x.contiguous(memory_format=fmt))
            assert rel_err(y, want) <= TOL[torch.float32]
            assert y.is_contiguous(memory_format=fmt)


def test_tiny_wan_and_qwen_image_vaes_fuse_and_match(exact_fp32):
    """Whole decodes with every block fused; the Conv3d layers left to
    PyTorch here (their kernel under the interpreter is test_conv3d_patch's:
    this keeps the test to seconds), so the blocks take the unpatched-conv
    path of their steps."""
    torch.manual_seed(1)
    cfg = dict(base_dim=4, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[True])
    for vae in (diffusers.AutoencoderKLWan(**cfg), diffusers.AutoencoderKLQwenImage(**cfg)):
        vae = _seeded(vae, 2)
        ref = copy.deepcopy(vae).double()
        report = conv_patch.apply(vae, filter_fn=lambda m, name: not isinstance(m, nn.Conv3d))
        assert sum(v.startswith("wan.ResidualBlock") for v in report.fused.values()) == 10
        assert sum(v.startswith("wan.AttentionBlock") for v in report.fused.values()) == 2
        z = torch.randn(1, 4, 2, 3, 4)
        with torch.no_grad():
            assert rel_err(vae.decode(z).sample, ref.decode(z.double()).sample) <= TOL[torch.float32]


@pytest.mark.gpu
def test_wan_decoder_block_bf16_gpu():
    """bf16 on a Wan 2.1 decoder block's shapes (384 channels, a 2-frame chunk
    at 60x104 after its cached frames): the fused block no further from the
    fp32 block than 1.5x the unpatched bf16 block, the RMS norm on its kernel."""
    dev = torch.device("cuda")
    block = _seeded(dwan.WanResidualBlock(384, 384), 11).to(dev)
    ref32, ref16 = copy.deepcopy(block), copy.deepcopy(block).bfloat16()
    block = block.bfloat16()
    conv_patch.apply(block)
    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(1, 384, t, 60, 104, generator=g).to(dev) for t in (1, 2)]
    with torch.no_grad():
        ys, _ = _run_chunks(block, [x.bfloat16() for x in xs], 2)
        r16, _ = _run_chunks(ref16, [x.bfloat16() for x in xs], 2)
        r32, _ = _run_chunks(ref32, xs, 2)
    for y, a, b in zip(ys, r16, r32):
        assert rel_err(y, b) <= 1.5 * rel_err(a, b) + 1e-4
    assert state_of(block.norm1).norm_plan.kernel


@pytest.mark.parametrize("family", ["AutoencoderKLHunyuanVideo", "AutoencoderKLLTXVideo"])
def test_other_video_vaes_patch_and_keep_their_answer(family, exact_fp32):
    """HunyuanVideo and LTX-Video VAEs (their causal convs wrap a plain
    Conv3d after a replicate pad of their own): every Conv3d patched, nothing
    skipped, and the decode unchanged where the blocks around them run as
    patched (the Conv3d kernel itself left out here, test_conv3d_patch's)."""
    torch.manual_seed(0)
    cfg = dict(block_out_channels=(8, 8, 8, 8), latent_channels=4)
    cfg.update(dict(layers_per_block=1, norm_num_groups=4) if family.endswith("HunyuanVideo") else
               dict(decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1,) * 5,
                    decoder_layers_per_block=(1,) * 5))
    vae = getattr(diffusers, family)(**cfg).eval()
    report = conv_patch.apply(copy.deepcopy(vae))
    n3d = sum(isinstance(m, nn.Conv3d) for m in vae.modules())
    assert n3d and sum(r.startswith("conv3d_igemm") for r in report.patched.values()) == n3d and not report.skipped
    ref = copy.deepcopy(vae).double()
    conv_patch.apply(vae, filter_fn=lambda m, name: not isinstance(m, nn.Conv3d))
    z = torch.randn(1, 4, 2, 3, 3)
    with torch.no_grad():
        assert rel_err(vae.decode(z).sample, ref.decode(z.double()).sample) <= TOL[torch.float32]


WAN21_TINY = dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
                  temperal_downsample=[True, True])
# Wan 2.2's TI2V-5B layout: residual up blocks (DupUp3D shortcuts), 2x2 patches.
WAN22_TINY = dict(WAN21_TINY, decoder_base_dim=8, temperal_downsample=[False, True], is_residual=True,
                  in_channels=12, out_channels=12, patch_size=2)


@pytest.mark.parametrize("cfg", [WAN21_TINY, WAN22_TINY], ids=["wan2.1", "wan2.2"])
def test_decoder_runs_ndhwc_inside_and_hands_back_ncdhw(cfg, exact_fp32, monkeypatch):
    """The decoder recipe feeds its own forward NDHWC chunks: every block
    (the time up-sampling resample included, whose own ``torch.stack`` would
    hand back NCDHW) sees NDHWC, the decode's answer and layout are the
    unpatched ones, and the resample's cache bookkeeping ("Rep" on the first
    chunk, then its cached frames) matches the block's own."""
    torch.manual_seed(3)
    vae = _seeded(diffusers.AutoencoderKLWan(**cfg), 4)
    ref = copy.deepcopy(vae).double()
    report = conv_patch.apply(vae, filter_fn=lambda m, name: not isinstance(m, nn.Conv3d))
    assert report.fused["decoder"].startswith("wan.Decoder3d")
    ups = [k for k, v in report.fused.items() if v.startswith("wan.Resample")]
    assert len(ups) == sum(cfg["temperal_downsample"]) and all(".upsample" in k for k in ups), report.fused
    dup_ups = [k for k, v in report.fused.items() if v.startswith("wan.ResidualUpBlock")]
    assert len(dup_ups) == (len(cfg["dim_mult"]) if cfg.get("is_residual") else 0), report.fused
    seen = []
    real = wan.ResidualBlock.forward

    def spy(self, m, x, *a, **k):
        seen.append(x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous())
        return real(self, m, x, *a, **k)

    def refuse(m, *a, **k):
        raise AssertionError(f"{type(m).__name__} ran its own forward")

    conv3d = nn.Conv3d.forward

    def like_cudnn(self, x):
        # PyTorch's CPU conv3d hands back NCDHW for an NDHWC input; cuDNN
        # (and the Conv3d kernels) keep NDHWC, as here.
        y = conv3d(self, x)
        cl = x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
        return y.contiguous(memory_format=torch.channels_last_3d) if cl else y

    monkeypatch.setattr(nn.Conv3d, "forward", like_cudnn)
    monkeypatch.setattr(wan.ResidualBlock, "forward", spy)
    monkeypatch.setattr(wan, "base", refuse)
    z = torch.randn(1, 4, 3, 3, 5)
    with torch.no_grad():
        y = vae.decode(z).sample
        want = ref.decode(z.double()).sample
    assert rel_err(y, want) <= TOL[torch.float32]
    assert y.is_contiguous() and y.shape == want.shape
    assert seen and all(seen), seen


@pytest.mark.parametrize("ft,fs,cin,cout", [(2, 2, 6, 3), (1, 2, 4, 4), (2, 2, 3, 6), (2, 1, 5, 5)])
@pytest.mark.parametrize("first", [False, True])
def test_add_dup_up_is_the_modules_shortcut(ft, fs, cin, cout, first):
    """Wan 2.2's up-block shortcut added in place in NDHWC equals the
    block's ``y + DupUp3D(x)`` exactly (a copy of values, one add), in and
    past the first chunk (which drops ``ft - 1`` frames), channel counts
    that repeat each input channel across sub-positions or spread them."""
    dup = dwan.DupUp3D(cin, cout, factor_t=ft, factor_s=fs)
    assert wan._dup_up(dup)
    g = torch.Generator().manual_seed(ft * 10 + fs + cin)
    for t in (1, 3):
        x = torch.randn(2, cin, t, 3, 5, generator=g).contiguous(memory_format=torch.channels_last_3d)
        tt = t * ft - (ft - 1 if first else 0)
        y = torch.randn(2, cout, tt, 3 * fs, 5 * fs, generator=g).contiguous(memory_format=torch.channels_last_3d)
        want = y + dup(x, first_chunk=first)
        got = wan.add_dup_up(y.clone(), x, dup, first)
        assert torch.equal(got, want)
    assert wan.dup_index(dup, x.device) is wan.dup_index(dup, x.device)  # kept with the module
    # A shape it does not expect: None (the block adds the module's own).
    assert wan.add_dup_up(y[:, :, :1].clone(), x, dup, first) is None or tt == 1


def _cached_step(conv, x, feat_cache, feat_idx):
    """A ComfyUI WanVAE decoder's causal conv step outside its blocks (conv1, the head's conv)."""
    idx = feat_idx[0]
    cache_x = x[:, :, -CACHE_T:].clone()
    if cache_x.shape[2] < 2 and feat_cache[idx] is not None:
        cache_x = torch.cat([feat_cache[idx][:, :, -1:], cache_x], dim=2)
    y = conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return y


class Up_ResidualBlock(nn.Module):
    """ComfyUI's Wan 2.2 up block contract: ``upsamples`` (residual blocks,
    then a resample where it upsamples) beside a ``DupUp3D`` shortcut."""

    def __init__(self, cin, cout, mult, t_up, up):
        super().__init__()
        self.avg_shortcut = dwan.DupUp3D(cin, cout, factor_t=2 if t_up else 1, factor_s=2) if up else None
        layers = [ResidualBlock(cin if i == 0 else cout, cout) for i in range(mult)]
        if up:
            layers.append(dwan.WanResample(cout, "upsample3d" if t_up else "upsample2d", upsample_out_dim=cout))
        self.upsamples = nn.Sequential(*layers)

    def forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):
        y = x
        for layer in self.upsamples:
            y = layer(y, feat_cache, feat_idx)
        return y if self.avg_shortcut is None else y + self.avg_shortcut(x, first_chunk)


class Decoder3d(nn.Module):
    """ComfyUI's WanVAE decoder contract: ``conv1``, ``middle``,
    ``upsamples``, a ``head`` ending in the causal conv."""

    def __init__(self, z, dims):
        super().__init__()
        self.conv1 = CausalConv3d(z, dims[0], 3, padding=1)
        self.middle = nn.Sequential(ResidualBlock(dims[0], dims[0]), ResidualBlock(dims[0], dims[0]))
        self.upsamples = nn.Sequential(Up_ResidualBlock(dims[0], dims[1], 2, True, True),
                                       Up_ResidualBlock(dims[1], dims[2], 2, False, True),
                                       Up_ResidualBlock(dims[2], dims[2], 1, False, False))
        self.head = nn.Sequential(RMS_norm(dims[2], images=False), nn.SiLU(), CausalConv3d(dims[2], 3, 3, padding=1))

    def forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):
        x = _cached_step(self.conv1, x, feat_cache, feat_idx)
        for layer in self.middle:
            x = layer(x, feat_cache, feat_idx)
        for layer in self.upsamples:
            x = layer(x, feat_cache, feat_idx, first_chunk)
        for layer in self.head:
            x = _cached_step(layer, x, feat_cache, feat_idx) if isinstance(layer, nn.Conv3d) else layer(x)
        return x


def test_comfy_style_wan22_decoder_runs_ndhwc_inside(exact_fp32, monkeypatch):
    """A ComfyUI-style Wan 2.2 decoder (conv1 / middle / upsamples / head;
    ``Up_ResidualBlock`` with DupUp3D shortcuts, in time and space and in
    space only) decoded chunk by chunk as ComfyUI's WanVAE does, first chunk
    flagged: the decoder recipe runs it NDHWC inside, the up blocks add their
    shortcut in place, no fused block falls back, and the frames, their
    values and the caller's layout are the unpatched decoder's."""
    dec = _seeded(Decoder3d(4, (8, 8, 4)), 11)
    ref = copy.deepcopy(dec).double()
    slots = sum(isinstance(m, nn.Conv3d) for m in dec.modules())
    report = conv_patch.apply(dec, filter_fn=lambda m, name: not isinstance(m, nn.Conv3d))
    assert report.fused[""].startswith("wan.Decoder3d")
    assert {k for k, v in report.fused.items() if v.startswith("wan.ResidualUpBlock")} == {
        "upsamples.0", "upsamples.1", "upsamples.2"}
    conv3d = nn.Conv3d.forward

    def like_cudnn(self, x):
        y = conv3d(self, x)
        cl = x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
        return y.contiguous(memory_format=torch.channels_last_3d) if cl else y

    def refuse(m, *a, **k):
        raise AssertionError(f"{type(m).__name__} ran its own forward")

    monkeypatch.setattr(nn.Conv3d, "forward", like_cudnn)
    monkeypatch.setattr(wan, "base", refuse)
    z = torch.randn(1, 4, 3, 3, 5, generator=torch.Generator().manual_seed(2))
    outs = []
    for model, zz in ((dec, z), (ref, z.double())):
        cache, frames = [None] * slots, []
        with torch.no_grad():
            for i in range(zz.shape[2]):
                frames.append(model(zz[:, :, i:i + 1], cache, [0], i == 0))
        outs.append(torch.cat(frames, 2))
    y, want = outs
    assert y.shape == want.shape == (1, 3, 1 + 2 * 2, 12, 20)
    assert rel_err(y, want) <= TOL[torch.float32] and y.is_contiguous()


def test_interleave_frames_is_the_blocks_stack():
    g = torch.Generator().manual_seed(5)
    for shape in ((2, 6, 3, 4, 5), (1, 6, 1, 4, 5)):  # (one frame of one sample: a view would do)
        y = torch.randn(shape, generator=g)
        b, c2, t, h, w = y.shape
        r = y.reshape(b, 2, c2 // 2, t, h, w)
        want = torch.stack((r[:, 0], r[:, 1]), 3).reshape(b, c2 // 2, t * 2, h, w)
        for fmt in (torch.contiguous_format, torch.channels_last_3d):
            z = wan.interleave_frames(y.contiguous(memory_format=fmt))
            assert torch.equal(z, want) and z.is_contiguous(memory_format=torch.channels_last_3d)


def test_decoder_and_resample_run_their_own_forward_without_kernels(monkeypatch):
    """Where no kernel may run (a CPU model without the interpreter), NDHWC
    would only add copies: the decoder and the resamples run their own
    forward (every fused block does there: no recipe's forward is called),
    and the decode is the unpatched one's exactly."""
    from conv_patch import target
    torch.manual_seed(3)
    cfg = dict(base_dim=4, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[True])
    vae = _seeded(diffusers.AutoencoderKLWan(**cfg), 4)
    ref = copy.deepcopy(vae)
    conv_patch.apply(vae, filter_fn=lambda m, name: not isinstance(m, nn.Conv3d))
    assert any(type(m).__name__ == "FusedWanDecoder3d" for m in vae.modules())
    monkeypatch.setattr(target, "interpreter_enabled", lambda: False)
    calls = []
    for recipe in (wan.DECODER, wan.RESAMPLE, wan.RESIDUAL, wan.RMS_NORM):
        monkeypatch.setattr(recipe, "forward", lambda m, *a, _r=recipe, **k: calls.append(_r.name))
    z = torch.randn(1, 4, 2, 3, 4)
    with torch.no_grad():
        y = vae.decode(z).sample
        assert torch.equal(y, ref.decode(z).sample)
    assert calls == []


@pytest.mark.gpu
def test_wan21_decode_ndhwc_inside_bf16_gpu(exact_fp32):
    """A Wan 2.1 decode (the default config, seeded weights) of 5 frames at
    480x832 in bf16: NDHWC inside, the table's Conv3d kernels taking the
    shapes it measured faster, the answer no further from the fp32 decode
    than 1.5x the unpatched bf16 decode's, handed back in NCDHW."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    vae32 = diffusers.AutoencoderKLWan().to(dev).eval()
    vae16 = copy.deepcopy(vae32).bfloat16()
    patched = copy.deepcopy(vae16)
    report = conv_patch.apply(patched)
    assert report.fused["decoder"].startswith("wan.Decoder3d")
    g = torch.Generator().manual_seed(1)
    z = torch.randn(1, 16, 2, 60, 104, generator=g).to(dev)
    with torch.no_grad():
        r32 = vae32.decode(z).sample
        r16 = vae16.decode(z.bfloat16()).sample
        y = patched.decode(z.bfloat16()).sample
    assert y.shape == r32.shape and y.is_contiguous()
    assert rel_err(y, r32) <= 1.5 * rel_err(r16, r32) + 1e-4
    routes = {state_of(m).last.label() for m in patched.modules() if state_of(m).last is not None}
    assert any(r.startswith("conv3d_tma") for r in routes), routes


def test_ndhwc_inside_only_where_measured(monkeypatch):
    """The decoder goes NDHWC where that was measured to pay: fp16/bf16 on a
    GPU whose table holds measured Conv3d calls (sm90's); an fp32 decode, a
    GPU nobody measured (sm80 reads the curated default) and a CPU without
    kernels keep the caller's layout; the interpreter (the tests) takes it."""
    from conv_patch.target import Target
    x16, x32 = torch.zeros(1, 2, 1, 2, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 1, 2, 2)
    assert wan._ndhwc_pays(x32) and wan._ndhwc_pays(x16)  # the interpreter
    for arch, kernels, want16 in (("sm90", True, True), ("sm80", True, False), ("cpu", False, False)):
        monkeypatch.setattr(wan, "target_for", lambda d, a=arch, k=kernels: Target(a, k))
        assert wan._ndhwc_pays(x16) is want16, arch
        assert not wan._ndhwc_pays(x32), arch
    assert not wan._ndhwc_pays(torch.zeros(1, 2, 2, 2))  # not a video tensor


def test_a_patched_vae_that_ran_deep_copies(exact_fp32):
    """A patched Wan VAE whose norms and convs hold plans (on a GPU their
    recorded launches hold Triton objects that cannot be copied: a lock
    stands in for them here) deep-copies (``convpatch verify`` times a copy),
    its copy without the plans and computing the same."""
    import threading
    torch.manual_seed(0)
    vae = _seeded(diffusers.AutoencoderKLWan(**WAN21_TINY), 4)
    conv_patch.apply(vae)
    z = torch.randn(1, 4, 2, 2, 2)
    with torch.no_grad():
        want = vae.decode(z).sample
    held = [m for m in vae.modules() if state_of(m).norm_plan is not None]
    assert held
    for m in vae.modules():
        if state_of(m).norm_plan is not None:
            state_of(m).norm_plan.program = threading.RLock()
        if state_of(m).plans:
            state_of(m).plans = {"k": threading.RLock()}
    twin = copy.deepcopy(vae)
    assert all(state_of(m).norm_plan is None and not state_of(m).plans for m in twin.modules())
    with torch.no_grad():
        assert rel_err(twin.decode(z).sample, want) <= TOL[torch.float32]


class WanVAE(nn.Module):
    """ComfyUI's WanVAE contract at its entry: ``decode(z)`` clears the
    caches, then runs the decoder one latent frame at a time."""

    def __init__(self, z, dims):
        super().__init__()
        self.decoder = Decoder3d(z, dims)
        self.slots = sum(isinstance(m, nn.Conv3d) for m in self.decoder.modules())

    def decode(self, z):
        self._feat_map = [None] * self.slots
        frames = []
        for i in range(z.shape[2]):
            frames.append(self.decoder(z[:, :, i:i + 1], self._feat_map, [0], i == 0))
        self._feat_map = None
        return torch.cat(frames, 2)


def test_comfy_style_wan_vae_compiles_ahead_at_its_first_decode(exact_fp32):
    """``apply`` hooks a ComfyUI-style WanVAE's ``decode`` (it has no
    ``encode``) to compile ahead at its first call; on the CPU no pass runs
    and the hook is gone after that call, whose frames are the unpatched
    VAE's."""
    from conv_patch.api.warmup import FirstMethodCall, first_pass_pending
    from conv_patch.recipes import catalog
    vae = _seeded(WanVAE(4, (8, 8, 4)), 12)
    ref = copy.deepcopy(vae)
    assert catalog.pass_methods(vae) == ("decode",)
    assert conv_patch.apply(vae).compile_ahead == [""] and isinstance(vae.__dict__.get("decode"), FirstMethodCall)
    z = torch.randn(1, 4, 3, 3, 5, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, want = vae.decode(z), ref.decode(z)
    assert not first_pass_pending(vae) and y.shape == want.shape and rel_err(y, want) <= TOL[torch.float32]
