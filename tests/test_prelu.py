"""PReLU in the conv epilogue (``activations.ChannelSlopes``): per-channel
and single slopes, read with the bias from one (bias, slope) buffer, against
float64 through a patched conv on each kernel route the device has (the
route forced by a user table), the epilogue pass after cuDNN, the replayed
plan seeing slopes edited in place, and what stays PyTorch's (training
slopes, the norm kernels, the torch.compile op)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conv_patch
from conv_patch.activations import ChannelSlopes, activation_code, activation_fn, per_channel
from conv_patch.kernels import api as kernels
from conv_patch.ops.epilogue import epilogue
from conv_patch.routing import tables as config_tables
from conv_patch.specs import ConvSpec
from _util import TOL, poisoned, randn, rel_err

TILE = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4, "num_warps": 4, "num_stages": 2}
ROUTES = {"igemm": dict(TILE, route="igemm"), "taps": dict(TILE, route="taps"), "flat": dict(TILE, route="flat")}
GPU_ROUTES = {"tma": {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4,
                      "num_stages": 3, "BLOCK_W": 64},
              "tma_padded": {"route": "tma_padded", "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8,
                             "num_warps": 4, "num_stages": 3},
              "im2col": {"route": "im2col", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8,
                         "num_warps": 4, "num_stages": 3}}
# (C_in, C_out, H, W) each route takes: taps C_out*9 <= 64, flat C_in*9 <= 64,
# the TMA routes C_in a multiple of 8, im2col H*W a multiple of 8 too.
SHAPES = {"igemm": (13, 11, 7, 9), "taps": (13, 5, 7, 9), "flat": (5, 11, 7, 9), "tma": (16, 24, 9, 10),
          "tma_padded": (16, 24, 9, 10), "im2col": (16, 24, 8, 10)}


def _prelu(channels, gen, single=False):
    """A PReLU whose slopes straddle 0 and 1 (one slope negative: the sign
    of every negative output must come from the slope, not a clamp)."""
    m = nn.PReLU(1 if single else channels)
    with torch.no_grad():
        m.weight.copy_(torch.rand(m.weight.shape, generator=gen) * 1.4 - 0.2)
    return m


def _ref(x, conv, prelu, residual=None, beta=1.0, scale=1.0):
    y = F.conv2d(x.double().cpu(), conv.weight.double().cpu(),
                 None if conv.bias is None else conv.bias.double().cpu(), 1, 1)
    if residual is not None:
        y = y + beta * residual.double().cpu()
    return scale * F.prelu(y, prelu.weight.double().cpu())


def _patched(route, conv, x, dtype):
    cfg = (GPU_ROUTES if route in GPU_ROUTES else ROUTES)[route]
    table = {"conv2d": {"exact": {}, "buckets": [{"max_m": None, "config": dict(cfg)}]}}
    model = nn.Sequential(conv).to(x.device, dtype).eval()
    conv_patch.apply(model, config=conv_patch.PatchConfig(table=table))
    return model[0]


@pytest.mark.parametrize("route", list(ROUTES) + [pytest.param(r, marks=pytest.mark.gpu) for r in GPU_ROUTES])
@pytest.mark.parametrize("case", ["per-channel", "single+residual", "no-bias+nchw+out"])
def test_prelu_epilogue_matches_float64(route, case, device, exact_fp32):
    dtype = torch.bfloat16 if route in GPU_ROUTES else torch.float32
    cin, cout, h, w = SHAPES[route]
    g = torch.Generator().manual_seed(len(route) * 10 + len(case))
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=case != "no-bias+nchw+out")
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * (cin * 9) ** -0.5)
        if conv.bias is not None:
            conv.bias.copy_(torch.randn(cout, generator=g) - 0.5)  # a negative mean: both branches taken
    prelu = _prelu(cout, g, single=case.startswith("single")).to(device, dtype)
    x = randn(g, 2, cin, h, w, dtype=dtype, device=device) + 0.5
    x[0, 1, 3, 4] = 30.0  # an outlier
    if "nchw" not in case:
        x = x.contiguous(memory_format=torch.channels_last)
    m = _patched(route, conv, x, dtype)
    act = ChannelSlopes(prelu)
    r = randn(g, 2, cout, h, w, dtype=dtype, device=device) if "residual" in case else None
    out = poisoned((2, cout, h, w), dtype, device) if "out" in case else None
    beta, scale = (0.7, 0.5) if r is not None else (1.0, 1.0)
    with torch.no_grad():
        y = m(x, residual=r, beta=beta, activation=act, out_scale=scale, out=out)
    decision = conv_patch.last_route(m)
    assert decision.is_kernel and decision.route.name.lower().endswith(route), decision
    assert out is None or y.data_ptr() == out.data_ptr()
    ref = _ref(x, m, prelu, r, beta, scale)
    assert rel_err(y, ref) <= TOL[dtype] * (4 if dtype != torch.float32 else 1)


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32, None])
def test_params_buffer_is_one_write_in_the_shared_dtype(bias_dtype, device, exact_fp32):
    """The (bias, slope) buffer is written by one op a call: in the dtype the
    bias and the slopes share (fp16 here, read in fp32 by the kernels: an
    exact widening), fp32 where they differ; a half-precision model's PReLU
    conv on a kernel route matches float64."""
    g = torch.Generator().manual_seed(11)
    prelu = _prelu(9, g).to(device, torch.float16)
    bias = None if bias_dtype is None else randn(g, 9, device=device).to(bias_dtype)
    act = ChannelSlopes(prelu)
    buf = act.params(bias, 9, prelu.weight.device)  # (a tensor's device, as the kernel routes pass)
    want = torch.float16 if bias_dtype in (torch.float16, None) else torch.float32
    assert buf.dtype == want and tuple(buf.shape) == (9, 2)
    assert torch.equal(buf[:, 1].double(), prelu.weight.double())
    assert torch.equal(buf[:, 0].double(), torch.zeros(9, dtype=torch.float64, device=device) if bias is None
                       else bias.double())
    if bias_dtype is not torch.float16:
        return
    conv = nn.Conv2d(13, 9, 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * (13 * 9) ** -0.5)
        conv.bias.copy_(torch.randn(9, generator=g) - 0.5)
    x = randn(g, 2, 13, 7, 9, dtype=torch.float16, device=device)
    m = _patched("igemm", conv, x, torch.float16)
    with torch.no_grad():
        y = m(x, activation=act)
        y2 = m(x, activation=act)  # the replayed plan
    assert conv_patch.last_route(m).is_kernel
    ref = _ref(x, m, prelu)
    assert rel_err(y, ref) <= TOL[torch.float16] and torch.equal(y, y2)


@pytest.mark.parametrize("bias", [True, False])
def test_params_buffer_made_in_inference_mode_is_written_outside_it(bias, device):
    """The buffer is kept across calls, and the first of them may run in
    inference mode (a compiling pass runs there before a user's first call
    under ``no_grad``): made there as an inference tensor, the next call's
    refresh in place raised outside inference mode. Each call writes the
    values it reads."""
    g = torch.Generator().manual_seed(5)
    prelu = _prelu(7, g).to(device)
    b = randn(g, 7, device=device) if bias else None
    act = ChannelSlopes(prelu)
    with torch.inference_mode():
        act.params(b, 7, prelu.weight.device)
    with torch.no_grad():
        prelu.weight.mul_(-2.0)
        buf = act.params(b, 7, prelu.weight.device)
    assert torch.equal(buf[:, 1], prelu.weight.detach())
    assert torch.equal(buf[:, 0], b if bias else torch.zeros_like(buf[:, 0]))


def test_replayed_plan_reads_slopes_and_bias_edited_in_place(device, exact_fp32):
    """The second call replays the recorded launches: the (bias, slope)
    buffer is rewritten at every call, so in-place edits (``.data`` writes
    included, which ``_version`` does not count) are seen."""
    g = torch.Generator().manual_seed(5)
    conv = nn.Conv2d(6, 7, 3, padding=1)
    m = _patched("igemm", conv, torch.empty(0, device=device), torch.float32)
    prelu = _prelu(7, g).to(device)
    act = ChannelSlopes(prelu)
    x = randn(g, 1, 6, 5, 8, device=device)
    with torch.no_grad():
        m(x, activation=act)
        prelu.weight.data.mul_(-3.0)
        m.bias.data.add_(1.0)
        y = m(x, activation=act)
    assert rel_err(y, _ref(x, m, prelu)) <= TOL[torch.float32]


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_epilogue_pass_with_prelu(layout, device, monkeypatch):
    """After a conv cuDNN computes: one pass of the epilogue kernel on an
    NHWC output, PyTorch's ops (bias add, F.prelu) on an NCHW one."""
    calls = []
    real = kernels.launch_epilogue
    monkeypatch.setattr(kernels, "launch_epilogue", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    g = torch.Generator().manual_seed(8)
    y = randn(g, 2, 21, 5, 6, device=device)
    if layout == "nhwc":
        y = y.contiguous(memory_format=torch.channels_last)
    bias, r = randn(g, 21, device=device), randn(g, 2, 21, 5, 6, device=device)
    prelu = _prelu(21, g).to(device)
    ref = 0.5 * F.prelu(y.double() + bias.double().view(-1, 1, 1) + 2.0 * r.double(), prelu.weight.double())
    got = epilogue(y.clone(), bias, r, 2.0, ChannelSlopes(prelu), 0.5)
    assert rel_err(got, ref) <= TOL[torch.float32]
    assert bool(calls) == (layout == "nhwc")


def test_the_table_and_its_refusals():
    a, b = nn.PReLU(4), nn.PReLU(4)
    assert ChannelSlopes(a) == ChannelSlopes(a) and hash(ChannelSlopes(a)) == hash(ChannelSlopes(a))
    assert ChannelSlopes(a) != ChannelSlopes(b) and ChannelSlopes(a) != "none"
    assert per_channel(ChannelSlopes(a)) and not per_channel("relu")
    assert activation_code(ChannelSlopes(a), per_channel=True) not in {activation_code(n) for n in
                                                                       ("none", "relu", "silu", "gelu", "gelu_tanh")}
    with pytest.raises(ValueError, match="conv epilogues only"):
        activation_code(ChannelSlopes(a))  # the norms' kernels and Conv3d: no channel buffer to read
    y = torch.randn(2, 4, 3, 3)
    assert torch.equal(activation_fn(ChannelSlopes(a))(y), F.prelu(y, a.weight))
    assert ChannelSlopes(nn.PReLU()).fits(9) and not ChannelSlopes(a).fits(9)


def test_slopes_that_do_not_fit_are_an_error():
    conv = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1))
    conv_patch.apply(conv)
    with pytest.raises(ValueError, match="4 slopes for a conv of 5 output channels"):
        conv[0](torch.randn(1, 3, 4, 4), activation=ChannelSlopes(nn.PReLU(4)))


