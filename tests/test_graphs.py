"""PatchConfig(cuda_graphs=True / "auto"): the graph cache's rules (conv_patch/runtime/graphs.py).

On the CPU the cache's logic runs against a stand-in capture whose "replay"
re-runs the fused forward on the static inputs and copies the result into
the static outputs, as a graph replay writes them; the GPU tests capture and
replay real CUDA graphs."""

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.runtime import graphs
from conv_patch.tools import taesd
from conv_patch.runtime.state import state_of
from conv_patch.routing import costs
from _util import rel_err


class _Replay:
    def __init__(self, cap):
        self.cap = cap

    def replay(self):
        cap = self.cap
        out = cap.fn(*cap.sargs, **cap.skwargs)
        for s, t in zip([cap.out] if isinstance(cap.out, torch.Tensor) else cap.out,
                        [out] if isinstance(out, torch.Tensor) else out):
            s.copy_(t)


class FakeCaptured(graphs.Captured):
    def __init__(self, fn, args, kwargs):
        self.static = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                       for t in graphs._tensors(args, kwargs)]
        self._copy_in(args, kwargs)
        self.fn = fn
        self.sargs, self.skwargs = graphs._substitute(args, kwargs, iter(self.static))
        self.out = fn(*self.sargs, **self.skwargs)
        self.graph = _Replay(self)


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "_device_ok", lambda t: True)
    monkeypatch.setattr(graphs.GraphCache, "capture_cls", FakeCaptured)


def _chain(device, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Conv2d(5, 6, 3, padding=1), nn.SiLU(),
                         nn.Conv2d(6, 3, 1)).to(device).eval()


def _hw(key):
    """The height and width of a graph key's first tensor."""
    return next(e for e in key if isinstance(e, tuple) and e[:1] == ("T",))[1][2:]


def _x(seed, device, shape=(1, 3, 6, 7)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def test_apply_installs_graphs_on_outermost_fused_blocks_and_remove_drops_them(device):
    dec = taesd.seeded_(taesd.decoder(latent_channels=4, channels=8)).to(device).eval()
    report = conv_patch.apply(dec, config=conv_patch.PatchConfig(cuda_graphs=True, max_graphs=2))
    assert report.graphed == [""] and "graphed  <root>" in str(report)
    assert graphs.cache_of(dec).max_graphs == 2
    assert all(graphs.cache_of(m) is None for m in list(dec.modules())[1:])  # inner fused blocks: none
    twin = copy.deepcopy(dec)
    assert graphs.cache_of(twin) is not graphs.cache_of(dec) and not graphs.cache_of(twin).graphs
    assert graphs.cache_of(pickle.loads(pickle.dumps(dec))) is not None
    conv_patch.remove(dec)
    assert graphs.cache_of(dec) is None and state_of(dec).graphs is None


def test_config_is_checked():
    m = _chain("cpu")
    for bad, err in [(dict(cuda_graphs=1), TypeError), (dict(cuda_graphs="on"), TypeError),
                     (dict(cuda_graphs=True, max_graphs=0), ValueError),
                     (dict(cuda_graphs=True, max_graphs=True), ValueError)]:
        with pytest.raises(err):
            conv_patch.apply(m, config=conv_patch.PatchConfig(**bad))
    with pytest.raises(ValueError, match="recipes"):
        conv_patch.apply(m, config=conv_patch.PatchConfig(cuda_graphs=True), recipes=False)
    assert not any(conv_patch.is_patched(c) for c in m.modules())  # an error leaves the model as it was
    assert conv_patch.PatchConfig().cuda_graphs == "auto"
    assert not conv_patch.apply(_chain("cpu"), recipes=False).graphed  # "auto" without recipes: nothing fused


def _tiny_vae():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                                     latent_channels=4).eval()


