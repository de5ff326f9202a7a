"""conv_patch.parallel: decode and encode in row bands, in one process
(sequential bands, staged or not, the PatchConfig budget hook) and across
torch.distributed ranks (gloo, processes spawned here), against the unbanded
model. Tiny configs with odd sizes; the CPU runs PyTorch except in the one
patched case, which runs the kernels under the interpreter."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import conv_patch
from _util import rel_err
from conv_patch import parallel
from conv_patch.parallel import geometry, stats
from conv_patch.runtime.state import state_of
from conv_patch.call import Call

diffusers = pytest.importorskip("diffusers")

HERE = Path(__file__).resolve().parent


def _vae(device="cpu", seed=0):
    torch.manual_seed(seed)
    return diffusers.AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
        norm_num_groups=4, sample_size=16).to(device).eval()


@pytest.fixture(scope="module")
def vae():
    return _vae()


@pytest.mark.parametrize("shape,bands", [((1, 4, 7, 9), 2), ((1, 4, 7, 9), 3), ((1, 4, 7, 9), 4),
                                         ((2, 4, 11, 6), 3)])
def test_decode_in_bands_matches_unbanded(vae, shape, bands):
    z = torch.randn(*shape, generator=torch.Generator().manual_seed(bands))
    with torch.no_grad():
        ref = vae.decode(z).sample
        y, report = parallel.decode_in_bands(vae, z, bands=bands, return_report=True)
    assert rel_err(y, ref) <= 1e-5
    assert report.mode == "bands" and report.bands == bands and not report.staged
    assert sum(report.rows) == shape[2] and max(report.rows) - min(report.rows) <= 1


def test_staged_bands_and_encode_match_unbanded(vae):
    g = torch.Generator().manual_seed(3)
    z, x = torch.randn(1, 4, 7, 9, generator=g), torch.randn(2, 3, 15, 13, generator=g)
    with torch.no_grad():
        ref = vae.decode(z).sample
        y, report = parallel.decode_in_bands(vae, z, bands=3, staged=True, return_report=True)
        assert report.staged and rel_err(y, ref) <= 1e-5
        assert report.staged_layers > 0 and report.device_layers == 0  # no budget: every layer staged
        post = vae.encode(x).latent_dist
        for bands in (2, 3):  # 15 rows: the last band ends on half a row pair
            d = parallel.encode_in_bands(vae, x, bands=bands)
            assert type(d).__name__ == "DiagonalGaussianDistribution"
            assert rel_err(d.parameters, post.parameters) <= 1e-5


def test_ldm_decoder_and_encoder_in_bands():
    ldm = pytest.importorskip("ldm.modules.diffusionmodules.model")
    torch.manual_seed(0)
    # attention at the 8x8 level too: a Whole step away from the latent level.
    cfg = dict(ch=32, out_ch=3, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=[8], in_channels=3,
               resolution=16, z_channels=4)
    enc, dec = ldm.Encoder(double_z=True, **cfg).eval(), ldm.Decoder(**cfg).eval()
    g = torch.Generator().manual_seed(0)
    z, x = torch.randn(1, 4, 5, 6, generator=g), torch.randn(1, 3, 13, 10, generator=g)
    with torch.no_grad():
        assert rel_err(parallel.decode_in_bands(dec, z, bands=2), dec(z)) <= 1e-5
        assert rel_err(parallel.encode_in_bands(enc, x, bands=3), enc(x)) <= 1e-5


def test_a_band_thinner_than_its_halo_is_refused_and_a_budget_picks_fewer(vae):
    z = torch.randn(1, 4, 3, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="thinner than its 1-row halo"):
        parallel.decode_in_bands(vae, z, bands=4)
    with pytest.raises(ValueError, match="thinner than its"):
        # band 2 (rows 2..4) reading row 0: past its one-row neighbour band.
        geometry.check_halo(geometry.Level((0, 1, 2, 5)), [geometry.Window(0, 2, 1, 0), geometry.Window(0, 3, 0, 0),
                                                           geometry.Window(0, 5, 0, 1)])
    # A budget nothing fits: one band per latent row (never thinner), said so.
    with torch.no_grad():
        y, report = parallel.decode_in_bands(vae, z, max_activation_gib=1e-9, return_report=True)
        assert report.bands == 3 and report.staged and report.over_budget
        assert rel_err(y, vae.decode(z).sample) <= 1e-5
        # No budget on the CPU: the plain decode.
        assert parallel.decode_in_bands(vae, z, return_report=True)[1].mode == "plain"


def test_unsupported_calls_fall_back_or_raise(vae):
    z = torch.randn(1, 4, 4, 4)
    y, report = parallel.decode_in_bands(vae, z, bands=2, return_report=True)  # autograd on
    assert report.mode == "plain" and "autograd" in report.fallback and y.requires_grad
    h = vae.decoder.up_blocks[0].resnets[0].register_forward_hook(lambda *a: None)
    try:
        with torch.no_grad():
            report = parallel.decode_in_bands(vae, z, bands=2, return_report=True)[1]
        assert report.mode == "plain" and "hooks" in report.fallback
    finally:
        h.remove()
    with torch.no_grad(), pytest.raises(parallel.UnsupportedModel, match="not a VAE Decoder"):
        parallel.decode_in_bands(torch.nn.Sequential(torch.nn.Conv2d(4, 3, 3, padding=1)), z, bands=2)
    # No process group: the ordinary decode.
    with torch.no_grad():
        y, report = parallel.decode(vae, z, return_report=True)
        assert report.mode == "plain" and torch.equal(y, vae.decode(z).sample)


def test_staging_pool_reuses_exact_size_buffers_and_refuses_what_the_host_lacks(monkeypatch):
    """A staged band's host tensor lies in a buffer of its own size (not a
    power of two), NCHW or channels_last; a dropped tensor's buffer serves
    the next band of about its size; a buffer the host's available memory
    cannot hold is a one-line MemoryError, not a swap."""
    from conv_patch.parallel import staging
    pool = staging.HostStaging(pinned=False)
    a = pool.take((1, 3, 5, 7), torch.bfloat16, channels_last=True)
    assert a.shape == (1, 3, 5, 7) and a.is_contiguous(memory_format=torch.channels_last)
    assert pool.held_bytes == 3 * 5 * 7 * 2 and pool.peak_bytes == pool.held_bytes
    ptr = a.data_ptr()
    a.copy_(torch.randn(1, 3, 5, 7))
    del a
    b = pool.take((1, 3, 5, 6), torch.bfloat16, channels_last=False)  # 180 bytes in the 210-byte buffer
    assert b.data_ptr() == ptr and b.is_contiguous() and pool.held_bytes == 210
    c = pool.take((1, 3, 5, 7), torch.bfloat16, channels_last=False)  # b still held: a new buffer
    assert c.data_ptr() != ptr and pool.held_bytes == 420 and pool.peak_bytes == 420
    del b, c
    small = pool.take((1, 1, 1, 10), torch.float32, channels_last=False)  # 40 bytes: no 210-byte buffer
    assert pool.held_bytes == 460 and small.numel() == 10
    monkeypatch.setattr(staging, "available_host_bytes", lambda: staging.HOST_RESERVE + 1000)
    with pytest.raises(MemoryError, match=r"bands: staging a band needs .* GiB more host memory"):
        pool.take((1, 8, 64, 64), torch.float32, channels_last=False)
    pool.release()
    assert pool.held_bytes == 0


def test_staged_bands_take_statistics_as_they_are_made(vae, monkeypatch):
    """A staged layer's GroupNorm moments are taken of each band on the
    device as it is made, before it goes to the host: the next layer's
    statistics read nothing back from the staged copies. The report says
    what was staged."""
    from conv_patch.parallel import staging, walker
    pool = staging.pool_for(torch.device("cpu"))
    seen = []
    real = walker.band_moments

    def spy(band, groups, use_kernels=False):
        # Whether the band read lies in a staged (host pool) buffer now.
        seen.append(band.untyped_storage().data_ptr() in {b.data_ptr() for b in pool._all})
        return real(band, groups, use_kernels)

    monkeypatch.setattr(walker, "band_moments", spy)
    z = torch.randn(1, 4, 7, 9, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = vae.decode(z).sample
        y, report = parallel.decode_in_bands(vae, z, bands=3, staged=True, return_report=True)
    assert rel_err(y, ref) <= 1e-5 and seen and not any(seen)
    assert report.staged_gib > 0 and report.host_peak_gib > 0 and report.pin_seconds >= 0
    assert report.host_peak_gib <= report.staged_gib


def test_kernel_band_moments_match_float64(exact_fp32):
    """The GroupNorm kernels' statistics pass as a band's moments (the path
    of half-precision bands where the kernels run), NCHW and NHWC, a large
    mean and an outlier: merged over bands, the float64 statistics of the
    whole tensor to fp32 accuracy."""
    g = torch.Generator().manual_seed(1)
    x = (1000 + 2 * torch.randn(2, 12, 13, 7, generator=g)).bfloat16()
    x[1, 5, 9, 3] = 9000
    var64, mean64 = torch.var_mean(x.double().view(2, 3, -1), dim=2, correction=0)
    for fmt in (torch.contiguous_format, torch.channels_last):
        xf = x.contiguous(memory_format=fmt)
        bands = [xf[:, :, a:b].contiguous(memory_format=fmt) for a, b in ((0, 5), (5, 6), (6, 13))]
        got = [stats.kernel_moments(b, 3) for b in bands]
        assert all(m is not None for m in got)
        count, mean, m2 = stats.merge(got)
        assert torch.equal(count, torch.full_like(count, 4 * 13 * 7))
        assert torch.allclose(mean, mean64, rtol=1e-6) and torch.allclose(m2 / count, var64, rtol=1e-4)
    assert stats.kernel_moments(x.float(), 3) is None  # fp32 bands keep the float64 chunks


def test_group_norm_moments_exact_with_large_mean_and_outlier():
    g = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(2, 8, 13, 5, generator=g)
    x[1, 3, 7, 2] = 3e4
    norm = torch.nn.GroupNorm(4, 8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    edges = [0, 4, 5, 13]  # bands of 4, 1 and 8 rows
    parts = [stats.band_moments(x[:, :, a:b], 4) for a, b in zip(edges[:-1], edges[1:])]
    count, mean, m2 = stats.merge(parts)
    var64, mean64 = torch.var_mean(x.double().view(2, 4, -1), dim=2, correction=0)
    assert torch.equal(count, torch.full_like(count, 2 * 13 * 5))
    assert torch.allclose(mean, mean64, rtol=1e-13) and torch.allclose(m2 / count, var64, rtol=1e-10)
    # A raw sum / sum of squares in fp32 loses this variance entirely.
    raw = (x.view(2, 4, -1) ** 2).mean(2) - x.view(2, 4, -1).mean(2) ** 2
    assert (raw - var64.float()).abs().max() > 1
    # Half-precision bands: fp32 accumulation over the band, no float64 copy.
    xh = (100 + 3 * torch.randn(1, 8, 21, 6, generator=g)).bfloat16()
    parts = [stats.band_moments(xh[:, :, a:b], 4) for a, b in ((0, 10), (10, 21))]
    _, hmean, hm2 = stats.merge(parts)
    v64, m64 = torch.var_mean(xh.double().view(1, 4, -1), dim=2, correction=0)
    assert torch.allclose(hmean, m64, rtol=1e-6) and torch.allclose(hm2 / (2 * 21 * 6), v64, rtol=1e-4)
    ss = stats.scale_shift(torch.stack([count, mean, m2]), norm, 8)
    ref = F.silu(F.group_norm(x.double(), 4, norm.weight.double(), norm.bias.double(), 1e-6))
    y = stats.normalise(x[:, :, 4:9], ss, "silu", use_kernels=False)
    assert rel_err(y, ref[:, :, 4:9]) <= 1e-5


def test_dispatch_padding_replaces_the_modules_own(exact_fp32):
    """A patched 3x3 padding-1 conv called with its own padding (a band's:
    zero rows only at the image edge) computes F.conv2d of the F.pad'ed
    band without the module's padding: on the kernels (fp32 under the
    interpreter), PyTorch's direct route (symmetric per axis) and the
    fallback with the F.pad (float64, which no kernel takes)."""
    from conv_patch.runtime import dispatch
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, 3, padding=1)
    model = torch.nn.Sequential(conv)
    conv_patch.apply(model, recipes=False)
    wrapper = model[0]
    x = torch.randn(1, 3, 9, 6)
    band = x[:, :, 2:7]  # a view: rows 2..6, halo included
    for dtype in (torch.float32, torch.float64):
        wrapper.to(dtype)
        xb = band.to(dtype)
        for pad in ((1, 1, 0, 0), (1, 1, 1, 0), (1, 1, 0, 1)):
            with torch.no_grad():
                y = dispatch.conv(wrapper, Call(xb, padding=pad))
                ref = F.conv2d(F.pad(xb, pad), wrapper.weight, wrapper.bias)
            assert y.shape == ref.shape and rel_err(y, ref) <= 1e-5, (dtype, pad)
        assert state_of(wrapper).last.is_kernel == (dtype == torch.float32)


def test_patched_decode_through_the_budget_hook_runs_the_kernels():
    """PatchConfig(max_activation_gib=...) on a patched VAE: a decode whose
    estimate exceeds the budget runs in bands (staged) through the patched
    convs (the interpreter's kernels), equal to the unpatched decode; and
    unstaged bands through the same kernels."""
    vae = _vae(seed=2)
    z = torch.randn(1, 4, 2, 3, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = vae.decode(z).sample
        conv_patch.apply(vae, config=conv_patch.PatchConfig(max_activation_gib=1e-9))
        try:
            y = vae.decode(z).sample
            report = parallel.last_report(vae)
            assert report.mode == "bands" and report.bands == 2 and report.staged and report.staged_layers
            assert rel_err(y, ref) <= 1e-5
            assert state_of(vae.decoder.up_blocks[1].resnets[0].conv2).last.is_kernel
            # Bands on the device: each band's conv reads a view of the layer
            # and writes its rows of the next through ``out``.
            y, report = parallel.decode_in_bands(vae, z, bands=2, return_report=True)
            assert not report.staged and rel_err(y, ref) <= 1e-5
        finally:
            conv_patch.remove(vae)
    assert state_of(vae.decoder).bands is None
    with pytest.raises(ValueError, match="max_activation_gib"):
        conv_patch.apply(vae, config=conv_patch.PatchConfig(max_activation_gib=0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_gloo_matches_single_process(tmp_path, world):
    """``world`` processes spawned here (gloo), one band each: every rank's
    ``gather="all"`` decode and encode equal the single-process model;
    ``gather=0`` gives the image on rank 0 and None elsewhere. A hang fails
    at the timeout instead of blocking the run."""
    pytest.importorskip("ldm.modules.diffusionmodules.model")
    sys.path.insert(0, str(HERE))
    import _parallel_worker as worker
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    procs = [subprocess.Popen([sys.executable, str(HERE / "_parallel_worker.py"), str(r), str(world), str(port),
                               str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
    vae = worker.tiny_vae()
    ref, moments = worker.reference(vae, *worker.inputs())
    for r in range(world):
        got = torch.load(tmp_path / f"{r}.pt")
        assert got["mode"] == "distributed" and len(got["rows"]) == world
        assert rel_err(got["all"], ref) <= 1e-5 and rel_err(got["enc"], moments) <= 1e-5
        assert (got["to0"] is None) == (r != 0)
        if r == 0:
            assert torch.equal(got["to0"], got["all"])
        # Its band of the gathered image went to every other rank, halo rows
        # and GroupNorm moments to its neighbours besides.
        scale = ref.shape[2] // worker.inputs()[0].shape[2]
        band = ref.numel() * ref.element_size() // ref.shape[2] * got["rows"][r] * scale
        assert got["sent"] > band * (world - 1)


# -- on a GPU --------------------------------------------------------------------
def _flux_vae():
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
        layers_per_block=2, norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False, use_post_quant_conv=False,
        sample_size=1024).to("cuda").eval()


@pytest.mark.gpu
def test_flux_decoder_bands_at_1024_bf16():
    vae = _flux_vae()
    z = torch.randn(1, 16, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        ref = vae.decode(z).sample
        conv_patch.apply(vae.to(torch.bfloat16))
        zb = z.bfloat16()
        whole = vae.decode(zb).sample
        banded, report = parallel.decode_in_bands(vae, zb, bands=3, return_report=True)
    assert report.mode == "bands" and not report.staged
    # Both bf16 decodes against fp32: the bands add no error of their own.
    e_whole, e_band = rel_err(whole, ref), rel_err(banded, ref)
    assert e_band <= 1.5 * e_whole + 2e-3, (e_band, e_whole)
    assert rel_err(banded, whole) <= 3 * e_whole + 2e-3


@pytest.mark.gpu
def test_staging_pool_pins_on_cuda():
    """On CUDA the pool's host tensors are pinned (registered at their exact
    size), so a band's copies to and from the device are asynchronous; a
    round trip through one keeps every bit."""
    from conv_patch.parallel import staging
    pool = staging.HostStaging(pinned=True)
    x = torch.randn(2, 5, 33, 17, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    h = pool.take(tuple(x.shape), x.dtype, channels_last=True)
    assert h.is_pinned() and pool.held_bytes == x.numel() * 2
    h.copy_(x, non_blocking=True)
    back = h.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, x)
    del h, back
    pool.release()
    assert pool.held_bytes == 0


@pytest.mark.gpu
def test_flux_decoder_budget_stages_to_host():
    """2048^2: the plain decode's estimate is ~5 GiB; within 3 GiB the large
    layers are staged to host and the small ones stay on the device."""
    vae = _flux_vae()
    z = torch.randn(1, 16, 256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        ref = vae.decode(z).sample  # fp32, unpatched
        conv_patch.apply(vae.to(torch.bfloat16))
        z = z.bfloat16()
        whole = vae.decode(z).sample
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        banded, report = parallel.decode_in_bands(vae, z, max_activation_gib=3, return_report=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    assert report.staged and report.bands > 1 and report.staged_layers and report.device_layers, report
    assert not report.over_budget
    # Both bf16 decodes against fp32: staging and bands add no error of their own.
    e_whole, e_band = rel_err(whole, ref), rel_err(banded, ref)
    assert e_band <= 1.5 * e_whole + 2e-3, (e_band, e_whole)
    assert peak < 4.5 * (1 << 30), peak / (1 << 30)


def test_band_hook_decides_per_call_and_remembers_the_estimate(vae):
    """The hook ``apply`` installs, called directly on an unpatched decoder:
    within a large budget it lets the block run (None) and keeps the plain
    estimate for the next call of that signature; over budget it returns the
    banded result; with hooks on the decoder it lets the block run and says
    why."""
    z = torch.randn(1, 4, 5, 4)
    dec = vae.decoder
    with torch.no_grad():
        roomy = parallel.BandHook(1e3)
        assert roomy(dec, (z,), {}) is None and parallel.last_report(dec).mode == "plain"
        assert len(roomy._plain) == 1 and roomy(dec, (z,), {}) is None
        tight = parallel.BandHook(1e-9)
        assert rel_err(tight(dec, (z,), {}), dec(z)) <= 1e-5 and parallel.last_report(vae).mode == "bands"
        h = dec.conv_in.register_forward_pre_hook(lambda *a: None)
        try:
            assert tight(dec, (z,), {}) is None and "hooks" in parallel.last_report(dec).fallback
        finally:
            h.remove()
        assert tight(dec, (z,), {"latent_embeds": None}) is None  # not the call it knows


def test_per_call_budget_check_reads_the_allocator_only_where_free_memory_does_not_settle_it(monkeypatch):
    """A decode that fits the driver's free memory alone is let through at
    one driver query; the allocator's counters (PyTorch builds its whole
    statistics dictionary for them) are read only where it does not, and
    the full budget is never below that lower bound."""
    from conv_patch.parallel import budget as bd
    reads = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1000, 4000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reads.append(1) or 600)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 200)
    dev = torch.device("cuda")
    assert bd.fits_free(dev, 900) and not reads
    assert not bd.fits_free(dev, 901) and not reads
    assert bd.auto_budget(dev) == pytest.approx(0.9 * (1000 + 400)) and reads
    assert not bd.fits_free(torch.device("cpu"), 1)
