"""The Hopper TMA kernel over a zero-bordered NHWC copy (route
conv2d_tma_padded): its padded staging copy, the kernel on awkward shapes
in both layouts (one and two blocks of output channels, persistent grid),
its routing rule and its table keys. Under the Triton interpreter in CI, on
sm90 GPUs for real (bf16 and fp16 against float64)."""

import pytest
import torch
import torch.nn.functional as F

from conv_patch import functional
from conv_patch.routing import tables as config_tables
from conv_patch.routing.decide import decide
from conv_patch.routing.registry import Route, tma_padded_problem, tuner_candidates
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import Target
from _util import poisoned, rel_err
from test_kernels import check_conv
from test_tma import TMA_CASES, needs_tma

# The stride-1 cases of the TMA kernel's list (every padding form, dilation,
# both layouts, partial channel blocks, widths 1 to 40), plus a UNet-like
# wide-channel case and C_out past one and a half blocks.
PADDED_CASES = [c for c in TMA_CASES if c[6] == 1] + [
    (2, 40, 6, 7, 72, 3, 1, 1, 1, False, True, "silu", "nchw"),
    (1, 24, 3, 5, 48, 1, 1, 0, 1, True, True, "none", "nhwc"),
]
SPLIT = {"route": "tma_padded", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16, "BLOCK_N2": 16,
         "GROUP_M": 3, "num_warps": 4, "num_stages": 2}
PERSISTENT = {"route": "tma_padded", "BLOCK_M": 128, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 8,
              "num_warps": 4, "num_stages": 2, "persistent": 1}


@needs_tma
@pytest.mark.parametrize("config", [SPLIT, PERSISTENT], ids=["split", "persistent"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", PADDED_CASES, ids=str)
def test_padded_conv2d(case, dtype, config, device):
    check_conv(case, dtype, device, config=config, seed=5)


@needs_tma
def test_folded_pad_and_output_in_the_callers_layout(device):
    """An F.pad-order padding (a folded pad: its ends differ) sizes the
    border; NCHW in, NCHW out; NHWC in, NHWC out."""
    g = torch.Generator().manual_seed(1)
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(2, 16, 7, 10, generator=g).to(device, torch.bfloat16).contiguous(memory_format=fmt)
        w = (torch.randn(24, 16, 2, 2, generator=g) * 0.2).to(device, torch.bfloat16)
        ref = F.conv2d(F.pad(x.double().cpu(), (0, 1, 1, 0)), w.double().cpu())
        y = functional.conv2d(x, w, None, 1, (0, 1, 1, 0), config=SPLIT)
        assert y.shape == ref.shape and rel_err(y, ref) < 1e-2
        assert y.is_contiguous(memory_format=fmt)


def test_pad_staging_copy_writes_every_element(device):
    """``launch_pad_nhwc``: NCHW and NHWC (and a strided view) in, the
    zero-bordered NHWC buffer out, the border zeros written over NaN."""
    from conv_patch.kernels import layout
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 5, 9, 11, generator=g).to(device)
    for x in (base, base.contiguous(memory_format=torch.channels_last), base[:, :, 1:8, ::2]):
        y = layout.launch_pad_nhwc(x, 1, 2, 3, 0)
        ref = F.pad(x.cpu(), (3, 0, 1, 2)).permute(0, 2, 3, 1)
        assert y.shape == ref.shape and y.is_contiguous()
        assert torch.equal(y.cpu(), ref)


def test_routing_rule():
    gpu = Target("sm90", True)
    spec = ConvSpec.from_module(torch.nn.Conv2d(16, 32, 3, padding=1))
    x = torch.empty(1, 16, 8, 8, dtype=torch.bfloat16)
    w = torch.empty(32, 16, 3, 3, dtype=torch.bfloat16)
    assert tma_padded_problem(spec, CallDesc.of_call(x, w, None), (1, 16, 8, 8), gpu) is None
    s2 = ConvSpec.from_module(torch.nn.Conv2d(16, 32, 3, stride=2, padding=1))
    assert "stride" in tma_padded_problem(s2, CallDesc.of_call(x, w, None), (1, 16, 8, 8), gpu)
    assert "no TMA" in tma_padded_problem(spec, CallDesc.of_call(x, w, None), (1, 16, 8, 8), Target("sm80", True))
    xf, wf = x.float(), w.float()
    assert "fp16/bf16" in tma_padded_problem(spec, CallDesc.of_call(xf, wf, None), (1, 16, 8, 8), gpu)
    # A table entry naming the route is taken where the rule allows it.
    key = config_tables.shape_key(spec, (1, 16, 8, 8), "nchw", torch.bfloat16)
    cfg = dict(SPLIT, ours_ms=0.01, cudnn_ms=0.02)
    table = config_tables.Table(config_tables.validate_table({"conv2d": {"exact": {key: cfg}}}, "t"), "t")
    d = decide(spec, CallDesc.of_call(x, w, None), gpu, table, as_called=False)
    assert d.route is Route.CONV2D_TMA_PADDED and d.tier == "exact"


def test_tables_take_its_split_tiles_and_the_tuner_measures_them():
    config_tables.validate_table({"conv2d": {"any": dict(SPLIT)}}, "t")
    with pytest.raises(config_tables.TableError, match="BLOCK_N2 splits the output channels of"):
        config_tables.validate_table({"conv2d": {"any": dict(SPLIT, route="tma")}}, "t")
    cands = tuner_candidates(Target("sm90", True))
    assert any(c["route"] == "tma_padded" and c.get("BLOCK_N2") for c in cands)
    assert not any(c["route"] == "tma_padded" for c in tuner_candidates(Target("sm80", True)))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs an sm90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_unet_shapes_with_the_tuner_tiles(dtype):
    """Every tuner tile of the route on UNet shapes (320/640/1280 channels at
    64/32/16 pixels, 3x3 and 1x1, both layouts), NaN-poisoned outputs,
    against float64 within cuDNN's own error."""
    g = torch.Generator().manual_seed(7)
    for n, c, h, co, k in ((2, 320, 64, 320, 3), (2, 640, 32, 640, 3), (2, 1280, 16, 1280, 1), (1, 320, 17, 72, 3)):
        for fmt in (torch.contiguous_format, torch.channels_last):
            x = torch.randn(n, c, h, h, generator=g).to("cuda", dtype).contiguous(memory_format=fmt)
            w = (torch.randn(co, c, k, k, generator=g) * (c * k * k) ** -0.5).to("cuda", dtype)
            b = torch.randn(co, generator=g).to("cuda", dtype)
            ref = F.conv2d(x.double(), w.double(), b.double(), 1, k // 2)
            cudnn = rel_err(F.conv2d(x, w, b, 1, k // 2), ref)
            for cfg in (c for c in tuner_candidates(Target("sm90", True)) if c["route"] == "tma_padded"):
                out = poisoned(ref.shape, dtype, "cuda", channels_last=fmt == torch.channels_last)
                functional.conv2d(x, w, b, 1, k // 2, out=out, config=cfg)
                err = rel_err(out, ref)
                assert err <= 1.5 * cudnn + 1e-3, (n, c, h, co, k, fmt, cfg, err, cudnn)
