"""The weight kernels: the pack (co, kh, kw, ci) and the subpixel fold of an
upsampling conv's 3x3 weight, against PyTorch's permute and a float64 fold;
and the GroupNorm input bias a conv leaves to the norm."""

import pytest
import torch
import torch.nn.functional as F
from _util import poisoned, randn, rel_err

from conv_patch import functional
from conv_patch.kernels.api import (grouped_pack_args, launch_grouped_weight_pack, launch_subpixel_fold,
                                    launch_weight_pack)


def _fold64(w):
    """The four 2x2 weights, [a, b, co, kh, kw, ci], summed in float64."""
    w = w.double()
    rows = {0: ((0,), (1, 2)), 1: ((0, 1), (2,))}
    out = torch.empty(2, 2, w.shape[0], 2, 2, w.shape[1], dtype=torch.float64)
    for a in (0, 1):
        for b in (0, 1):
            for i in (0, 1):
                for j in (0, 1):
                    out[a, b, :, i, j] = sum(w[:, :, r, c] for r in rows[a][i] for c in rows[b][j])
    return out


@pytest.mark.parametrize("co,ci,kh,kw", [(5, 7, 3, 3), (3, 130, 3, 3), (4, 16, 1, 1), (6, 9, 2, 3)])
@pytest.mark.parametrize("strided", [False, True])
def test_weight_pack_kernel_is_the_permute(device, co, ci, kh, kw, strided):
    g = torch.Generator().manual_seed(co * 100 + ci)
    w = randn(g, co, ci, kh, kw, dtype=torch.bfloat16, device=device)
    if strided:  # a weight of other strides: kh and kw swapped in memory, a channel slice
        w = randn(g, co, ci + 3, kw, kh, dtype=torch.bfloat16, device=device).transpose(2, 3)[:, 2:ci + 2]
    out = poisoned((co, kh, kw, ci), torch.bfloat16, device)
    launch_weight_pack(w, out)
    assert torch.equal(out, w.permute(0, 2, 3, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grouped_weight_pack_is_each_permute(device, dtype):
    """One launch packs weights of other shapes, taps and strides (a
    transposed conv's [C_in, C_out] weight read as [C_out, C_in], a channel
    slice with kh and kw swapped in memory), and touches nothing else."""
    g = torch.Generator().manual_seed(3)
    ws = [randn(g, 5, 7, 3, 3, dtype=dtype, device=device), randn(g, 4, 130, 1, 1, dtype=dtype, device=device),
          randn(g, 3, 67, 3, 3, dtype=dtype, device=device),
          randn(g, 6, 5, 4, 4, dtype=dtype, device=device).transpose(0, 1),
          randn(g, 2, 12, 2, 3, dtype=dtype, device=device).transpose(2, 3)[:, 3:12]]
    # The packs lie in one poisoned buffer with gaps that must stay poisoned.
    shapes = [tuple(w.shape[i] for i in (0, 2, 3, 1)) for w in ws]
    arena = poisoned((sum(w.numel() + 5 for w in ws),), dtype, device)
    bufs, off = [], 0
    for w, shape in zip(ws, shapes):
        bufs.append(arena[off:off + w.numel()].view(shape))
        off += w.numel() + 5
    launch_grouped_weight_pack(grouped_pack_args([(w, b.permute(0, 3, 1, 2)) for w, b in zip(ws, bufs)]))
    for w, b in zip(ws, bufs):
        assert torch.equal(b, w.permute(0, 2, 3, 1))
    assert arena.isnan().sum() == 5 * len(ws)
    with pytest.raises(ValueError, match="one dtype"):
        other = torch.float32 if dtype != torch.float32 else torch.float16
        grouped_pack_args([(ws[0], bufs[0].permute(0, 3, 1, 2)), (ws[1].to(other), bufs[1].permute(0, 3, 1, 2))])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize("co,ci", [(5, 7), (3, 130)])
def test_subpixel_fold_kernel_against_float64(device, dtype, tol, co, ci):
    g = torch.Generator().manual_seed(co + ci)
    w = randn(g, co, ci, 3, 3, dtype=dtype, device=device)
    out = poisoned((2, 2, co, 2, 2, ci), dtype, device)
    launch_subpixel_fold(w, out)
    assert rel_err(out, _fold64(w)) <= tol
    # ... and functional.subpixel_weights (the kernel on a GPU) folds the same.
    assert rel_err(functional.subpixel_weights(w), _fold64(w)) <= tol
    with pytest.raises(ValueError, match="3x3"):
        launch_subpixel_fold(w[:, :, :2], out)


def test_subpixel_weights_run_the_fold_kernel_on_a_gpu(device, exact_fp32, monkeypatch):
    from conv_patch.kernels import api as kernels
    calls = []
    real = kernels.launch_subpixel_fold
    monkeypatch.setattr(kernels, "launch_subpixel_fold", lambda w, o: calls.append(1) or real(w, o))
    w = torch.randn(4, 6, 3, 3, device=device)
    x = torch.randn(1, 6, 5, 7, device=device)
    y = functional.upsample_conv2d(x, w)
    # Under the interpreter PyTorch folds (the kernel alone is tested above).
    assert calls == ([1] if device.type == "cuda" else [])
    ref = F.conv2d(F.interpolate(x.double(), scale_factor=2.0), w.double(), padding=1)
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("c,groups", [(12, 3), (10, 5)])
def test_group_norm_adds_the_input_bias_a_conv_left_out(device, channels_last, c, groups):
    g = torch.Generator().manual_seed(c)
    x = randn(g, 2, c, 7, 5, scale=2.0, device=device) + 0.5
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    b = randn(g, c, scale=3.0, device=device)
    w, beta = randn(g, c, device=device), randn(g, c, device=device)
    ref = F.silu(F.group_norm(x.double() + b.double().view(-1, 1, 1), groups, w.double(), beta.double(), 1e-6))
    out = functional.group_norm(x, groups, w, beta, 1e-6, "silu", input_bias=b)
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert rel_err(out, ref) <= 1e-5
    # In place, as the resnet recipe normalises conv1's output.
    y = x.clone()
    assert functional.group_norm(y, groups, w, beta, 1e-6, "silu", out=y, input_bias=b) is y
    assert rel_err(y, ref) <= 1e-5
    with pytest.raises(ValueError, match="input_bias"):
        functional.group_norm(x, groups, w, beta, 1e-6, input_bias=b[:-1])


def test_conv_without_bias_leaves_the_bias_to_the_norm(device, exact_fp32, monkeypatch):
    import conv_patch
    from conv_patch.routing.registry import Route
    from conv_patch.routing.decide import RouteDecision
    g = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(6, 10, 3, padding=1).to(device)
    x = randn(g, 1, 6, 9, 7, device=device).contiguous(memory_format=torch.channels_last)
    ref = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    model = torch.nn.Sequential(conv)
    conv_patch.apply(model, recipes=False)
    m = model[0]
    with torch.no_grad():
        y, b = m.forward_without_bias(x)  # a kernel route
        assert b is m.bias and rel_err(y + b.view(-1, 1, 1), ref) <= 1e-5
        assert rel_err(y, ref - conv.bias.double().view(-1, 1, 1)) <= 1e-5
        # The table's cuDNN route: F.conv2d without its bias, no epilogue pass.
        from conv_patch.runtime import dispatch, planner
        monkeypatch.setattr(planner, "decide_call", lambda mod, *a: (RouteDecision(Route.CUDNN, "test"), mod.spec))
        dispatch.clear(m)
        y, b = m.forward_without_bias(x)
        assert b is m.bias and rel_err(y + b.view(-1, 1, 1), ref) <= 1e-5
        # A call the original module takes keeps its bias.
        monkeypatch.setattr(planner, "decide_call", lambda mod, *a: (RouteDecision(Route.FALLBACK, "test"), mod.spec))
        dispatch.clear(m)
        y, b = m.forward_without_bias(x)
        assert b is None and rel_err(y, ref) <= 1e-5


def test_resnet_recipe_defers_conv1_bias_into_norm2(device, exact_fp32, monkeypatch):
    pytest.importorskip("diffusers")
    from diffusers.models.resnet import ResnetBlock2D

    import conv_patch
    torch.manual_seed(0)
    block = ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=None, groups=4,
                                                  eps=1e-6).to(device).eval()
    with torch.no_grad():
        block.conv1.bias.uniform_(-2, 2)
    x = torch.randn(1, 8, 6, 5, device=device)
    with torch.no_grad():
        ref = block(x, None).double()
    conv_patch.apply(block)
    # The deferral is taken where norm2 runs on the kernels (below their
    # crossover a GPU runs PyTorch's GroupNorm, and the bias stays in conv1).
    from conv_patch.routing import costs
    monkeypatch.setattr(costs, "GROUP_NORM_MIN_ELEMENTS", 0)
    seen = []
    from conv_patch.ops import group_norm as norm
    real = norm.group_norm
    monkeypatch.setattr(norm, "group_norm", lambda *a, **k: seen.append(k.get("input_bias")) or real(*a, **k))
    with torch.no_grad():
        y = block(x, None)
    assert len(seen) == 2 and seen[0] is None and seen[1] is block.conv1.bias
    assert rel_err(y, ref) <= 1e-5
