"""The conv epilogue as a pass of its own (kernels/epilogue.py), and the
CUDNN route that ends in it: cuDNN's convolution without its bias, then bias,
residual*beta, activation and scale in one kernel, against float64.

Under the interpreter (CI) the route is forced with ``config={"route":
"cudnn"}`` (the table never routes a CPU call to cuDNN); on a GPU the same
tests run for real, plus a wrapper whose table routes its shape to cuDNN.
"""

import pytest
import torch
import torch.nn.functional as F

import conv_patch
from conv_patch.routing import tables as config_tables
from conv_patch import functional
from conv_patch.kernels import api as kernels
from conv_patch.routing.registry import Route
from conv_patch.target import target_for
from _util import TOL, act64, poisoned, randn, rel_err
from test_kernels import check_conv
from test_tma import TMA_CASES


@pytest.fixture
def launches(monkeypatch):
    """Counts the epilogue kernel's launches: a test of the kernel must fail
    if the eager path quietly computed the answer instead."""
    calls = []
    real = kernels.launch_epilogue

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)
    monkeypatch.setattr(kernels, "launch_epilogue", spy)
    return calls


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@pytest.mark.parametrize("case", TMA_CASES[:8], ids=str)
def test_cudnn_route_matches_float64(case, device, exact_fp32, launches):
    dtype = _dtype(device)
    check_conv(case, dtype, device, config={"route": "cudnn"}, seed=11)
    nhwc = case[9]
    # NHWC outputs take the kernel; NCHW ones keep PyTorch's functional.
    assert bool(launches) == (nhwc and (case[10] or case[11] != "none" or case[12] is not None))


