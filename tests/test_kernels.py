"""Kernel correctness: conv2d and conv_transpose2d against a float64 reference.

Runs under the Triton interpreter on the CPU (CI) and on the GPU when there is
one. Shapes are small but awkward: odd sizes, channel counts that are not
multiples of 8 or 16, mixed stride/padding/dilation, both layouts, every
activation, residuals in either layout.
"""

import random

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from conv_patch import functional
from conv_patch.kernels.common import round_to_tf32
from _util import TOL, act64, poisoned, randn, rel_err

ACTS = ["none", "relu", "silu", "gelu", "gelu_tanh"]

# (N, C_in, H, W, C_out, k, stride, padding, dilation, nhwc, bias, act, residual)
CONV_CURATED = [
    (1, 3, 9, 11, 5, 1, 1, 0, 1, False, True, "none", None),
    (2, 1, 7, 7, 1, 3, 1, 1, 1, False, False, "none", None),
    (3, 17, 13, 10, 33, 3, 2, 1, 1, True, True, "silu", "nchw"),
    (1, 130, 6, 5, 20, 3, 1, 1, 1, True, True, "relu", "nhwc"),
    (2, 20, 9, 8, 130, 1, 1, 0, 1, False, True, "gelu", "nchw"),
    (1, 7, 11, 13, 9, 2, 1, 0, 1, False, True, "gelu_tanh", None),
    (1, 6, 15, 14, 10, 4, 2, 1, 1, True, False, "none", "nhwc"),
    (2, 5, 12, 13, 8, 5, 3, 2, 1, False, True, "none", None),
    (1, 4, 17, 16, 6, 7, 1, 3, 1, True, True, "silu", None),
    (1, 9, 12, 11, 12, 3, 1, (1, 2), 2, False, True, "none", "nhwc"),
    (2, 8, 10, 9, 16, 3, 1, 2, 2, True, False, "relu", "nchw"),
    (1, 16, 8, 8, 24, 3, 2, 0, 1, False, True, "none", None),
    (1, 3, 23, 19, 64, 3, 1, "same", 1, False, True, "none", None),
    (1, 10, 9, 12, 11, 4, 1, "same", 1, True, True, "none", None),  # asymmetric 1/2 padding
    (1, 12, 10, 11, 7, 3, 1, "valid", 1, False, True, "none", None),
    (1, 5, 9, 9, 7, 3, 1, (2, 0), 1, True, True, "gelu", "nchw"),
    # LeakyReLU: ESRGAN's slope with a residual, PyTorch's default slope.
    (1, 12, 9, 10, 18, 3, 1, 1, 1, True, True, "leaky_relu_0.2", "nhwc"),
    (2, 5, 8, 7, 6, 3, 2, 1, 1, False, True, "leaky_relu", None),
]

# (N, C_in, H, W, C_out, k, stride, padding, output_padding, dilation, nhwc, bias, act, residual)
CONVT_CURATED = [
    (1, 4, 5, 6, 3, 4, 2, 1, 0, 1, False, True, "none", None),
    (2, 7, 4, 5, 9, 3, 2, 1, 1, 1, True, True, "silu", "nchw"),
    (1, 5, 6, 5, 130, 1, 1, 0, 0, 1, False, False, "none", None),
    (1, 130, 3, 4, 6, 2, 2, 0, 0, 1, True, True, "relu", "nhwc"),
    (1, 6, 5, 4, 9, 4, 3, (1, 2), (2, 0), 2, False, True, "gelu", None),
    (3, 3, 4, 4, 5, 5, 3, 2, 2, 1, False, True, "none", "nhwc"),
    (1, 8, 7, 6, 8, 3, 1, 1, 0, 2, True, False, "gelu_tanh", None),
    (1, 1, 5, 5, 1, 7, 2, 3, 1, 1, False, True, "none", None),
    (2, 16, 6, 7, 16, 2, 2, 0, 0, 1, True, True, "none", None),
    (1, 6, 5, 6, 7, 4, 2, 1, 0, 1, True, True, "leaky_relu_0.1", "nchw"),
]


def _random_conv_cases(n, seed):
    rng = random.Random(seed)
    chans = [1, 2, 3, 5, 8, 13, 16, 31, 64, 67]
    cases = []
    while len(cases) < n:
        k = rng.choice([1, 2, 3, 4, 5, 7])
        s = rng.choice([1, 2, 3])
        p = rng.choice([0, 1, 2, (1, 2), (2, 0)])
        d = rng.choice([1, 2])
        h, w = rng.randint(5, 15), rng.randint(5, 15)
        ph, pw = (p, p) if isinstance(p, int) else p
        if (h + 2 * ph - d * (k - 1) - 1) < 0 or (w + 2 * pw - d * (k - 1) - 1) < 0:
            continue
        cases.append((rng.randint(1, 3), rng.choice(chans), h, w, rng.choice(chans), k, s, p, d,
                      rng.random() < 0.5, rng.random() < 0.7, rng.choice(ACTS),
                      rng.choice([None, "nchw", "nhwc"])))
    return cases


