"""The one activation table (conv_patch/activations.py): its names, the
kernels' codes and the eager functions the fallback runs. The kernels' side of every entry is tested against float64
in test_kernels / test_tma / test_epilogue / test_conv3d."""

import pytest
import torch
import torch.nn.functional as F

from conv_patch import functional
from conv_patch.activations import LEAKY_BASE, activation_code, activation_fn, eager_epilogue, leaky_relu
from _util import rel_err


@pytest.mark.parametrize("slope,name", [(0.01, "leaky_relu"), (0.2, "leaky_relu_0.2"), (0.1, "leaky_relu_0.1"),
                                        (0.0, "leaky_relu_0"), (0.333, "leaky_relu_0.333")])
def test_leaky_names_and_codes(slope, name):
    assert leaky_relu(slope) == name
    assert activation_code(name) == LEAKY_BASE + round(slope * 1000)
    y = torch.linspace(-3, 3, 61, dtype=torch.float64)
    assert torch.equal(activation_fn(name)(y), F.leaky_relu(y, slope))


def test_leaky_any_spelling_of_a_slope_is_the_same_code():
    assert activation_code("leaky_relu_0.20") == activation_code("leaky_relu_0.2") == LEAKY_BASE + 200
    assert activation_code("leaky_relu_0.01") == activation_code("leaky_relu")


@pytest.mark.parametrize("slope", [0.3333, 1.0, 1.5, -0.1, 0.0001])
def test_slopes_the_kernels_cannot_carry_are_none(slope):
    assert leaky_relu(slope) is None


@pytest.mark.parametrize("bad", ["tanh", "leaky_relu_", "leaky_relu_x", "leaky_relu_1", "leaky_relu_-0.2",
                                 "leaky_relu_0.3333", None, 3])
def test_unknown_names_raise_naming_the_table(bad):
    with pytest.raises(ValueError, match="leaky_relu_<slope>"):
        activation_code(bad)
    with pytest.raises(ValueError, match="expected one of"):
        activation_fn(bad)


def test_eager_epilogue_leaky():
    g = torch.Generator().manual_seed(3)
    y, r = torch.randn(2, 5, 4, 3, generator=g), torch.randn(2, 5, 4, 3, generator=g)
    got = eager_epilogue(y, r, 5.0, "leaky_relu_0.2", 0.2)
    assert torch.allclose(got, 0.2 * F.leaky_relu(y + 5.0 * r, 0.2))


def test_leaky_conv_through_the_kernel_matches_float64(device, exact_fp32):
    """ESRGAN's dense-block conv: LeakyReLU(0.2) in the kernel's epilogue,
    and its last conv's ``0.2 * conv + x`` as ``out_scale=0.2, beta=5``."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 13, 9, 11, generator=g, dtype=torch.float64)
    w = torch.randn(7, 13, 3, 3, generator=g, dtype=torch.float64) * 13 ** -0.5
    b = torch.randn(7, generator=g, dtype=torch.float64)
    r = torch.randn(1, 7, 9, 11, generator=g, dtype=torch.float64)
    ref = F.leaky_relu(F.conv2d(x, w, b, padding=1), 0.2)
    got = functional.conv2d(x.float().to(device), w.float().to(device), b.float().to(device), padding=1,
                            activation="leaky_relu_0.2")
    assert rel_err(got, ref) <= 1e-5
    ref = 0.2 * F.conv2d(x, w, b, padding=1) + r
    got = functional.conv2d(x.float().to(device), w.float().to(device), b.float().to(device), padding=1,
                            residual=r.float().to(device), beta=5.0, out_scale=0.2)
    assert rel_err(got, ref) <= 1e-5
