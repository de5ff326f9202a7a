"""GroupNorm (+ activation) kernels against a float64 reference: both
layouts, channel counts per group that are not powers of two, odd spatial
sizes, a large mean (where sum-of-squares would cancel), many splits per
group, with and without affine."""

import pytest
import torch
import torch.nn.functional as F

from conv_patch import ops
from conv_patch.target import target_for
from _util import TOL, act64, randn, rel_err

# (N, C, H, W, groups, nhwc, affine, activation, mean offset)
CASES = [
    (2, 12, 5, 7, 3, False, True, "silu", 0.0),
    (1, 12, 5, 7, 4, True, True, "silu", 0.0),
    (3, 8, 9, 4, 2, True, False, "none", 0.0),
    (1, 30, 3, 11, 5, False, True, "relu", 0.0),
    (2, 16, 6, 6, 16, True, True, "gelu", 0.0),
    (1, 8, 7, 9, 1, False, True, "none", 50.0),  # mean >> std
    (2, 12, 5, 7, 3, True, True, "silu", 50.0),  # mean >> std, NHWC (shifted sums)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_group_norm(case, dtype, device, monkeypatch):
    N, C, H, W, G, nhwc, affine, act, offset = case
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    # Small launch sizes: several blocks per program, several programs per group.
    monkeypatch.setitem(ops.GN_LAUNCH, "interpreter", (64, 16, 64))
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
        y = ops.group_norm(x, G, w, b, 1e-5, act)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last) == nhwc
    assert rel_err(y, ref) <= max(TOL[dtype], 1e-5 if dtype == torch.float32 else 0)


def test_group_norm_falls_back_where_kernels_cannot(device):
    x = torch.randn(2, 8, 5, 6, device=device)[:, :, :, 1:]  # strided: PyTorch path
    y = ops.group_norm(x, 4, activation="silu")
    assert rel_err(y, F.silu(F.group_norm(x.double(), 4))) <= 1e-5
    with pytest.raises(ValueError, match="divisible"):
        ops.group_norm(torch.randn(1, 6, 2, 2, device=device), 4)
