"""GPU-only checks (marker ``gpu``; skipped without CUDA). The rest of the
suite also runs on the GPU when there is one; these need one by nature: real
bf16/fp16 tensor-core numerics on diffusion-VAE conv shapes, offsets past
2**31, and Triton's compile cache."""

import pytest
import torch
import torch.nn.functional as F

import conv_patch
from conv_patch import functional
from conv_patch.routing.registry import Route
from conv_patch.routing.decide import decide
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import conv_tf32, target_for
from conv_patch.runtime.state import state_of
from conv_patch.routing import costs
from _util import TOL, rel_err

pytestmark = pytest.mark.gpu

# FLUX.1 / SD3 VAE decoder convolutions (C_in, C_out, k) at a quarter of the
# 1024^2 resolution's spatial sizes, so the float reference stays quick.
VAE_SHAPES = [
    (16, 512, 3, 32), (512, 512, 3, 32), (512, 512, 3, 64), (512, 256, 3, 128),
    (256, 256, 3, 128), (512, 256, 1, 128), (256, 128, 3, 256), (128, 128, 3, 256),
    (256, 128, 1, 256), (128, 3, 3, 256),
]


def _fp32_reference(x, w, b, pad):
    """F.conv2d of the same (rounded) inputs in exact fp32."""
    with conv_tf32(False):
        return F.conv2d(x.float(), w.float(), b.float(), padding=pad)