def _random_convt_cases(n, seed):
    rng = random.Random(seed)
    chans = [1, 3, 5, 8, 13, 16, 33, 64]
    cases = []
    while len(cases) < n:
        k = rng.choice([1, 2, 3, 4, 5])
        s = rng.choice([1, 2, 3])
        d = rng.choice([1, 2])
        p = rng.choice([0, 1, 2, (1, 2)])
        op = rng.randrange(0, max(s, d))
        h, w = rng.randint(2, 7), rng.randint(2, 7)
        ph, pw = (p, p) if isinstance(p, int) else p
        if (h - 1) * s - 2 * ph + d * (k - 1) + op + 1 <= 0 or (w - 1) * s - 2 * pw + d * (k - 1) + op + 1 <= 0:
            continue
        cases.append((rng.randint(1, 3), rng.choice(chans), h, w, rng.choice(chans), k, s, p, op, d,
                      rng.random() < 0.5, rng.random() < 0.7, rng.choice(ACTS),
                      rng.choice([None, "nchw", "nhwc"])))
    return cases


CONV_RANDOM = _random_conv_cases(24, seed=1234)
CONVT_RANDOM = _random_convt_cases(14, seed=4321)


def _inputs(gen, dtype, device, N, C, H, W, nhwc):
    x = randn(gen, N, C, H, W, dtype=dtype, device=device)
    return x.contiguous(memory_format=torch.channels_last) if nhwc else x


def _epilogue_inputs(gen, ref, residual, act, dtype, device):
    """Residual, beta, scale and the finished float64 reference."""
    r = None
    beta, scale = 1.0, 1.0
    if residual is not None:
        r = randn(gen, *ref.shape, dtype=dtype, device=device)
        if residual == "nhwc":
            r = r.contiguous(memory_format=torch.channels_last)
        beta = 0.7
        ref = ref + beta * r.double().cpu()
    if act != "none" or residual is not None:
        scale = 0.5
    return r, beta, scale, scale * act64(ref, act)


def check_conv(case, dtype, device, config=None, force_int64=False, seed=0):
    N, C, H, W, Co, k, s, p, d, nhwc, bias, act, residual = case
    g = torch.Generator().manual_seed(seed)
    x = _inputs(g, dtype, device, N, C, H, W, nhwc)
    w = randn(g, Co, C, k, k, scale=(C * k * k) ** -0.5, dtype=dtype, device=device)
    b = randn(g, Co, dtype=dtype, device=device) if bias else None
    ref = F.conv2d(x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu(), s, p, d)
    r, beta, scale, ref = _epilogue_inputs(g, ref, residual, act, dtype, device)
    out = poisoned(ref.shape, dtype, device, channels_last=nhwc)
    y = functional.conv2d(x, w, b, s, p, d, residual=r, beta=beta, activation=act, out_scale=scale,
                   out=out, config=config, force_int64=force_int64)
    assert y.data_ptr() == out.data_ptr()
    err = rel_err(y, ref)
    assert err <= TOL[dtype], f"{case} {dtype}: rel err {err:.3g}"


def check_convt(case, dtype, device, config=None, force_int64=False, seed=0):
    N, C, H, W, Co, k, s, p, op, d, nhwc, bias, act, residual = case
    g = torch.Generator().manual_seed(seed)
    x = _inputs(g, dtype, device, N, C, H, W, nhwc)
    w = randn(g, C, Co, k, k, scale=(C * k * k) ** -0.5, dtype=dtype, device=device)
    b = randn(g, Co, dtype=dtype, device=device) if bias else None
    ref = F.conv_transpose2d(x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu(),
                             s, p, op, 1, d)
    r, beta, scale, ref = _epilogue_inputs(g, ref, residual, act, dtype, device)
    out = poisoned(ref.shape, dtype, device, channels_last=nhwc)
    y = functional.conv_transpose2d(x, w, b, s, p, op, d, residual=r, beta=beta, activation=act,
                             out_scale=scale, out=out, config=config, force_int64=force_int64)
    assert y.data_ptr() == out.data_ptr()
    err = rel_err(y, ref)
    assert err <= TOL[dtype], f"{case} {dtype}: rel err {err:.3g}"


@pytest.mark.parametrize("case", CONV_CURATED + CONV_RANDOM, ids=str)
def test_conv2d_fp32_exact(case, device, exact_fp32):
    check_conv(case, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CONV_CURATED, ids=str)
def test_conv2d_half(case, dtype, device):
    check_conv(case, dtype, device, seed=1)


@pytest.mark.parametrize("case", CONVT_CURATED + CONVT_RANDOM, ids=str)
def test_conv_transpose2d_fp32_exact(case, device, exact_fp32):
    check_convt(case, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CONVT_CURATED[:5], ids=str)
