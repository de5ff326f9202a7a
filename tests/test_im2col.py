"""The im2col + TMA GEMM route (conv2d_im2col, kernels/im2col.py): its
column matrix against F.unfold, the conv on awkward shapes (strides,
dilation, folded and 'same' padding, both layouts, residual and activation
epilogues), its routing rule, and a patched module reading its weight in
place (no pack; an in-place edit of the weight seen at the next call).
Under the Triton interpreter in CI, on sm90 GPUs for real."""

import pytest
import torch
import torch.nn.functional as F

import conv_patch
from conv_patch import functional
from conv_patch.routing import tables as config_tables
from conv_patch.routing.decide import decide
from conv_patch.routing.registry import Route, im2col_problem, tuner_candidates
from conv_patch.runtime import pack
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import Target
from _util import poisoned, rel_err
from test_kernels import check_conv
from test_tma import HAS_SM90, TMA_CASES, needs_tma

TILES = {"route": "im2col", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 3,
         "num_warps": 4, "num_stages": 2}
WIDE = {"route": "im2col", "BLOCK_M": 128, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8,
        "num_warps": 4, "num_stages": 2}


def _takes(case) -> bool:
    n, c, h, w, co, k, s, p, d, nhwc, bias, act, res = case
    x = torch.empty(n, c, h, w, dtype=torch.float16)
    m = torch.nn.Conv2d(c, co, k, s, p, d)
    spec = ConvSpec.from_module(m)
    call = CallDesc.of_call(x, m.weight.detach().half(), None)
    return im2col_problem(spec, call, tuple(x.shape), Target("sm90", True)) is None


# The TMA kernel's cases the route takes (OH*OW a multiple of 8), plus a
# UNet-like deep conv at 8x8, a strided one with C_in past a K block, and a
# dilated conv with an NHWC residual.
IM2COL_CASES = [c for c in TMA_CASES if _takes(c)] + [
    (2, 72, 8, 8, 40, 3, 1, 1, 1, False, True, "silu", "nchw"),
    (1, 40, 12, 16, 24, 3, 2, 1, 1, True, True, "none", None),
    (2, 16, 10, 12, 20, 3, 1, 2, 2, False, False, "gelu", "nhwc"),
]


def test_cases_cover_what_the_route_is_for():
    strides = {c[6] for c in IM2COL_CASES}
    assert len(IM2COL_CASES) >= 10 and 2 in strides and 1 in strides and 4 in strides
    assert {c[9] for c in IM2COL_CASES} == {True, False}