@pytest.mark.parametrize("nhwc", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", VAE_SHAPES, ids=lambda s: f"{s[0]}to{s[1]}k{s[2]}@{s[3]}")
def test_vae_conv_shapes_half(shape, dtype, nhwc):
    c_in, c_out, k, hw = shape
    g = torch.Generator(device="cuda").manual_seed(hash(shape) % 2**31)
    x = torch.randn(1, c_in, hw, hw, device="cuda", generator=g).to(dtype)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(c_out, c_in, k, k, device="cuda", generator=g) * (c_in * k * k) ** -0.5).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=g).to(dtype)
    ref = _fp32_reference(x, w, b, k // 2)
    out = torch.full(ref.shape, float("nan"), device="cuda", dtype=dtype)
    if nhwc:
        out = out.contiguous(memory_format=torch.channels_last)
    functional.conv2d(x, w, b, padding=k // 2, out=out)
    cudnn = F.conv2d(x, w, b, padding=k // 2)
    route = decide(ConvSpec.from_module(torch.nn.Conv2d(c_in, c_out, k, padding=k // 2)),
                         CallDesc.of_call(x, w, b), target_for(x.device), as_called=False)
    if route.route is Route.CUDNN:
        # The table sends this shape to cuDNN: its answer is the module's own
        # (in fp16 cuDNN's 1x1 can be 2x over our fp32-accumulated bound).
        assert rel_err(out, cudnn.float()) <= 1e-3
        return
    assert rel_err(out, ref) <= TOL[dtype]
    # As close to the exact answer as cuDNN's own result, within rounding.
    assert rel_err(out, ref) <= 1.5 * rel_err(cudnn, ref) + 1e-3


def test_offsets_past_int32():
    """Input with more than 2**31 elements: 64-bit offsets chosen automatically."""
    torch.manual_seed(0)
    c, hw = 128, 4160  # 2.2e9 elements
    x = torch.randn(1, c, hw, hw, device="cuda", dtype=torch.bfloat16)
    assert x.numel() > 2**31
    w = (torch.randn(8, c, 3, 3, device="cuda") * (9 * c) ** -0.5).to(torch.bfloat16)
    out = functional.conv2d(x, w, padding=1)
    ref = F.conv2d(x, w, padding=1)
    assert rel_err(out, ref.float()) <= 1e-2
    # The far end of the tensor is where a wrapped 32-bit offset would land.
    tail = (slice(None), slice(None), slice(hw - 9, None), slice(hw - 9, None))
    assert rel_err(out[tail], ref[tail].float()) <= 1e-2


def _compiled_variants(kernel):
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(v[0]) for v in caches.values())
    return sum(len(c) for c in kernel.cache.values())


def _compiles_nothing_after(kernels, call, first, later) -> int:
    """``call(*first)``, then ``call(*shape)`` for each of ``later``: none
    of the later calls compiles a variant of ``kernels``. Returns the
    variants compiled by then."""
    call(*first)
    before = sum(_compiled_variants(k) for k in kernels)
    for shape in later:
        call(*shape)
    assert sum(_compiled_variants(k) for k in kernels) == before
    return before


def test_new_resolution_compiles_nothing():
    """Shapes are runtime arguments: resolutions of the same divisibility
    (multiples of 16) in the same M-bucket of the table (16384 < M <= 65536)
    reuse the compiled kernels, whichever route the table picks."""
    from _util import conv_kernels
    KERNELS = conv_kernels()
    w = torch.randn(64, 32, 3, 3, device="cuda", dtype=torch.bfloat16)
    _compiles_nothing_after(
        KERNELS.values(),
        lambda hw: functional.conv2d(torch.randn(1, 32, hw, hw, device="cuda", dtype=torch.bfloat16), w, padding=1),
        (144,), [(hw,) for hw in (160, 176, 208, 240)])


# Fixed tiles (a table may pick another config per size, a new compile of
# its own): what is tested is the extents alone.
FIXED_TILES = {
    "tma": {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "BLOCK_W": 16, "GROUP_M": 8,
            "num_warps": 4, "num_stages": 3},
    "tma_padded": {"route": "tma_padded", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8,
                   "num_warps": 4, "num_stages": 3},
    "igemm": {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8,
              "num_warps": 4, "num_stages": 3},
}


@pytest.mark.parametrize("route", sorted(FIXED_TILES))
def test_new_batch_or_size_compiles_nothing(route):
    """A batch of 2 or 3 after a batch of 1 launches what the first call
    compiled, and on the TMA routes so do sizes of any divisibility (a
    104x152 latent after a 64x64 one): the kernels leave those extents
    unspecialised (kernels/common.py). The pointer kernel keeps its rows'
    divisibility (its loads along a row are vectorised by it)."""
    from _util import conv_kernels
    from conv_patch.kernels import layout
    kernels = list(conv_kernels().values()) + [layout.pad_nhwc_kernel]
    cfg = FIXED_TILES[route]
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 32, 3, 3, generator=g) / 17).to("cuda", torch.bfloat16)

    def call(n, h, wd):
        x = torch.randn(n, 32, h, wd, generator=g).to("cuda", torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        y = functional.conv2d(x, w, None, 1, 1, config=cfg)
        assert rel_err(y, F.conv2d(x.double(), w.double(), padding=1)) <= 1e-2

    sizes = [(2, 64, 64), (3, 64, 80)]
    if route != "igemm":
        sizes += [(1, 104, 152), (2, 90, 90), (1, 37, 50)]
    _compiles_nothing_after(kernels, call, (1, 64, 64), sizes)


def test_nhwc_group_norm_new_batch_or_size_compiles_nothing():
    """The channels-last GroupNorm passes (statistics, merge, apply with
    SiLU) at a batch of 2 and sizes of any divisibility after 1x64x64:
    nothing compiled anew (kernels/common.py; the merge's step is fixed)."""
    from conv_patch.kernels import group_norm as gn_kernels
    from conv_patch.ops.group_norm import group_norm
    kernels = [gn_kernels.group_norm_stats_nhwc_kernel, gn_kernels.group_norm_finalize_kernel,
               gn_kernels.group_norm_apply_nhwc_kernel]
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(64, generator=g).cuda(), torch.randn(64, generator=g).cuda()

    def call(n, h, wd):
        x = (torch.randn(n, 64, h, wd, generator=g) * 3 + 1).to("cuda", torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        y = group_norm(x, 32, w.to(x.dtype), b.to(x.dtype), 1e-6, "silu")
        ref = F.silu(F.group_norm(x.double(), 32, w.double(), b.double(), 1e-6))
        assert rel_err(y, ref) <= 1e-2

    compiled = _compiles_nothing_after(kernels, call, (1, 64, 64), [(2, 64, 64), (1, 104, 152), (3, 90, 90),
                                                                    (1, 37, 50)])
    assert compiled >= len(kernels)  # (the kernels ran: no PyTorch fallback)


def test_tf32_follows_pytorch():
    """fp32 with TF32 allowed is as accurate as cuDNN's TF32 (rounded, not
    truncated, operands); with it off, exact."""
    torch.manual_seed(0)
    x = torch.randn(1, 256, 64, 64, device="cuda")
    w = torch.randn(256, 256, 3, 3, device="cuda") / 48
    ref = F.conv2d(x.double(), w.double(), padding=1)
    with conv_tf32(True):
        tf32 = rel_err(functional.conv2d(x, w, padding=1), ref)
        cudnn_tf32 = rel_err(F.conv2d(x, w, padding=1), ref)
    with conv_tf32(False):
        exact = rel_err(functional.conv2d(x, w, padding=1), ref)
    assert exact <= 1e-6 < tf32 <= 5e-3
    assert tf32 <= 1.5 * cudnn_tf32


def test_flux_vae_decode_bf16():
    """FLUX-config AutoencoderKL decode at 512^2 in bf16, block recipes on:
    the patched model is as close to an fp32 decode as the unpatched bf16
    model is."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        use_quant_conv=False, use_post_quant_conv=False).cuda().eval()
    z = torch.randn(1, 16, 64, 64, device="cuda")
    with torch.no_grad(), conv_tf32(False):
        ref = vae.decode(z).sample.double()
        vae.to(torch.bfloat16)
        plain = vae.decode(z.bfloat16()).sample
        report = conv_patch.apply(vae)
        patched = vae.decode(z.bfloat16()).sample
    assert len(report.patched) > 30 and not report.skipped
    assert {"diffusers.ResnetBlock2D", "diffusers.Upsample2D", "diffusers.Decoder"} <= {
        v.split()[0] for v in report.fused.values()}
    assert any(state_of(m).last is not None and state_of(m).last.is_kernel for m in vae.modules() if conv_patch.is_patched(m))
    assert rel_err(patched, ref) <= 1.5 * rel_err(plain, ref)


@pytest.mark.parametrize("cfg", [
    {"route": "tma", "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "BLOCK_W": 64, "num_warps": 8, "num_stages": 3},
    {"route": "tma", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_W": 16, "num_warps": 4, "num_stages": 4},
    {"route": "tma", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_W": 64, "num_warps": 8, "num_stages": 3},
    {"route": "tma", "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "BLOCK_W": 128, "num_warps": 8, "num_stages": 3,
     "persistent": 1},
    {"route": "tma", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_W": 128, "num_warps": 4, "num_stages": 3,
     "persistent": 2},
], ids=["128x256w8s3", "128x128w4s4", "128x128w8s3", "128x256row-persistent", "128x128row-persistent"])
@pytest.mark.parametrize("c_in,c_out,k,hw", [(256, 128, 3, 256), (64, 128, 3, 256), (16, 512, 3, 128),
                                             (128, 256, 3, 128), (256, 128, 1, 256), (512, 256, 1, 128)])
def test_tma_is_deterministic_and_cudnn_accurate(cfg, c_in, c_out, k, hw):
    """Twenty runs of one TMA call give bit-identical outputs within 1.5x
    cuDNN's error. 8 warps on a 128-wide tile with 3 stages raced on the H200
    (run-to-run differences, errors up to 3.5x cuDNN's; see
    kernels/conv2d_tma.py); the launcher runs such tiles with 4 warps, and
    this test fails if that rule is lost. Persistent grids raced likewise
    with tiles of several pixel rows; one-row tiles are the ones allowed."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("no TMA")
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(1, c_in, hw, hw, device="cuda", generator=g).to(torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(c_out, c_in, k, k, device="cuda", generator=g) * (c_in * k * k) ** -0.5).to(torch.bfloat16)
    b = torch.randn(c_out, device="cuda", generator=g).to(torch.bfloat16)
    ref = _fp32_reference(x, w, b, k // 2)
    first = functional.conv2d(x, w, b, padding=k // 2, config=cfg)
    for _ in range(19):
        assert torch.equal(functional.conv2d(x, w, b, padding=k // 2, config=cfg), first)
    cudnn = F.conv2d(x, w, b, padding=k // 2)
    assert rel_err(first, ref) <= 1.5 * rel_err(cudnn, ref) + 1e-3


def test_offload_moves_do_not_leak_gpu_memory():
    """ComfyUI-style offload: 50 CPU<->GPU round trips of a patched model,
    each followed by a decode; GPU memory comes back to the same level."""
    net = torch.nn.Sequential(torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.SiLU(),
                              torch.nn.Conv2d(128, 64, 3, padding=1)).to("cuda", torch.bfloat16).eval()
    conv_patch.apply(net)
    x = torch.randn(1, 64, 64, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        net(x)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for _ in range(50):
            net.to("cpu")
            net.to("cuda")
            net(x)
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base


def test_cuda_graph_capture_and_replay_of_a_patched_decode(monkeypatch):
    """A patched TAESD-architecture decoder captured in a CUDA graph replays
    to the eager answer, with new inputs copied into the captured buffer."""
    import copy
    from conv_patch.tools import taesd
    dec = taesd.seeded_(taesd.decoder(16, 32)).to("cuda", torch.float16).eval()
    plain = copy.deepcopy(dec)
    conv_patch.apply(dec)
    # A capture always takes the folded upsample (dispatch.subpixel_pays) and
    # routes by GPU time alone (dispatch.weigh); eager calls do too here, so
    # that replay and eager are bitwise comparable.
    from conv_patch.runtime import pack
    monkeypatch.setattr(costs, "SUBPIXEL_MIN_MACS", 0)
    monkeypatch.setattr(pack, "GRAPH_PATH", True)
    static_in = torch.randn(1, 16, 16, 16, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        for _ in range(2):  # compile and warm up outside the capture
            dec(static_in)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = dec(static_in)
        for seed in range(3):
            x = torch.randn(1, 16, 16, 16, device="cuda", dtype=torch.float16,
                            generator=torch.Generator(device="cuda").manual_seed(seed))
            static_in.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, dec(x))
            assert rel_err(static_out, plain(x)) <= 1e-2  # and the unpatched model's answer


@pytest.mark.parametrize("nhwc", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", [(1, 512, 128, 128), (1, 128, 512, 512), (4, 256, 64, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_group_norm_silu_vae_shapes(shape, nhwc):
    """The VAE's GroupNorm(32)+SiLU in bf16: as close to float64 as PyTorch's
    own bf16 GroupNorm followed by SiLU."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.5).to(torch.bfloat16)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (1 + 0.1 * torch.randn(shape[1], device="cuda", generator=g)).to(torch.bfloat16)
    b = (0.1 * torch.randn(shape[1], device="cuda", generator=g)).to(torch.bfloat16)
    ref = F.silu(F.group_norm(x.double(), 32, w.double(), b.double(), 1e-6))
    with torch.no_grad():
        y = functional.group_norm(x, 32, w, b, 1e-6, "silu")
        torch_bf16 = F.silu(F.group_norm(x, 32, w, b, 1e-6))
    assert y.is_contiguous(memory_format=torch.channels_last) == nhwc
    assert rel_err(y, ref) <= 1.5 * rel_err(torch_bf16, ref) + 1e-3


def test_group_norm_conv_in_bands_bf16():
    """The banded GroupNorm+SiLU -> 3x3 conv of a 2048^2 decode's first
    full-resolution resnet, at a quarter of the size and in 8 bands: as
    accurate as the unbanded pair against the fp32 answer."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(1, 256, 512, 512, device="cuda", generator=g) * 2 + 0.5).to(torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    gw = (1 + 0.1 * torch.randn(256, device="cuda", generator=g)).to(torch.bfloat16)
    gb = (0.1 * torch.randn(256, device="cuda", generator=g)).to(torch.bfloat16)
    w = (torch.randn(128, 256, 3, 3, device="cuda", generator=g) / 48).to(torch.bfloat16)
    b = torch.randn(128, device="cuda", generator=g).to(torch.bfloat16)
    with torch.no_grad(), conv_tf32(False):
        ref = F.conv2d(F.silu(F.group_norm(x.float(), 32, gw.float(), gb.float(), 1e-6)), w.float(), b.float(),
                       padding=1)
        whole = functional.conv2d(functional.group_norm(x, 32, gw, gb, 1e-6, "silu"), w, b, padding=1)
        banded = functional.group_norm_conv2d(x, 32, gw, gb, 1e-6, "silu", w, b, band_bytes=16 << 20)
    assert rel_err(banded, ref) <= 1.2 * rel_err(whole, ref) + 1e-4 and rel_err(banded, ref) <= TOL[torch.bfloat16]


def test_taef2_fp16_photo_psnr_with_recipes():
    """TAEF2 (real weights) encode->decode of the real photo in fp16 at 512^2,
    block recipes on: PSNR within 0.1 dB of the unpatched fp16 model's."""
    import math
    from pathlib import Path
    import os
    np = pytest.importorskip("numpy")
    from PIL import Image
    from safetensors.torch import load_file
    from conv_patch.tools import taesd
    shared = Path(os.environ.get("CONV_PATCH_SHARED") or Path(__file__).resolve().parents[2] / "shared")
    if not (shared / "models" / "taef2_decoder.safetensors").exists():
        pytest.skip("no shared models")
    enc, dec = taesd.encoder(), taesd.decoder()
    enc.load_state_dict(load_file(shared / "models" / "taef2_encoder.safetensors"))
    dec.load_state_dict(load_file(shared / "models" / "taef2_decoder.safetensors"))
    enc, dec = enc.cuda().half().eval(), dec.cuda().half().eval()
    img = Image.open(shared / "images" / "astronaut.png").convert("RGB")
    t = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)[None].float() / 255
    top = (t.shape[-1] - 512) // 2
    x = t[:, :, top:top + 512, top:top + 512].contiguous().cuda().half()
    psnr = lambda a: -10 * math.log10(((a.float().clamp(0, 1) - x.float()) ** 2).mean().item())  # noqa: E731
    with torch.no_grad():
        plain = psnr(dec(enc(x)))
        conv_patch.apply(enc)
        r_dec = conv_patch.apply(dec)
        ours = psnr(dec(enc(x)))
    assert any(v.startswith("tiny.Block") for v in r_dec.fused.values())
    assert plain > 25 and abs(ours - plain) <= 0.1, (plain, ours)
