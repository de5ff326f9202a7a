"""The grouped-conv kernels (kernels/grouped_pointwise.py, kernels/depthwise.py)
and their op (conv_patch/ops/grouped_conv.py): against float64, on awkward
group sizes and geometries, with a bias, adversarial inputs and a poisoned
output; and which calls the op refuses."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.ops import grouped_conv as gp
from conv_patch.ops.loader import kernels
from conv_patch.target import dot_precision, target_for
from _util import TOL, poisoned, rel_err

CASES = [  # (n, c_in, c_out, groups, h, w, bias)
    (2, 12, 15, 3, 5, 7, True),
    (1, 40, 24, 8, 3, 9, False),
    (3, 6, 6, 2, 1, 1, True),
    (1, 96, 96, 3, 4, 33, False),  # 32-channel groups, DC-AE's
    (1, 272, 136, 2, 2, 3, True),  # groups wider than one block: several column and reduction steps
]


def _dtypes(device):
    return [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_kernel_against_float64(case, device, exact_fp32):
    n, c_in, c_out, groups, h, w, with_bias = case
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    g = torch.Generator().manual_seed(sum(case[:6]))
    for dtype in _dtypes(device):
        x = torch.randn(n, c_in, h, w, generator=g) + 3.0  # a large mean
        x[0, c_in // 2, 0, 0] = 40.0  # and an outlier
        wt = torch.randn(c_out, c_in // groups, 1, 1, generator=g) * 0.2
        b = torch.randn(c_out, generator=g) if with_bias else None
        ref = F.conv2d(x.double(), wt.double(), None if b is None else b.double(), groups=groups)
        xd = x.to(device, dtype).contiguous(memory_format=torch.channels_last)
        out = poisoned((n, c_out, h, w), dtype, device, channels_last=True)
        rows = xd.permute(0, 2, 3, 1).reshape(-1, c_in)
        kernels().launch_grouped_pointwise(
            rows, wt.to(device, dtype).view(c_out, -1), None if b is None else b.to(device, dtype),
            out.permute(0, 2, 3, 1).view(-1, c_out), groups, precision=dot_precision(dtype, target_for(device)),
            upcast=target_for(device).interpreter)
        assert not out.isnan().any()
        assert rel_err(out, ref) <= TOL[dtype] * 2, dtype


DEPTHWISE = [  # (n, c, h, w, kernel, stride, padding, dilation, bias)
    (2, 12, 9, 7, (5, 5), (1, 1), (2, 2), (1, 1), False),
    (1, 70, 6, 11, (3, 3), (2, 2), (1, 1), (1, 1), True),
    (1, 5, 8, 8, (3, 5), (1, 2), (0, 3), (2, 1), True),
    (3, 24, 1, 1, (7, 7), (1, 1), (3, 3), (1, 1), False),
    (1, 130, 4, 37, (1, 1), (1, 1), (0, 0), (1, 1), True),
]


@pytest.mark.parametrize("case", DEPTHWISE, ids=str)
def test_depthwise_against_float64(case, device, exact_fp32):
    n, c, h, w, k, s, p, d, with_bias = case
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    g = torch.Generator().manual_seed(n * 1000 + c)
    for dtype in _dtypes(device):
        conv = nn.Conv2d(c, c, k, s, p, d, groups=c, bias=with_bias)
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.3)
            if with_bias:
                conv.bias.copy_(torch.randn(c, generator=g))
        x = torch.randn(n, c, h, w, generator=g) - 4.0  # a large mean
        x[-1, 0, h // 2, w // 2] = 60.0  # and an outlier
        ref = F.conv2d(x.double(), conv.weight.double(), None if conv.bias is None else conv.bias.double(), s, p, d, c)
        conv = conv.to(device, dtype)
        xd = x.to(device, dtype).contiguous(memory_format=torch.channels_last)
        out = poisoned(tuple(ref.shape), dtype, device, channels_last=True)
        kernels().launch_depthwise(xd, conv.weight.detach(), None if conv.bias is None else conv.bias.detach(), out,
                                   stride=s, padding=p, dilation=d)
        assert not out.isnan().any()
        assert rel_err(out, ref) <= TOL[dtype] * 2, dtype
        with torch.no_grad():
            assert gp.form(conv) == (gp.POINTWISE if k == (1, 1) else gp.DEPTHWISE)
            taps = k[0] * k[1]
            assert (gp.problem(conv, xd) is None) == (taps == 1 or taps >= gp.DEPTHWISE_MIN_TAPS)
            assert rel_err(gp.grouped_conv(conv, xd), ref) <= TOL[dtype] * 2


def test_the_op_is_the_module_and_says_what_it_refuses(device, exact_fp32):
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    torch.manual_seed(1)
    conv = nn.Conv2d(20, 10, 1, groups=5, bias=True).to(device)
    x = torch.randn(2, 20, 6, 5, device=device).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert gp.problem(conv, x) is None and gp.form(conv) == gp.POINTWISE
        y = gp.grouped_conv(conv, x)
        assert y.is_contiguous(memory_format=torch.channels_last) and rel_err(y, conv(x)) <= TOL[torch.float32]
        assert gp.grouped_conv(conv, x[:0]).shape == (0, 10, 6, 5)
    assert gp.problem(conv, x) == "autograd"
    with torch.no_grad():
        assert gp.problem(conv, x.contiguous()) == "the input is not channels-last"
        assert "dtype" in gp.problem(conv, x.double())
        for other in (nn.Conv2d(20, 10, 1), nn.Conv2d(20, 10, 3, groups=5), nn.Conv2d(20, 10, 1, groups=5, stride=2),
                      nn.Conv2d(20, 20, 3, groups=20, padding="same"), nn.Conv2d(20, 20, 3, groups=20,
                                                                             padding_mode="reflect")):
            assert gp.conv_problem(other) is not None and gp.problem(other.to(device), x) is not None
        assert gp.conv_problem(nn.Conv2d(20, 10, 1, groups=5)) is None
        assert gp.conv_problem(nn.Conv2d(20, 20, 3, groups=20, padding=1)) is None