def test_conv_transpose2d_half(case, dtype, device):
    check_convt(case, dtype, device, seed=2)


# Tiles smaller than the problem: several row and column tiles, partial
# GROUP_M groups, several channel blocks per tap.
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 3, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("case", [CONV_CURATED[2], CONV_CURATED[3], CONV_CURATED[4], CONV_CURATED[10]], ids=str)
def test_conv2d_small_tiles(case, device, exact_fp32):
    check_conv(case, torch.float32, device, config=SMALL_TILES)


@pytest.mark.parametrize("case", [CONVT_CURATED[1], CONVT_CURATED[3], CONVT_CURATED[4]], ids=str)
def test_conv_transpose2d_small_tiles(case, device, exact_fp32):
    check_convt(case, torch.float32, device, config=SMALL_TILES)


@pytest.mark.parametrize("case", [CONV_CURATED[2], CONV_CURATED[9]], ids=str)
def test_conv2d_int64_offsets(case, device, exact_fp32):
    check_conv(case, torch.float32, device, force_int64=True)


def test_conv_transpose2d_int64_offsets(device, exact_fp32):
    check_convt(CONVT_CURATED[4], torch.float32, device, force_int64=True)


@pytest.mark.parametrize("nhwc", [False, True])
def test_output_keeps_input_layout(nhwc, device):
    g = torch.Generator().manual_seed(3)
    x = _inputs(g, torch.float32, device, 2, 6, 9, 7, nhwc)
    w = randn(g, 5, 6, 3, 3, device=device)
    y = functional.conv2d(x, w, padding=1)
    assert y.is_contiguous(memory_format=torch.channels_last) == nhwc
    assert y.is_contiguous() == (not nhwc)
    wt = randn(g, 6, 5, 2, 2, device=device)
    yt = functional.conv_transpose2d(x, wt, stride=2)
    assert yt.is_contiguous(memory_format=torch.channels_last) == nhwc


def test_strided_views_read_in_place(device, exact_fp32):
    """A sliced, non-dense input and weight view are read through their strides."""
    g = torch.Generator().manual_seed(4)
    big = randn(g, 2, 9, 15, 17, device=device)
    x = big[:, 1:8, 2:13, ::2]
    wbig = randn(g, 6, 14, 3, 3, device=device)
    w = wbig[:, ::2]
    b = randn(g, 6, device=device)
    ref = F.conv2d(x.double().cpu(), w.double().cpu(), b.double().cpu(), 1, 1)
    assert rel_err(functional.conv2d(x, w, b, 1, 1), ref) <= TOL[torch.float32]


def test_bad_calls_raise(device):
    g = torch.Generator().manual_seed(5)
    x = randn(g, 1, 4, 6, 6, device=device)
    w = randn(g, 3, 4, 3, 3, device=device)
    with pytest.raises(ValueError, match="activation 'tanh'"):
        functional.conv2d(x, w, activation="tanh")
    with pytest.raises(ValueError, match="residual has shape"):
        functional.conv2d(x, w, residual=torch.ones(1, 3, 6, 6, device=device))
    with pytest.raises(functional.UnsupportedConv, match="float64"):
        functional.conv2d(x.double(), w.double())
    with pytest.raises(functional.UnsupportedConv, match="channels"):
        functional.conv2d(x[:, :3], w)


@triton.jit
def _round_tf32_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_to_tf32(x), mask=offs < n)


def test_round_to_tf32_is_round_to_nearest(device):
    """The fp32 operands of a TF32 dot are rounded to 10 mantissa bits, not
    truncated; special values survive."""
    g = torch.Generator().manual_seed(6)
    x = torch.cat([torch.randn(1000, generator=g) * 10.0 ** torch.randint(-30, 30, (1000,), generator=g),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1.0 + 2 ** -11, 1.0 + 2 ** -12,
                                 1.0 - 2 ** -25, torch.finfo(torch.float32).max])]).float().to(device)
    y = torch.empty_like(x)
    _round_tf32_kernel[(1,)](x, y, x.numel(), BLOCK=2048)
    bits = x.cpu().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = (((bits + 0x1000) & 0xFFFFE000).to(torch.int64))
    want = torch.where(want >= 2**31, want - 2**32, want).to(torch.int32).view(torch.float32)
    assert torch.equal(y.cpu(), want)
    ulp = torch.ldexp(torch.ones_like(x.cpu()), torch.frexp(x.cpu())[1] - 11)
    finite = torch.isfinite(y.cpu()) & (x.cpu().abs() < 3e38)
    assert ((y.cpu() - x.cpu()).abs() <= ulp / 2 + 1e-45)[finite].all()
    special = y[1000:].cpu().tolist()
    assert special[:4] == [0.0, -0.0, float("inf"), -float("inf")]
    assert special[4] == 1.0 + 2 ** -10  # a tie rounds away from zero
    assert special[5] == 1.0 and special[6] == 1.0
    assert special[7] == float("inf")  # rounding past the largest TF32 value