# (N, C, H, W): channel counts below, across and past one 256-wide channel
# block, widths that leave partial pixel tiles.
SHAPES = [(2, 5, 3, 7), (1, 20, 9, 11), (1, 300, 4, 5), (3, 33, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("act", ["none", "silu", "gelu_tanh", "leaky_relu_0.2"])
@pytest.mark.parametrize("res", [None, "nhwc", "nchw"])
def test_epilogue_matches_float64(shape, act, res, device, launches):
    dtype = _dtype(device)
    g = torch.Generator().manual_seed(hash((shape, act, res)) % 1000)
    y = randn(g, *shape, dtype=dtype, device=device).contiguous(memory_format=torch.channels_last)
    b = randn(g, shape[1], dtype=dtype, device=device)
    ref = y.double().cpu() + b.double().cpu().view(1, -1, 1, 1)
    r, beta, scale = None, 1.0, 1.0
    if res is not None:
        r = randn(g, *shape, dtype=dtype, device=device)
        r = r.contiguous(memory_format=torch.channels_last) if res == "nhwc" else r
        beta, scale = -0.6, 0.5
        ref = ref + beta * r.double().cpu()
    ref = scale * act64(ref, act)
    out = poisoned(shape, dtype, device, channels_last=True)
    got = functional.epilogue(y, b, r, beta, act, scale, out=out)
    assert got.data_ptr() == out.data_ptr() and launches
    assert rel_err(got, ref) <= TOL[dtype]


@pytest.mark.parametrize("into", ["y", "residual", "parity view"])
def test_epilogue_in_place_and_into_views(into, device, launches):
    dtype = _dtype(device)
    g = torch.Generator().manual_seed(7)
    shape = (2, 12, 5, 6)
    y = randn(g, *shape, dtype=dtype, device=device).contiguous(memory_format=torch.channels_last)
    r = randn(g, *shape, dtype=dtype, device=device).contiguous(memory_format=torch.channels_last)
    b = randn(g, 12, dtype=dtype, device=device)
    ref = F.relu(y.double().cpu() + b.double().cpu().view(1, -1, 1, 1) + r.double().cpu())
    if into == "parity view":
        # What the folded upsample writes: one output parity of a larger tensor.
        big = poisoned((2, 12, 10, 12), dtype, device, channels_last=True)
        out = big[:, :, 1::2, 0::2]
    else:
        out = y if into == "y" else r
    got = functional.epilogue(y, b, r, 1.0, "relu", out=out)
    assert got.data_ptr() == out.data_ptr() and launches
    assert rel_err(got, ref) <= TOL[dtype]
    if into == "parity view":
        assert torch.isnan(big[:, :, 0::2]).all() and torch.isnan(big[:, :, 1::2, 1::2]).all()


def test_epilogue_int64_offsets_match(device, monkeypatch):
    dtype = _dtype(device)
    g = torch.Generator().manual_seed(8)
    y = randn(g, 1, 24, 6, 9, dtype=dtype, device=device).contiguous(memory_format=torch.channels_last)
    b = randn(g, 24, dtype=dtype, device=device)
    if not target_for(y.device).kernels:
        pytest.skip("no kernels here")
    plain = functional.epilogue(y, b, activation="silu")
    from conv_patch.kernels import epilogue as mod
    monkeypatch.setattr(mod, "needs_int64", lambda *t: True)
    assert torch.equal(functional.epilogue(y, b, activation="silu"), plain)


def test_cudnn_route_takes_unbatched_inputs(device):
    """A 3-D input on the cuDNN route: PyTorch's ops add the bias and the
    residual (the kernel takes 4-D outputs), broadcast over the right dim."""
    g = torch.Generator().manual_seed(12)
    x = randn(g, 6, 5, 7, device=device)
    w = randn(g, 4, 6, 3, 3, device=device)
    b = randn(g, 4, device=device)
    r = randn(g, 4, 5, 7, device=device)
    y = functional.conv2d(x, w, b, padding=1, residual=r, activation="silu", config={"route": "cudnn"})
    ref = F.silu(F.conv2d(x.double().cpu(), w.double().cpu(), b.double().cpu(), padding=1) + r.double().cpu())
    assert y.shape == (4, 5, 7) and rel_err(y, ref) <= 1e-3
    y = functional.conv2d(x, w, b, padding=1, config={"route": "cudnn"})
    assert rel_err(y, F.conv2d(x.double().cpu(), w.double().cpu(), b.double().cpu(), padding=1)) <= 1e-3


def test_epilogue_refuses_mismatched_out(device):
    y = torch.randn(1, 4, 3, 3, device=device)
    with pytest.raises(ValueError, match="out has shape"):
        functional.epilogue(y, out=torch.empty(1, 4, 3, 2, device=device))
    with pytest.raises(ValueError, match="residual has shape"):
        functional.epilogue(y, residual=torch.empty(1, 4, 2, 3, device=device))


@pytest.mark.gpu
def test_wrapper_routed_to_cudnn_fuses_its_epilogue(launches):
    """A table that routes the shape to cuDNN: the wrapper computes the conv
    there and bias + residual + SiLU in the epilogue pass, into ``out``.
    The output is large enough for one pass to beat PyTorch's three
    (``costs.fused_epilogue_pays``: on a small one the eager ops win, as
    launched they cost less host time than the pass's launcher)."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(9)
    conv = torch.nn.Conv2d(64, 48, 3, padding=1).to(dev, dtype).eval()
    x = randn(g, 1, 64, 509, 515, dtype=dtype, device=dev).contiguous(memory_format=torch.channels_last)
    r = randn(g, 1, 48, 509, 515, dtype=dtype, device=dev).contiguous(memory_format=torch.channels_last)
    key = config_tables.shape_key(conv_patch.specs.ConvSpec.from_module(conv), tuple(x.shape), "nhwc", dtype)
    table = {"conv2d": {"exact": {key: {"route": "cudnn", "cudnn_ms": 0.1, "ours_ms": 0.2}}, "buckets": []}}
    model = torch.nn.Sequential(conv)
    conv_patch.apply(model, config=conv_patch.PatchConfig(table=table))
    ref = F.silu(F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1) + r.double())
    with torch.no_grad():
        assert model[0].route(x, r).route is Route.CUDNN
        expected = r.clone()
        got = model[0](x, residual=r, activation="silu", out=r)
    assert got.data_ptr() == r.data_ptr() and launches
    eager = F.silu(F.conv2d(x, conv.weight, conv.bias, padding=1) + expected)
    assert rel_err(got, ref) <= 1.5 * rel_err(eager, ref) + 1e-3
