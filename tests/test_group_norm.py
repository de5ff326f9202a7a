"""GroupNorm (+ activation) kernels against a float64 reference: both
layouts, channel counts per group that are not powers of two, odd spatial
sizes, a large mean (where sum-of-squares would cancel), many splits per
group, with and without affine."""

import pytest
import torch
import torch.nn.functional as F

from conv_patch import functional
from conv_patch.target import target_for
from conv_patch.ops import group_norm as group_norm_op
from _util import TOL, act64, poisoned, randn, rel_err

# (N, C, H, W, groups, nhwc, affine, activation, mean offset)
CASES = [
    (2, 12, 5, 7, 3, False, True, "silu", 0.0),
    (1, 12, 5, 7, 4, True, True, "silu", 0.0),
    (3, 8, 9, 4, 2, True, False, "none", 0.0),
    (1, 30, 3, 11, 5, False, True, "relu", 0.0),
    (2, 16, 6, 6, 16, True, True, "gelu", 0.0),
    (1, 8, 7, 9, 1, False, True, "none", 50.0),  # mean >> std
    (2, 12, 5, 7, 3, True, True, "silu", 50.0),  # mean >> std, NHWC (shifted sums)
    (1, 10, 6, 5, 5, True, True, "leaky_relu_0.2", 0.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_group_norm(case, dtype, device, monkeypatch):
    N, C, H, W, G, nhwc, affine, act, offset = case
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    # Small launch sizes: several blocks per program, several programs per group.
    monkeypatch.setitem(group_norm_op.GN_LAUNCH, "interpreter", (64, 16, 64))
    g = torch.Generator().manual_seed(11)
    # Channel means that differ by a few std within each group: the merge of
    # per-channel moments into the group's must count their spread.
    x = (randn(g, N, C, H, W) + offset + torch.linspace(-2, 2, C).view(1, C, 1, 1)).to(device, dtype)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    w = randn(g, C, scale=0.5).add(1).to(device, dtype) if affine else None
    b = randn(g, C, scale=0.5).to(device, dtype) if affine else None
    ref = act64(F.group_norm(x.double().cpu(), G, None if w is None else w.double().cpu(),
                             None if b is None else b.double().cpu(), 1e-5), act)
    with torch.no_grad():
        y = functional.group_norm(x, G, w, b, 1e-5, act)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last) == nhwc
    assert rel_err(y, ref) <= max(TOL[dtype], 1e-5 if dtype == torch.float32 else 0)


def test_group_norm_falls_back_where_kernels_cannot(device):
    x = torch.randn(2, 8, 5, 6, device=device)[:, :, :, 1:]  # strided: PyTorch path
    y = functional.group_norm(x, 4, activation="silu")
    assert rel_err(y, F.silu(F.group_norm(x.double(), 4))) <= 1e-5
    with pytest.raises(ValueError, match="divisible"):
        functional.group_norm(torch.randn(1, 6, 2, 2, device=device), 4)


# (N, C, H, W, groups, nhwc, mean offset, launch sizes): odd sizes, Cg not a
# power of two, a large mean; several chunks per sample (small launch
# sizes), and the interpreter's own (one chunk of 128^2 pixels).
OUTLIER_CASES = [
    (2, 12, 13, 11, 3, True, 0.0, (64, 16, 64)),
    (1, 30, 9, 7, 5, True, 0.0, (64, 64, 64)),
    (2, 16, 10, 10, 4, True, 1e3, (64, 32, 64)),
    (1, 8, 128, 128, 2, True, 0.0, None),
    (2, 12, 13, 11, 3, False, 0.0, (64, 16, 64)),
    (1, 8, 9, 7, 2, False, 1e3, (64, 16, 64)),
]


@pytest.mark.parametrize("case", OUTLIER_CASES, ids=str)
def test_group_norm_outliers_at_chunk_starts(case, device, monkeypatch):
    """An outlier at the first pixel of every statistics chunk (each
    program's first element): statistics shifted by that pixel cancelled
    the variance away (a 3e4 corner at 128^2 gave an error of 5e4)."""
    from conv_patch.kernels.group_norm import nhwc_stats_split
    N, C, H, W, G, nhwc, offset, launch = case
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    if launch is not None:
        monkeypatch.setitem(group_norm_op.GN_LAUNCH, "interpreter" if device.type == "cpu" else "gpu", launch)
    _, stats_block, programs = group_norm_op.GN_LAUNCH["interpreter" if device.type == "cpu" else "gpu"]
    g = torch.Generator().manual_seed(5)
    x = randn(g, N, C, H, W) + offset
    flat = x.permute(0, 2, 3, 1).reshape(N, H * W, C)  # a view: writes reach x
    if nhwc:
        _, splits, chunk = nhwc_stats_split(N, C, H * W, stats_block, programs)
        assert splits > 1 or launch is None
        for s in range(splits):
            flat[:, s * chunk] = 3e4
    else:
        # NCHW chunks are runs of a group's Cg*H*W elements: put one at
        # every pixel's start of a few strides, chunk starts among them.
        x.view(N, -1)[:, ::7] = 3e4
    x = x.to(device)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    w = randn(g, C, scale=0.5).add(1).to(device)
    b = randn(g, C, scale=0.5).to(device)
    ref = F.group_norm(x.double().cpu(), G, w.double().cpu(), b.double().cpu(), 1e-5)
    out = poisoned(x.shape, x.dtype, device, channels_last=nhwc)
    with torch.no_grad():
        y = functional.group_norm(x, G, w, b, 1e-5, "none", out=out)
    assert y is out
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.gpu
def test_group_norm_past_int32_offsets():
    """128 channels at 4096^2 is 2^31 elements: every offset of the NHWC
    statistics pass must be 64-bit (a FLUX decode at 4096^2 crashed with an
    illegal address in it)."""
    torch.manual_seed(0)
    x = torch.randn(1, 128, 4096, 4096, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    x[:, :, -1, -1] += 40.0  # the last pixel, past 2^31 elements, moves its groups' statistics
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    out = functional.group_norm(x, 32, w, b, 1e-6, "silu")
    torch.cuda.synchronize()
    ref = F.silu(F.group_norm(x, 32, w, b, 1e-6))
    assert rel_err(out[:, :, -64:], ref[:, :, -64:]) <= 2e-2
    assert rel_err(out[:, :, :64], ref[:, :, :64]) <= 2e-2


def test_own_group_norm_is_the_modules_forward():
    """``dispatch.own_group_norm`` (the small GroupNorms' path) computes
    what the module's own forward computes: ``F.group_norm`` of its current
    parameters for torch's class (patched or not), the override for a
    class with a forward of its own."""
    import copy
    from torch import nn
    import conv_patch
    from conv_patch.runtime import dispatch

    class Doubled(nn.GroupNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    x = torch.randn(2, 12, 5, 7)
    for norm in (nn.GroupNorm(3, 12), Doubled(3, 12)):
        with torch.no_grad():
            norm.weight.normal_()
            norm.bias.normal_()
        ref = norm(x)
        assert torch.equal(dispatch.own_group_norm(norm, x), ref)
        net = nn.Sequential(copy.deepcopy(norm), nn.Conv2d(12, 4, 3))
        conv_patch.apply(net)
        # (A class with a forward of its own is not fused: is_group_norm.)
        assert type(net[0]).__name__.startswith("Fused") == (type(norm) is nn.GroupNorm)
        assert torch.equal(dispatch.own_group_norm(net[0], x), ref)
        with torch.no_grad():
            net[0].weight.data.mul_(-1.0)  # read at every call, through .data too
        assert not torch.equal(dispatch.own_group_norm(net[0], x), ref)

    class Half(nn.Module):
        def forward(self, w):
            return 0.5 * w

    norm = nn.GroupNorm(3, 12)
    torch.nn.utils.parametrize.register_parametrization(norm, "weight", Half())
    assert torch.equal(dispatch.own_group_norm(norm, x), norm(x))


# (N, C, T, H, W, groups, ndhwc, activation, with a folded conv bias, in place)
CASES_5D = [
    (1, 12, 3, 5, 7, 4, False, "silu", False, False),
    (2, 10, 2, 3, 5, 5, True, "none", True, False),
    (1, 8, 5, 1, 6, 2, True, "silu", False, True),  # H = 1: the view's layout is still NHWC
    (1, 6, 1, 4, 4, 3, False, "leaky_relu_0.2", True, True),
]


@pytest.mark.parametrize("case", CASES_5D, ids=str)
def test_5d_group_norm_runs_the_kernels_on_its_4d_view(case, device, monkeypatch):
    """A video VAE's GroupNorm ([N, C, T, H, W]): the groups span T, H and
    W, so the kernels normalise the [N, C, T*H, W] view of the same memory,
    NCDHW as NCHW and NDHWC as NHWC; the result keeps the 5-D layout."""
    N, C, T, H, W, G, ndhwc, act, folded, in_place = case
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    launched = []
    real = group_norm_op.kernels().launch_group_norm
    monkeypatch.setattr(group_norm_op.kernels(), "launch_group_norm",
                        lambda x, *a, **k: (launched.append((tuple(x.shape), x.stride())), real(x, *a, **k))[1])
    g = torch.Generator().manual_seed(13)
    fmt = torch.channels_last_3d if ndhwc else torch.contiguous_format
    x = (randn(g, N, C, T, H, W) + 20).to(device).contiguous(memory_format=fmt)
    w, b = randn(g, C, scale=0.5).add(1).to(device), randn(g, C, scale=0.5).to(device)
    ib = randn(g, C).to(device) if folded else None
    x64 = x.double().cpu() + (0 if ib is None else ib.double().cpu().view(-1, 1, 1, 1))
    ref = act64(F.group_norm(x64, G, w.double().cpu(), b.double().cpu(), 1e-6), act)
    out = x if in_place else None
    with torch.no_grad():
        y = functional.group_norm(x, G, w, b, 1e-6, act, out=out, input_bias=ib)
    assert launched and launched[0][0] == (N, C, T * H, W)
    assert y.shape == x.shape and y.is_contiguous(memory_format=fmt) and (not in_place or y is x)
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("into", [None, "ncdhw", "ndhwc", "itself"])
def test_a_strided_5d_group_norm(device, into):
    """A [N, T, C, H, W] tensor permuted back (CogVideoX's upsampler hands
    one on): normalised from a contiguous copy, as PyTorch's GroupNorm does,
    into a contiguous output or the ``out`` given (in place: PyTorch's)."""
    x = torch.randn(1, 3, 8, 4, 5, device=device).permute(0, 2, 1, 3, 4)
    ib = torch.randn(8, device=device)
    ref = F.silu(F.group_norm(x.double() + ib.double().view(-1, 1, 1, 1), 4))
    out = {None: None, "itself": x, "ncdhw": torch.empty(x.shape, device=device),
           "ndhwc": torch.empty(x.shape, device=device).contiguous(memory_format=torch.channels_last_3d)}[into]
    y = functional.group_norm(x, 4, activation="silu", out=out, input_bias=ib)
    assert rel_err(y, ref) <= 1e-5 and (out is None or y is out)
    assert into is not None or y.is_contiguous()
    with pytest.raises(ValueError, match="divisible"):
        functional.group_norm(torch.randn(1, 6, 2, 2, 2, device=device), 4)


@pytest.mark.parametrize("shape,fmt", [((2, 12, 5, 7), torch.contiguous_format), ((1, 10, 4, 6), torch.channels_last),
                                       ((1, 8, 3, 4, 5), torch.contiguous_format),
                                       ((1, 8, 3, 4, 5), torch.channels_last_3d)], ids=str)
def test_a_modulated_group_norm_against_float64(shape, fmt, device, monkeypatch):
    """``silu(GroupNorm(x) * m + a)`` in the apply pass (CogVideoX's spatial
    norm); a modulation in another layout than ``x`` runs PyTorch."""
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    launched = []
    real = group_norm_op.kernels().launch_group_norm
    monkeypatch.setattr(group_norm_op.kernels(), "launch_group_norm",
                        lambda *a, **k: (launched.append(k.get("modulation") is not None), real(*a, **k))[1])
    g = torch.Generator().manual_seed(len(shape) + shape[1])
    x, m, a = (randn(g, *shape).to(device).contiguous(memory_format=fmt) for _ in range(3))
    w, b = randn(g, shape[1]).to(device), randn(g, shape[1]).to(device)
    ref = F.silu(F.group_norm(x.double().cpu(), 2, w.double().cpu(), b.double().cpu(), 1e-6) * m.double().cpu()
                 + a.double().cpu())
    y = functional.group_norm(x, 2, w, b, 1e-6, "silu", modulation=(m, a))
    assert launched == [True] and rel_err(y, ref) <= 1e-5 and y.is_contiguous(memory_format=fmt)
    other = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    if fmt is other:
        other = torch.contiguous_format
    y = functional.group_norm(x, 2, w, b, 1e-6, "silu", modulation=(m.contiguous(memory_format=other), a))
    assert launched == [True] and rel_err(y, ref) <= 1e-5