def test_training_slopes_run_as_pytorch_and_get_their_gradient(device):
    g = torch.Generator().manual_seed(2)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    m = _patched("igemm", conv, torch.empty(0, device=device), torch.float32)
    prelu = _prelu(6, g).to(device)
    x = randn(g, 1, 4, 5, 5, device=device)
    y = m(x, activation=ChannelSlopes(prelu))
    assert "autograd" in conv_patch.last_route(m).reason
    y.sum().backward()
    ref = nn.PReLU(6).to(device)
    ref.weight.data.copy_(prelu.weight.data)
    ref(F.conv2d(x, m.weight, m.bias, padding=1)).sum().backward()
    assert torch.allclose(prelu.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)


def test_one_prelu_after_a_biased_and_an_unbiased_conv(device, exact_fp32):
    """A PReLU shared by two convs, one without a bias: its buffer's bias
    column is the other conv's only while that conv runs."""
    g = torch.Generator().manual_seed(12)
    prelu = _prelu(5, g).to(device)
    act = ChannelSlopes(prelu)
    convs = [_patched("igemm", nn.Conv2d(4, 5, 3, padding=1, bias=b), torch.empty(0, device=device), torch.float32)
             for b in (True, False)]
    x = randn(g, 1, 4, 6, 7, device=device)
    with torch.no_grad():
        for _ in range(2):
            for m in convs:
                assert rel_err(m(x, activation=act), _ref(x, m, prelu)) <= TOL[torch.float32]