def test_auto_graphs_the_host_bound_stacks_only():
    """The default, ``cuda_graphs="auto"``: the tiny autoencoders' stacks and
    the compact net, not a plain conv chain, a VAE decoder or a UNet; the
    passthrough stays installed for the rest."""
    diffusers = pytest.importorskip("diffusers")
    dec = taesd.seeded_(taesd.decoder(latent_channels=4, channels=8)).eval()
    report = conv_patch.apply(dec)
    assert report.graphed == [""] and graphs.cache_of(dec).auto and report.passthrough == [""]
    vae = _tiny_vae()
    report = conv_patch.apply(vae)
    assert report.graphed == ["decoder.layers"] and report.passthrough == [""]
    assert graphs.cache_of(vae.decoder.layers).auto
    assert all(graphs.cache_of(b) is None for b in vae.decoder.layers)  # inside the stack: none
    explicit = _tiny_vae()
    report = conv_patch.apply(explicit, config=conv_patch.PatchConfig(cuda_graphs=True))
    assert "decoder.layers" in report.graphed and not graphs.cache_of(explicit.decoder.layers).auto
    assert not report.passthrough
    assert not conv_patch.apply(_tiny_vae(), config=conv_patch.PatchConfig(cuda_graphs=False)).graphed
    for other in (_chain("cpu"),
                  diffusers.AutoencoderKL(block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1,
                                          down_block_types=("DownEncoderBlock2D",) * 2,
                                          up_block_types=("UpDecoderBlock2D",) * 2),
                  diffusers.UNet2DModel(block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1,
                                        down_block_types=("DownBlock2D",) * 2, up_block_types=("UpBlock2D",) * 2)):
        report = conv_patch.apply(other)
        assert report.fused and not report.graphed


class SizedCaptured(FakeCaptured):
    """A stand-in capture whose pool is as large as its input's elements in MiB."""

    def __init__(self, fn, args, kwargs):
        super().__init__(fn, args, kwargs)
        self.pool_bytes = args[0].numel() << 20


def _short_taesd_decoder(device) -> nn.Sequential:
    """A TAESD decoder's stack cut to one block a level (a host-bound stack,
    graphed under "auto", in a fifth of the interpreter's time)."""
    c = 8
    return taesd.seeded_(nn.Sequential(
        taesd.Clamp(), taesd.conv3(4, c), nn.ReLU(), taesd.Block(c, c, True),
        nn.Upsample(scale_factor=2), taesd.conv3(c, c, bias=False), taesd.Block(c, c), taesd.conv3(c, 3),
    )).to(device).eval()


def test_auto_keeps_graph_memory_within_its_bound(device, exact_fp32, fake_graphs, monkeypatch):
    monkeypatch.setattr(graphs.GraphCache, "capture_cls", SizedCaptured)
    monkeypatch.setattr(graphs, "AUTO_POOL_BYTES", 36 << 20)
    dec = _short_taesd_decoder(device)
    ref = copy.deepcopy(dec)
    conv_patch.apply(dec)
    cache = graphs.cache_of(dec)
    sizes = [(1, 4, 2, 2), (1, 4, 3, 3), (1, 4, 4, 4), (1, 4, 2, 2)]  # 16, 36, 64 MiB "pools"
    with torch.no_grad():
        for shape in sizes:
            for i in range(3):
                y = dec(_x(i, device, shape))
                assert rel_err(y, ref(_x(i, device, shape))) <= 1e-5
        # 2x2 captured, 3x3 captured (2x2 dropped: 52 > 36), 4x4 alone over
        # the bound: eager; 2x2 captured again (3x3 dropped).
        assert cache.stats["too_large"] == 1 and cache.stats["captures"] == 3
        held = [_hw(k) for k, v in cache.graphs.items() if v is not graphs._EAGER]
        assert held == [(2, 2)]
        before = cache.stats["replays"]
        dec(_x(0, device, (1, 4, 4, 4)))
        assert cache.stats["replays"] == before  # the key over the bound stays eager
    # The bound of an explicit cuda_graphs=True: max_graphs only.
    twin = _short_taesd_decoder(device)
    conv_patch.apply(twin, config=conv_patch.PatchConfig(cuda_graphs=True))
    with torch.no_grad():
        for shape in sizes[:3]:
            for i in range(2):
                twin(_x(i, device, shape))
    assert graphs.cache_of(twin).stats["captures"] == 3 and len(graphs.cache_of(twin).graphs) == 3


def test_auto_graphs_an_autoencoder_tiny_decode_with_the_passthrough_on(device, exact_fp32, fake_graphs):
    """A pipeline's ``vae.decode`` under the default config: the decoder's
    stack replays, the passthrough learns around it, the values are the
    unpatched model's."""
    vae = _tiny_vae().to(device)
    ref = copy.deepcopy(vae)
    conv_patch.apply(vae)
    cache = graphs.cache_of(vae.decoder.layers)
    z = _x(5, device, (1, 4, 3, 5))
    with torch.no_grad():
        for _ in range(5):
            y = vae.decode(z).sample
            assert rel_err(y, ref.decode(z).sample) <= 1e-5
    assert cache.stats["captures"] == 1 and cache.stats["replays"] == 4