@needs_tma
@pytest.mark.parametrize("config", [TILES, WIDE], ids=["tiles", "wide"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", IM2COL_CASES, ids=str)
def test_im2col_conv2d(case, dtype, config, device):
    check_conv(case, dtype, device, config=config, seed=11)


def test_column_matrix_is_unfold(device):
    """``launch_im2col`` equals F.unfold (in its (c, kh, kw) row order) for
    NCHW, NHWC and a strided view, every stride/padding/dilation mix,
    written over NaN."""
    from conv_patch.kernels import im2col
    g = torch.Generator().manual_seed(3)
    # Pixel counts of each tile width (64, 128, 256), pitched (not a multiple of 8) or not.
    bases = [torch.randn(2, 5, 11, 13, generator=g).to(device), torch.randn(1, 3, 6, 7, generator=g).to(device),
             torch.randn(1, 4, 9, 12, generator=g).to(device)]
    views = [t for b in bases for t in (b, b.contiguous(memory_format=torch.channels_last))] + [bases[0][:, :, 1:10, ::2]]
    for x in views:
        for k, s, p, d in ((3, 1, 1, 1), (3, 2, 1, 1), (2, 1, 0, 2), (3, (2, 1), (0, 2), 1)):
            ref = F.unfold(x.cpu(), k, dilation=d, padding=p, stride=s)
            s2 = s if isinstance(s, tuple) else (s, s)
            p2 = p if isinstance(p, tuple) else (p, p)
            d2 = d if isinstance(d, tuple) else (d, d)
            oh = (x.shape[2] + 2 * p2[0] - d2[0] * (k - 1) - 1) // s2[0] + 1
            ow = (x.shape[3] + 2 * p2[1] - d2[1] * (k - 1) - 1) // s2[1] + 1
            col = im2col.launch_im2col(x, k, k, s2, p2, d2, oh, ow)
            assert col.shape == ref.shape and torch.equal(col.cpu(), ref), (x.stride(), k, s, p, d)


def test_routing_rule():
    gpu = Target("sm90", True)
    m = torch.nn.Conv2d(16, 32, 3, padding=1).half()
    spec = ConvSpec.from_module(m)
    x = torch.empty(1, 16, 8, 8, dtype=torch.float16)
    w = m.weight.detach()
    assert im2col_problem(spec, CallDesc.of_call(x, w, None), (1, 16, 8, 8), gpu) is None
    assert "no TMA" in im2col_problem(spec, CallDesc.of_call(x, w, None), (1, 16, 8, 8), Target("sm80", True))
    wcl = w.contiguous(memory_format=torch.channels_last)
    assert "dense NCHW" in im2col_problem(spec, CallDesc.of_call(x, wcl, None), (1, 16, 8, 8), gpu)
    assert "fp16/bf16" in im2col_problem(spec, CallDesc.of_call(x.float(), w.float(), None), (1, 16, 8, 8), gpu)
    parity = torch.empty(1, 32, 16, 8, dtype=torch.float16)[:, :, ::2]  # rows 16 apart: no [N, C, 1, 64] view
    assert "one run" in im2col_problem(spec, CallDesc.of_call(x, w, None, out=parity), (1, 16, 8, 8), gpu)
    dense = torch.empty(1, 32, 8, 8, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    assert im2col_problem(spec, CallDesc.of_call(x, w, None, out=dense), (1, 16, 8, 8), gpu) is None
    x7 = torch.empty(1, 16, 7, 7, dtype=torch.float16)
    assert "output pixels" in im2col_problem(spec, CallDesc.of_call(x7, w, None), (1, 16, 7, 7), gpu)
    odd = ConvSpec.from_module(torch.nn.Conv2d(3, 8, 1))
    x3 = torch.empty(1, 3, 8, 8, dtype=torch.float16)
    w3 = torch.empty(8, 3, 1, 1, dtype=torch.float16)
    assert "multiple of 8" in im2col_problem(odd, CallDesc.of_call(x3, w3, None), (1, 3, 8, 8), gpu)
    # A table entry naming the route is taken where the rule allows it.
    key = config_tables.shape_key(spec, (1, 16, 8, 8), "nchw", torch.float16)
    table = config_tables.Table(config_tables.validate_table(
        {"conv2d": {"exact": {key: dict(TILES, ours_ms=0.01, cudnn_ms=0.02)}}}, "t"), "t")
    d = decide(spec, CallDesc.of_call(x, w, None), gpu, table, as_called=False)
    assert d.route is Route.CONV2D_IM2COL and d.tier == "exact" and d.entry.weight_in_place
    cands = tuner_candidates(gpu)
    assert any(c["route"] == "im2col" for c in cands)
    assert not any(c["route"] == "im2col" for c in tuner_candidates(Target("sm80", True)))


def test_taken_on_the_graph_path_only():
    """Weighed as called, a measured win is taken where only GPU time
    counts (the graph path) and not launched eagerly, where the route's
    host time costs a model more than it saves (registry ``launched``)."""
    gpu = Target("sm90", True)
    m = torch.nn.Conv2d(1280, 1280, 3, padding=1).half()
    spec = ConvSpec.from_module(m)
    x = torch.empty(2, 1280, 8, 8, dtype=torch.float16)
    key = config_tables.shape_key(spec, tuple(x.shape), "nchw", torch.float16)
    table = config_tables.Table(config_tables.validate_table(
        {"conv2d": {"exact": {key: dict(TILES, ours_ms=0.07, cudnn_ms=0.11)}}}, "t"), "t")
    w = m.weight.detach()
    graphed = decide(spec, CallDesc.of_call(x, w, None, graph=True, packed=True), gpu, table)
    assert graphed.route is Route.CONV2D_IM2COL
    launched = decide(spec, CallDesc.of_call(x, w, None, packed=True), gpu, table)
    assert launched.route is not Route.CONV2D_IM2COL and "graph path only" in launched.reason


@needs_tma
def test_patched_module_reads_its_weight_in_place(device):
    """A patched conv on the route keeps no pack, and a write through
    ``weight.data`` (which leaves the version counter as it was) is seen at
    the next call."""
    dtype = torch.float16
    g = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Conv2d(24, 40, 3, padding=1)).to(device, dtype).eval()
    m = model[0]
    x = torch.randn(2, 24, 8, 8, generator=g).to(device, dtype)
    spec = ConvSpec.from_module(m)
    key = config_tables.shape_key(spec, tuple(x.shape), "nchw", dtype)
    table = {"conv2d": {"exact": {key: dict(TILES, ours_ms=0.01, cudnn_ms=0.02)}}}
    conv_patch.apply(model, config=conv_patch.PatchConfig(table=table, compile_ahead=False), recipes=False)
    m = model[0]
    before = pack.stats()["allocations"]
    # (On a GPU as on the graph path, where the route is taken.)
    with torch.no_grad(), pack.graph_path():
        for scale in (1.0, -0.5, 3.0):
            m.weight.data.mul_(scale)
            ref = F.conv2d(x.double().cpu(), m.weight.double().cpu(), m.bias.double().cpu(), 1, 1)
            for _ in range(3):
                y = model(x)
                assert rel_err(y, ref) < 1e-2
            assert conv_patch.last_route(m).route is Route.CONV2D_IM2COL
    assert pack.stats()["allocations"] == before


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_SM90), reason="needs an sm90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_unet_shapes_with_the_tuner_tiles(dtype):
    """Every tuner tile of the route on UNet shapes (the deep 3x3 convs at
    8x8-32x32, a stride-2 downsample, both layouts in and out), NaN-poisoned
    outputs, against float64 within cuDNN's own error."""
    g = torch.Generator().manual_seed(7)
    for n, c, h, co, s in ((2, 1280, 8, 1280, 1), (2, 640, 16, 1280, 1), (1, 1280, 32, 1280, 1),
                           (2, 640, 32, 640, 2), (2, 2560, 8, 1280, 1)):
        for fmt in (torch.contiguous_format, torch.channels_last):
            x = torch.randn(n, c, h, h, generator=g).to("cuda", dtype).contiguous(memory_format=fmt)
            w = (torch.randn(co, c, 3, 3, generator=g) * (c * 9) ** -0.5).to("cuda", dtype)
            b = torch.randn(co, generator=g).to("cuda", dtype)
            ref = F.conv2d(x.double(), w.double(), b.double(), s, 1)
            cudnn = rel_err(F.conv2d(x, w, b, s, 1), ref)
            for cfg in (c for c in tuner_candidates(Target("sm90", True)) if c["route"] == "im2col"):
                out = poisoned(ref.shape, dtype, "cuda", channels_last=fmt == torch.channels_last)
                functional.conv2d(x, w, b, s, 1, out=out, config=cfg)
                err = rel_err(out, ref)
                assert err <= 1.5 * cudnn + 1e-3, (n, c, h, co, s, fmt, cfg, err, cudnn)
