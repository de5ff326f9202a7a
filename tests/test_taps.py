"""The few-output-channel route (conv2d_taps): a 1x1 GEMM of the input against
every tap's weights, then the tap sum with the fused epilogue, against
float64; and the rules that route a conv there."""

import pytest
import torch

from conv_patch.routing import tables as config_tables
from conv_patch import functional
from conv_patch.routing.registry import MAX_TAP_OUTPUTS, Route, taps_problem
from conv_patch.routing.decide import decide
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import Target
from _util import TOL
from test_kernels import check_conv

# (N, C_in, H, W, C_out, k, stride, padding, dilation, nhwc, bias, act, residual):
# C_out 1..7 with 3x3 (N = 9..63 tap outputs), 5x5 and 7x7, strides, dilation,
# asymmetric "same", both layouts, residuals in both layouts, odd sizes.
TAPS_CASES = [
    (2, 24, 9, 11, 3, 3, 1, 1, 1, True, True, "none", None),
    (1, 13, 7, 10, 5, 3, 1, 1, 1, False, True, "silu", "nhwc"),
    (1, 8, 12, 9, 2, 5, 2, 2, 1, True, False, "relu", "nchw"),
    (3, 5, 11, 8, 1, 7, 1, 3, 1, False, True, "gelu", None),
    (1, 9, 13, 12, 7, 3, 2, 0, 1, True, True, "none", "nhwc"),
    (1, 6, 10, 11, 4, 3, 1, 2, 2, False, True, "gelu_tanh", None),
    (1, 10, 9, 12, 3, 4, 1, "same", 1, True, True, "none", None),
    (2, 3, 8, 8, 3, 3, 1, (2, 0), 1, False, False, "silu", "nchw"),
]
TAPS = {"route": "taps", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4, "num_warps": 4,
        "num_stages": 2}


@pytest.mark.parametrize("case", TAPS_CASES, ids=str)
def test_taps_conv2d_fp32_exact(case, device, exact_fp32, monkeypatch):
    # Small tap-sum blocks: several programs per image.
    from conv_patch.kernels import conv2d_taps
    monkeypatch.setattr(conv2d_taps.launch_conv2d_taps, "__kwdefaults__", {"force_int64": False, "block": 16})
    check_conv(case, torch.float32, device, config=TAPS, seed=21)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", TAPS_CASES[:4], ids=str)
def test_taps_conv2d_half(case, dtype, device):
    check_conv(case, dtype, device, config=TAPS, seed=22)


def test_taps_conv2d_int64_offsets(device, exact_fp32):
    check_conv(TAPS_CASES[1], torch.float32, device, config=TAPS, force_int64=True, seed=23)


def _spec(c_out, k=3, transposed=False):
    cls = torch.nn.ConvTranspose2d if transposed else torch.nn.Conv2d
    return ConvSpec.from_module(cls(8, c_out, k, padding=k // 2))


def test_taps_problem_names_the_rule():
    assert taps_problem(_spec(3)) is None
    assert taps_problem(_spec(MAX_TAP_OUTPUTS // 9)) is None
    assert "> 64" in taps_problem(_spec(MAX_TAP_OUTPUTS // 9 + 1))
    assert "1x1" in taps_problem(_spec(3, k=1))
    assert "conv_transpose2d" in taps_problem(_spec(3, transposed=True))


def test_table_routes_taps_only_where_eligible():
    taps = dict(TAPS)
    igemm = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    tbl = config_tables.Table(config_tables.validate_table(
        {"conv2d": {"exact": {}, "buckets": [{"max_m": None, "config": taps}], "any": igemm}}, "t"), "t")
    call = CallDesc(shape=(1, 8, 16, 16), dtype=torch.bfloat16, device_type="cuda", layout="nhwc",
                    weight_dtype=torch.bfloat16)
    sm90 = Target("sm90", True)
    assert decide(_spec(3), call, sm90, tbl, as_called=False).route is Route.CONV2D_TAPS
    assert decide(_spec(16), call, sm90, tbl, as_called=False).route is Route.CONV2D_IGEMM


def test_given_taps_config_on_ineligible_conv_says_why(device):
    x = torch.randn(1, 8, 6, 6, device=device)
    w = torch.randn(16, 8, 3, 3, device=device)
    with pytest.raises(functional.UnsupportedConv, match="C_out"):
        functional.conv2d(x, w, padding=1, config=TAPS)


def test_taps_wrapper_keeps_pack_and_matches(device, exact_fp32):
    """Through a patched module (the pack is the tap GEMM's weight, read as a
    view) with the route forced by a user table."""
    import conv_patch
    g = torch.Generator().manual_seed(24)
    conv = torch.nn.Conv2d(16, 3, 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.1)
    x = torch.randn(2, 16, 9, 7, generator=g)
    ref = torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    table = {"conv2d": {"exact": {}, "buckets": [{"max_m": None, "config": dict(TAPS)}]}}
    model = torch.nn.Sequential(conv).to(device)
    conv_patch.apply(model, config=conv_patch.PatchConfig(table=table))
    with torch.no_grad():
        x = x.to(device)
        if model[0].route(x).route is not Route.CONV2D_TAPS:
            pytest.skip("no kernels here")
        y = model[0](x)
    err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
    assert err <= TOL[torch.float32] * 10