def test_a_call_while_another_thread_replays_runs_eagerly_and_replays_count_as_work(device, exact_fp32,
                                                                                      fake_graphs):
    from conv_patch.work import Work
    m = _chain(device)
    ref = copy.deepcopy(m)
    conv_patch.apply(m, config=conv_patch.PatchConfig(cuda_graphs=True))
    cache = graphs.cache_of(m)
    x = _x(2, device)
    with torch.no_grad():
        m(x), m(x)
        n = Work.n
        m(x)
        assert Work.n > n and cache.stats["replays"] == 2  # (the capturing call replays too)
        assert cache.lock.acquire(blocking=False)  # another thread is in the graphs
        try:
            eager = cache.stats["eager"]
            y = m(x)
        finally:
            cache.lock.release()
        assert cache.stats["eager"] == eager + 1 and cache.stats["replays"] == 2
        assert rel_err(y, ref(x)) <= 1e-5


def test_second_call_captures_then_replays_fresh_outputs(device, exact_fp32, fake_graphs):
    m = _chain(device)
    ref = copy.deepcopy(m)
    conv_patch.apply(m, config=conv_patch.PatchConfig(cuda_graphs=True))
    cache = graphs.cache_of(m)
    with torch.no_grad():
        outs = [m(_x(i, device)) for i in range(4)]
        assert cache.stats == {"captures": 1, "replays": 3, "eager": 1, "too_large": 0}
        for i, y in enumerate(outs):  # each result kept its own values: no aliasing of static outputs
            assert rel_err(y, ref(_x(i, device))) <= 1e-5
        assert outs[2].data_ptr() != outs[3].data_ptr()
        m(_x(0, device, (1, 3, 5, 5)))  # a new shape: once eager, not captured
        assert cache.stats["captures"] == 1 and len(cache.graphs) == 1


def test_lru_bound_and_what_runs_eagerly(device, exact_fp32, fake_graphs):
    m = _chain(device)
    conv_patch.apply(m, config=conv_patch.PatchConfig(cuda_graphs=True, max_graphs=2))
    cache = graphs.cache_of(m)
    with torch.no_grad():
        for hw in (5, 6, 7, 6):
            for _ in range(2):
                m(_x(0, device, (1, 3, hw, hw)))
    assert cache.stats["captures"] == 3 and len(cache.graphs) == 2
    assert [_hw(k) for k in cache.graphs] == [(7, 7), (6, 6)]  # 5x5, least recently used, dropped
    before = dict(cache.stats)
    for _ in range(2):
        m(_x(0, device, (1, 3, 6, 6)))  # grad mode on and the weights require grad: autograd records it
    assert cache.stats["eager"] == before["eager"] + 2 and cache.stats["replays"] == before["replays"]


