"""The few-input-channel route (conv2d_flat): the implicit GEMM with its
reduction over (c_in, kh, kw) flattened, against float64; and the rules that
route a conv there."""

import pytest
import torch

from conv_patch.routing import tables as config_tables
from conv_patch import functional
from conv_patch.routing.registry import MAX_FLAT_REDUCTION, Route, flat_problem
from conv_patch.routing.decide import decide
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import Target
from test_kernels import check_conv

# (N, C_in, H, W, C_out, k, stride, padding, dilation, nhwc, bias, act, residual):
# an RGB conv_in (K = 27, one block of 32), K spanning several blocks of 16
# (4x3x3 = 36, 7x3x3 = 63), 1x1 and 5x5, strides, dilation, asymmetric
# "same", both layouts, residuals in both layouts, odd sizes, C_out past one
# column tile.
FLAT_CASES = [
    (2, 3, 9, 11, 24, 3, 1, 1, 1, False, True, "none", None),
    (1, 3, 10, 7, 40, 3, 1, 1, 1, True, True, "silu", "nhwc"),
    (1, 4, 12, 9, 16, 3, 2, 1, 1, False, False, "relu", "nchw"),
    (3, 7, 8, 8, 5, 3, 1, 2, 2, True, True, "gelu", None),
    (1, 2, 13, 12, 33, 5, 2, 2, 1, False, True, "none", "nhwc"),
    (1, 5, 9, 10, 12, 1, 1, 0, 1, True, True, "gelu_tanh", None),
    (1, 6, 9, 12, 8, 2, 1, "same", 1, False, True, "none", None),
    (2, 3, 8, 8, 17, 3, 1, (2, 0), 1, True, False, "silu", "nchw"),
]
FLAT = {"route": "flat", "BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4, "num_warps": 4,
        "num_stages": 2}


@pytest.mark.parametrize("case", FLAT_CASES, ids=str)
def test_flat_conv2d_fp32_exact(case, device, exact_fp32):
    check_conv(case, torch.float32, device, config=FLAT, seed=31)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", FLAT_CASES[:4], ids=str)
def test_flat_conv2d_half(case, dtype, device):
    check_conv(case, dtype, device, config=dict(FLAT, BLOCK_K=32), seed=32)


def test_flat_conv2d_int64_offsets(device, exact_fp32):
    check_conv(FLAT_CASES[1], torch.float32, device, config=FLAT, force_int64=True, seed=33)


def _spec(c_in, k=3, transposed=False):
    cls = torch.nn.ConvTranspose2d if transposed else torch.nn.Conv2d
    return ConvSpec.from_module(cls(c_in, 16, k, padding=k // 2))


def test_flat_problem_names_the_rule():
    assert flat_problem(_spec(3)) is None
    assert flat_problem(_spec(MAX_FLAT_REDUCTION // 9)) is None
    assert "> 64" in flat_problem(_spec(MAX_FLAT_REDUCTION // 9 + 1))
    assert "conv_transpose2d" in flat_problem(_spec(3, transposed=True))


def test_table_routes_flat_only_where_eligible(device):
    igemm = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    tbl = config_tables.Table(config_tables.validate_table(
        {"conv2d": {"exact": {}, "buckets": [{"max_m": None, "config": dict(FLAT)}], "any": igemm}}, "t"), "t")
    sm90 = Target("sm90", True)
    for c_in, route in ((3, Route.CONV2D_FLAT), (8, Route.CONV2D_IGEMM)):
        call = CallDesc(shape=(1, c_in, 16, 16), dtype=torch.bfloat16, device_type="cuda", layout="nchw",
                        weight_dtype=torch.bfloat16)
        assert decide(_spec(c_in), call, sm90, tbl, as_called=False).route is route
    with pytest.raises(functional.UnsupportedConv, match="C_in"):
        functional.conv2d(torch.randn(1, 8, 6, 6, device=device), torch.randn(16, 8, 3, 3, device=device),
                   padding=1, config=FLAT)