def test_weight_changes_recapture_and_a_streaming_module_stops_being_graphed(device, exact_fp32, fake_graphs):
    m = _chain(device)
    conv_patch.apply(m, config=conv_patch.PatchConfig(cuda_graphs=True))
    cache = graphs.cache_of(m)
    x = _x(3, device)
    with torch.no_grad():
        m(x), m(x)
        m[0].weight.mul_(0.5)  # in place: same storage, the graph reads it
        m(x)
        assert cache.stats["captures"] == 1 and cache.stats["replays"] == 2
        m[2].weight = nn.Parameter(m[2].weight.detach().clone())  # a new storage: recapture
        m(x)
        assert cache.recaptures == 1 and cache.stats["captures"] == 2
        m(x)  # stable again: an occasional change is not streaming
        assert cache.recaptures == 0 and cache.stats["replays"] == 4
        for i in range(graphs.MAX_RECAPTURES):
            m[2].weight = nn.Parameter(m[2].weight.detach().clone())
            m(x)
            assert cache.recaptures == i + 1 and cache.stats["captures"] == 3 + i
        m[2].register_forward_hook(lambda *a: None)
        with pytest.warns(RuntimeWarning, match="CUDA graphs off"):
            y = m(x)
        assert cache.disabled and not cache.graphs
        # Under "auto" (which nobody asked for) the same stop is silent.
        quiet = graphs.GraphCache(auto=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            quiet._disable("streamed")
        assert quiet.disabled == "streamed"
        unpatched = conv_patch.remove(m) and m
        assert rel_err(y, unpatched(x)) <= 1e-5


def test_failed_capture_warns_once_and_runs_eagerly(device, exact_fp32, fake_graphs, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")
    m = _chain(device)
    conv_patch.apply(m, config=conv_patch.PatchConfig(cuda_graphs=True))
    monkeypatch.setattr(graphs.GraphCache, "capture_cls", broken)
    x = _x(1, device)
    with torch.no_grad():
        m(x)
        with pytest.warns(RuntimeWarning, match="capture failed"):
            y = m(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(m(x), y)
    assert graphs.cache_of(m).stats["captures"] == 0


def test_a_key_holds_autocast_and_tf32(fake_graphs, monkeypatch):
    """A call under autocast, or with the fp32 convs' TF32 switch flipped,
    is another key: its launches are not the recorded ones."""
    from conv_patch.target import conv_tf32
    x = torch.zeros(1, 3, 4, 4)
    with conv_tf32(False):
        plain = graphs.call_key((x,), {})
        assert graphs.call_key((x,), {}) == plain
    with conv_tf32(True):
        assert graphs.call_key((x,), {}) != plain
    with conv_tf32(False):
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: True)
        monkeypatch.setattr(torch, "get_autocast_dtype", lambda *a: torch.bfloat16)
        assert graphs.call_key((x,), {}) != plain


def test_unhashable_arguments_and_cpu_tensors_are_not_graphed(device, exact_fp32):
    assert graphs.call_key((torch.zeros(1),), {}) is None  # a CPU tensor: real CUDA graphs only
    assert graphs.call_key((1, [2]), {}) is None
    assert graphs.call_key((1, "a"), {"b": None}) is not None
    m = _chain(device)
    conv_patch.apply(m, config=conv_patch.PatchConfig(cuda_graphs=True))
    with torch.no_grad():
        for _ in range(3):
            m(_x(0, device))
    assert graphs.cache_of(m).stats["captures"] == (1 if device.type == "cuda" else 0)


# -- real CUDA graphs ----------------------------------------------------------
@pytest.fixture
def same_upsample_form(monkeypatch):
    """A capture always folds the upsample into four 2x2 convs
    (dispatch.subpixel_pays) and routes by GPU time alone (dispatch.weigh); the
    eager twin runs as on the graph path here, so that both take the same
    routes and round the same way."""
    from conv_patch.runtime import pack
    monkeypatch.setattr(costs, "SUBPIXEL_MIN_MACS", 0)
    monkeypatch.setattr(pack, "GRAPH_PATH", True)


@pytest.mark.gpu
def test_graphed_flux_config_decode_matches_eager_and_sees_weight_updates(same_upsample_form):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(128, 256, 256), layers_per_block=1, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        use_quant_conv=False, use_post_quant_conv=False).cuda().eval().to(torch.bfloat16)
    eager = copy.deepcopy(vae)
    conv_patch.apply(eager)
    report = conv_patch.apply(vae, config=conv_patch.PatchConfig(cuda_graphs=True))
    assert set(report.graphed) == {"encoder", "decoder"}
    cache = graphs.cache_of(vae.decoder)
    zs = [torch.randn(1, 16, 32, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        outs = [vae.decode(z).sample for z in zs]
        assert cache.stats["captures"] == 1 and cache.stats["replays"] == 2
        for z, y in zip(zs, outs):
            ref = eager.decode(z).sample
            assert y.is_contiguous() and rel_err(y, ref) <= 1e-3
        # An in-place update (a LoRA merge writes .data) reaches the replay:
        # through a pack (conv_out, a resnet conv1 whose bias GroupNorm adds)
        # and through the upsampler's subpixel fold.
        for m in (vae, eager):
            m.decoder.conv_out.weight.data.mul_(-0.5)
            m.decoder.up_blocks[0].upsamplers[0].conv.weight.data.mul_(-0.7)
            m.decoder.up_blocks[1].resnets[0].conv1.weight.data.mul_(1.3)
            m.decoder.up_blocks[1].resnets[0].conv1.bias.data.add_(0.5)
        assert rel_err(vae.decode(zs[0]).sample, eager.decode(zs[0]).sample) <= 2e-3
        assert cache.stats["captures"] == 1
        img = torch.randn(1, 3, 128, 128, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            lat = vae.encode(img).latent_dist.mean
        assert rel_err(lat, eager.encode(img).latent_dist.mean) <= 2e-3
        assert graphs.cache_of(vae.encoder).stats["replays"] == 2


@pytest.mark.gpu
def test_graphed_taesd_decoder_recaptures_when_moved(same_upsample_form):
    dec = taesd.seeded_(taesd.decoder(16, 32)).to("cuda", torch.float16).eval()
    eager = copy.deepcopy(dec)
    conv_patch.apply(eager)
    conv_patch.apply(dec, config=conv_patch.PatchConfig(cuda_graphs=True))
    x = torch.randn(2, 16, 24, 20, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        for _ in range(3):
            y = dec(x)
        assert rel_err(y, eager(x)) <= 2e-3
        dec.to(torch.bfloat16), eager.to(torch.bfloat16)
        for _ in range(2):
            y = dec(x.bfloat16())
        assert rel_err(y, eager(x.bfloat16())) <= 1e-3
    cache = graphs.cache_of(dec)
    # One recapture for the move; the stable call after it clears the count
    # of consecutive changes (graphs are only given up on for streaming).
    assert cache.stats["captures"] == 2 and cache.recaptures == 0 and cache.disabled is None


@pytest.mark.gpu
def test_auto_graphs_a_taesd_decoder_within_its_bound_on_any_stream(same_upsample_form):
    """The default config on a GPU: a TAESD decoder captures at its second
    call, its pool is measured and within the bound, and a replay on another
    stream waits for the last one's outputs before it overwrites the static
    input."""
    dec = taesd.seeded_(taesd.decoder(16, 32)).to("cuda", torch.float16).eval()
    eager = copy.deepcopy(dec)
    conv_patch.apply(eager, config=conv_patch.PatchConfig(cuda_graphs=False))
    assert conv_patch.apply(dec).graphed == [""]
    xs = [torch.randn(1, 16, 24, 20, device="cuda", dtype=torch.float16) for _ in range(4)]
    with torch.no_grad():
        ys = [dec(x) for x in xs]
        cache = graphs.cache_of(dec)
        assert cache.auto and cache.stats["captures"] == 1 and cache.stats["replays"] == 3
        (entry,) = cache.graphs.values()
        assert 0 < entry.pool_bytes <= graphs.auto_pool_bytes(xs[0].device)
        for x, y in zip(xs, ys):
            assert rel_err(y, eager(x)) <= 2e-3
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = dec(xs[0])
            second = dec(xs[1])  # same static input, its copy ordered after the first's clone
        torch.cuda.current_stream().wait_stream(side)
        third = dec(xs[2])  # back on the default stream: waits for the side stream's last replay
        assert rel_err(first, eager(xs[0])) <= 2e-3 and rel_err(second, eager(xs[1])) <= 2e-3
        assert rel_err(third, eager(xs[2])) <= 2e-3


def test_capture_is_preceded_by_a_warm_up_call_down_the_capture_path(monkeypatch):
    """The eager call before a capture takes the capture's path (pack kernel,
    upsample folded), so that no kernel is first launched inside it."""
    import contextlib

    from conv_patch.runtime import pack
    seen = []

    class Graph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def fake_graph(g, capture_error_mode=None):
        seen.append("capture")
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    x = torch.randn(2, 3)

    def fn(t):
        seen.append(("call", pack.GRAPH_PATH))
        return t * 2

    cap = graphs.Captured(fn, (x,), {})
    assert seen == [("call", True), "capture", ("call", False)]
    assert not pack.GRAPH_PATH and torch.equal(cap.out, x * 2)


def test_a_capture_reserves_the_warm_up_calls_live_peak(monkeypatch):
    """The reserve a capture takes up front: the warm-up call's live peak as
    read after each op (no allocator statistic reset), a 16th more (or
    another of RESERVE_FACTORS), rounded as the allocator rounds a large
    segment, at least 10 MiB (a smaller request would get a 20 MiB
    segment); none for small blocks only."""
    assert graphs.reserve_for(0) is None and graphs.reserve_for(900 << 10) is None
    assert graphs.reserve_for(2 << 20) == graphs.reserve_for(9 << 20) == 10 << 20
    assert graphs.reserve_for(12 << 20) == 14 << 20  # 12.75 MiB, rounded up to 2 MiB
    assert graphs.reserve_for(32 << 20) == 34 << 20
    assert graphs.reserve_for(32 << 20, 1.5) == 48 << 20 and graphs.reserve_for(900 << 10, 1.5) is None
    # What is tried: each factor without what the warm-up kept and with it,
    # then none; a peak over the bound (a big VAE graphed on request) only
    # as it comes.
    mib = 1 << 20
    assert graphs.RESERVE_FACTORS == (17 / 16, 5 / 4, 3 / 2)
    assert graphs.reserve_tries(40 * mib, 0, 1024 * mib) == [44 * mib, 50 * mib, 60 * mib, None]
    assert graphs.reserve_tries(40 * mib, 8 * mib, 1024 * mib) == [
        34 * mib, 40 * mib, 44 * mib, 48 * mib, 50 * mib, 60 * mib, None]
    assert graphs.reserve_tries(2048 * mib, 0, 1024 * mib) == [None]
    assert graphs.reserve_tries(512 << 10, 0, 1024 * mib) == [None]
    # What the mode reads: a stand-in for the allocator's count of live bytes.
    live = [100]
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: live[0])

    def grow(t, n):
        live[0] += n
        return t + 1

    with graphs.LivePeak(torch.device("cuda", 0)) as seen:
        x = torch.zeros(3)
        for n in (5, 7, -10, 4):  # live above entry: 5, 12, 2, 6
            live[0] += n
            x = x + 1  # an op: the mode reads the count after it
    assert seen.peak == 12 and seen.base == 100 and torch.equal(x, torch.full((3,), 4.0))


@pytest.mark.gpu
def test_a_graphs_pool_is_its_calls_live_peak_not_the_allocators_rounding(monkeypatch):
    """8 MiB activations, five alive at the peak: captured as they come,
    each pair gets a 20 MiB segment (60 MiB); with the reserve the pool is
    the live peak and a 16th, rounded (44 MiB), and the larger reserves
    (no smaller than that pool) are not captured. The capture without the
    reserve is made too and the smaller pool kept: where the capture makes
    a block the warm-up call did not, the reserve may not be the smaller.
    Each replays what the call computes."""
    n = 4 << 20  # 8 MiB of fp16

    def fn(x):
        a, b, c = x * 2, x * 3, x * 4
        return a + b + c

    def lopsided(x):
        extra = None
        if torch.cuda.is_current_stream_capturing():
            extra = torch.empty(30 << 20, dtype=torch.uint8, device=x.device)
            extra.zero_()
        return fn(x)

    records = []
    record = graphs.Captured._record
    monkeypatch.setattr(graphs.Captured, "_record", lambda self, *a: records.append(a[-1]) or record(self, *a))
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    pools = {}
    for f in (fn, lopsided):
        for reserving in (False, True):
            with monkeypatch.context() as m:
                if not reserving:
                    m.setattr(graphs, "reserve_for", lambda peak, factor=1.0: None)
                records.clear()
                cap = graphs.Captured(f, (x,), {})
                pools[f.__name__, reserving] = cap.pool_bytes
                y = torch.randn_like(x)
                out = cap((y,), {})
                torch.cuda.synchronize()
                assert torch.equal(out, fn(y))
                if not reserving:
                    assert records == [None]
                elif f is fn:
                    assert records == [44 << 20, None]  # (50 and 60 MiB: no smaller than its pool)
                else:
                    assert records[0] == 44 << 20 and records[-1] is None and records == sorted(
                        records[:-1]) + [None]
    assert pools["fn", True] <= (46 << 20) < pools["fn", False]
    assert pools["lopsided", True] <= pools["lopsided", False]


def test_a_fused_forward_computes_the_same_under_the_live_peak_mode(device, exact_fp32, monkeypatch):
    """The warm-up call before a capture runs under ``LivePeak``, a Python
    dispatch mode: the fused forward (recipes, planned convs, GroupNorm and
    conv kernels) computes there what it computes without it, and the mode
    reads the allocator's count after its ops."""
    reads = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: reads.append(1) or 0)
    dec = _short_taesd_decoder(device)
    conv_patch.apply(dec, config=conv_patch.PatchConfig(cuda_graphs=False))
    x = _x(0, device, (1, 4, 5, 6))
    with torch.no_grad():
        want = dec(x)
        with graphs.LivePeak(torch.device("cuda", 0)):
            got = dec(x)
    assert len(reads) > 10 and torch.equal(got, want)
