"""The RMS norm over channels (kernels/rms_norm.py, conv_patch.ops.rms_norm and
``dispatch.rms_norm``) against float64: the layouts the Wan-family VAEs run
(NCDHW, NDHWC, and the attention's NCHW / NHWC), channel counts that are not
multiples of the block, positions the programs do not divide, outliers, an
all-zero position (the eps branch), in place, and the planned module path
with its fallbacks. On the CPU the kernel runs under the interpreter."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.routing import costs
from conv_patch import functional
from conv_patch.ops import rms_norm as rms_op
from conv_patch.runtime.state import state_of
from conv_patch.runtime.plans import KernelFailureWarning
from conv_patch.target import target_for
from _util import TOL, act64, poisoned, randn, rel_err


def _ref(x, w, b, scale, activation):
    shape = (-1,) + (1,) * (x.dim() - 2)
    y = F.normalize(x.double(), dim=1) * scale * w.double().reshape(shape)
    if b is not None:
        y = y + b.double().reshape(shape)
    return act64(y, activation)


CASES = [
    # shape, memory format
    ((2, 37, 3, 5, 7), torch.contiguous_format),
    ((1, 97, 2, 3, 11), torch.channels_last_3d),  # more channels than one block
    ((3, 70, 6, 9), torch.channels_last),
    ((2, 5, 4, 3), torch.contiguous_format),
]


@pytest.mark.parametrize("shape,fmt", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("none", True), ("leaky_relu_0.1", True)])
def test_rms_norm_matches_float64(device, shape, fmt, dtype, activation, bias):
    g = torch.Generator().manual_seed(sum(shape) + len(activation))
    x = randn(g, *shape)
    # Outliers: a tenth of the positions 300x larger (fp16 squares stay finite in fp32).
    far = torch.rand(shape[0], 1, *shape[2:], generator=g) < 0.1
    x = torch.where(far, x * 300, x).to(dtype=dtype, device=device).contiguous(memory_format=fmt)
    w = randn(g, shape[1], *([1] * (len(shape) - 2)), dtype=dtype, device=device)
    b = randn(g, *w.shape, dtype=dtype, device=device) if bias else None
    scale = shape[1] ** 0.5
    out = poisoned(shape, dtype, device).contiguous(memory_format=fmt)
    y = functional.rms_norm(x, w, b, scale, activation=activation, out=out)
    assert y is out and y.stride() == x.stride()
    assert rel_err(y, _ref(x, w, b, scale, activation)) <= TOL[dtype]


def test_a_zero_position_gives_the_bias_and_in_place_works(device):
    g = torch.Generator().manual_seed(1)
    x = randn(g, 2, 6, 3, 4, 5, device=device)
    x[1, :, 2, 3, 4] = 0.0  # F.normalize: 0 / max(0, eps) = 0
    w, b = randn(g, 6, 1, 1, 1, device=device), randn(g, 6, 1, 1, 1, device=device)
    ref = _ref(x, w, b, 2.0, "silu")
    y = functional.rms_norm(x, w, b, 2.0, activation="silu", out=x)
    assert y is x and rel_err(y, ref) <= TOL[torch.float32]
    assert torch.allclose(y[1, :, 2, 3, 4].double(), F.silu(b.double().view(-1)), atol=1e-6)


def test_the_op_refuses_misshaped_calls_and_runs_pytorch_on_strided_views(device):
    x = torch.randn(2, 4, 3, 6, device=device)
    with pytest.raises(ValueError, match="out must match"):
        functional.rms_norm(x, out=torch.empty(2, 4, 3, 5, device=device))
    with pytest.raises(ValueError, match=r"\[N, C, \.\.\.\]"):
        functional.rms_norm(torch.randn(3, 4, device=device))
    # A view whose positions do not share one stride: the eager expression.
    view = torch.randn(2, 4, 6, 8, device=device)[:, :, ::2, 1:7]
    assert rms_op.rms_norm_target(view, None, None) is None
    w = torch.randn(4, 1, 1, device=device)
    assert rel_err(functional.rms_norm(view, w, None, 2.0), _ref(view, w, None, 2.0, "none")) <= TOL[torch.float32]


class RMS_norm(nn.Module):
    """The Wan-family norm's contract (F.normalize over channels, * scale * gamma + bias)."""

    def __init__(self, dim, images=False, bias=False):
        super().__init__()
        self.channel_first = True
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.randn(dim, *((1, 1) if images else (1, 1, 1))))
        self.bias = nn.Parameter(torch.randn_like(self.gamma)) if bias else 0.0

    def forward(self, x):
        return F.normalize(x, dim=1) * self.scale * self.gamma + self.bias


def test_planned_module_calls_replay_and_fall_back_once(device, monkeypatch):
    from triton.runtime.errors import OutOfResources
    from conv_patch.recipes.fuse import rms_norm as step
    norm = RMS_norm(9, bias=True).to(device).eval()
    x = torch.randn(1, 9, 2, 5, 3, device=device)
    with torch.no_grad():
        ref = norm(x)
        y1, y2 = step(norm, x, "silu"), step(norm, x, "silu")
    assert rel_err(y1, F.silu(ref)) <= TOL[torch.float32] and torch.equal(y1, y2)
    plan = state_of(norm).norm_plan
    assert plan.kernel and plan.program is not None and len(state_of(norm).plans) == 1
    # A kernel that cannot be built here: PyTorch's answer, warned once.
    other = RMS_norm(9).to(device).eval()
    tries = []

    def fails(*a, **k):
        tries.append(1)
        raise OutOfResources(262144, 232448, "shared memory")
    monkeypatch.setattr(rms_op, "rms_norm", fails)
    with torch.no_grad(), pytest.warns(KernelFailureWarning, match="OutOfResources"):
        assert rel_err(step(other, x), other(x)) <= TOL[torch.float32]
    with torch.no_grad():
        assert rel_err(step(other, x), other(x)) <= TOL[torch.float32]
    assert len(tries) == 1 and not state_of(other).norm_plan.kernel and "OutOfResources" in state_of(other).norm_plan.why
    # Autograd: the module's own computation.
    norm.gamma.requires_grad_(True)
    y = step(norm, x)
    assert y.requires_grad and not state_of(norm).norm_plan.kernel


def test_cost_rule_keeps_pytorch_only_where_it_is_predicted_faster():
    # One pass against eight: the kernel pays at every size, launched or from a graph ...
    for n in (1 << 10, 1 << 20, 1 << 28):
        assert costs.rms_norm_pays(n, 2, True) and costs.rms_norm_pays(n, 2, False, graph=True)
    # ... unless its host time were far above PyTorch's eight launches.
    slow_host = costs.default_calibration().with_host(base=200.0)
    assert not costs.rms_norm_pays(1 << 10, 2, False, cal=slow_host)
    assert costs.rms_norm_pays(1 << 28, 2, False, cal=slow_host)  # GPU-bound there


def test_launch_tiles_read_a_position_once_up_to_512_channels():
    """On a GPU every channel of a position fits one block up to 512
    channels (one read of the input), larger ones loop (two reads); the
    interpreter keeps its few large programs."""
    from conv_patch.ops.rms_norm import launch_tiles
    for c in (5, 96, 97, 192, 384, 512):
        for contiguous in (True, False):
            bc, bs, warps = launch_tiles(c, contiguous, False)
            assert c <= bc < 2 * c and bs >= 1 and warps in (4, 8)
    assert launch_tiles(96, True, False) == (128, 32, 4) and launch_tiles(96, False, False) == (128, 64, 8)
    assert launch_tiles(513, True, False)[0] < 513
    assert launch_tiles(96, True, True)[0] == 64


@pytest.mark.parametrize("shape,fmt", CASES[:3])
@pytest.mark.parametrize("weight", [True, False])
def test_diffusers_rms_norm_over_channels_matches_float64(device, shape, fmt, weight):
    """``eps_added``: diffusers' ``RMSNorm`` over the channels,
    ``x * rsqrt(mean_C(x^2) + eps)`` (LTX-Video's VAE), which differs from
    F.normalize's ``x / max(||x||, eps)`` where ``||x||`` is small: tiny
    positions are in the data on purpose."""
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    g = torch.Generator().manual_seed(sum(shape))
    x = randn(g, *shape)
    tiny = torch.rand(shape[0], 1, *shape[2:], generator=g) < 0.2
    x = torch.where(tiny, x * 1e-5, x).to(device=device).contiguous(memory_format=fmt)
    w = randn(g, shape[1], device=device) if weight else None
    eps = 1e-8
    x64 = x.double().cpu()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(1, keepdim=True) + eps)
    if w is not None:
        ref = ref * w.double().cpu().view(-1, *([1] * (len(shape) - 2)))
    ref = F.silu(ref)
    out = poisoned(shape, torch.float32, device).contiguous(memory_format=fmt)
    y = functional.rms_norm(x, w, None, 1.0, eps, "silu", out=out, eps_added=True)
    assert y is out and rel_err(y, ref) <= 1e-5
    # The eager expression the op falls back to computes the same.
    from conv_patch.ops.rms_norm import torch_rms_norm
    assert rel_err(torch_rms_norm(x, w, None, 1.0, eps, "silu", eps_added=True), ref) <= 1e-5


@pytest.mark.parametrize("affine", [False, True])
def test_a_diffusers_rms_norm_over_channels_replays_a_recorded_plan(device, affine):
    """LTX-Video's norms: diffusers' ``RMSNorm`` over the channels, without
    a weight (``elementwise_affine=False``, LTX-Video's VAE) and with one,
    against float64, and planned as a recorded program that replays its
    launch (a stand-in weight made per call was no tensor of the call's:
    the plan could not be recorded and every call went the op's whole way,
    with a fill launch of its own)."""
    diffusers_norm = pytest.importorskip("diffusers.models.normalization")
    from conv_patch.recipes.fuse import channel_rms_norm
    g = torch.Generator().manual_seed(7 + affine)
    norm = diffusers_norm.RMSNorm(37, eps=1e-6, elementwise_affine=affine).to(device).eval()
    if affine:
        with torch.no_grad():
            norm.weight.copy_(randn(g, 37))
    x = randn(g, 2, 37, 3, 5, 7)
    far = torch.rand(2, 1, 3, 5, 7, generator=g) < 0.1
    x = torch.where(far, x * 300 + 40, x).to(device)  # outliers on a large mean
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(1, keepdim=True) + 1e-6)
    if affine:
        ref = ref * norm.weight.double().view(-1, 1, 1, 1)
    with torch.no_grad():
        y1 = channel_rms_norm(norm, x, "silu")
        y2 = channel_rms_norm(norm, x, "silu")
    assert rel_err(y1, F.silu(ref)) <= TOL[torch.float32] and torch.equal(y1, y2)
    if target_for(x.device).kernels:
        plan = state_of(norm).norm_plan
        assert plan.kernel and plan.program is not None


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last_3d])
def test_a_norm_of_a_slice_is_planned_and_written_dense(device, fmt):
    """LTX-Video's first resnet after a time upsample normalises the clip
    with its first frame dropped, a slice of a larger tensor: the output is
    dense in the slice's order of axes, the answer float64's, and the plan
    recorded (an output made with the slice's strides was no tensor the
    plan could name)."""
    diffusers_norm = pytest.importorskip("diffusers.models.normalization")
    from conv_patch.recipes.fuse import channel_rms_norm
    g = torch.Generator().manual_seed(11)
    norm = diffusers_norm.RMSNorm(19, eps=1e-6, elementwise_affine=False).to(device).eval()
    whole = randn(g, 2, 19, 6, 5, 3, device=device).contiguous(memory_format=fmt)
    x = whole[:, :, 1:]
    assert not x.is_contiguous(memory_format=fmt)
    x64 = x.double()
    ref = F.silu(x64 * torch.rsqrt(x64.pow(2).mean(1, keepdim=True) + 1e-6))
    with torch.no_grad():
        y1 = channel_rms_norm(norm, x, "silu")
        y2 = channel_rms_norm(norm, x, "silu")
    assert rel_err(y1, ref) <= TOL[torch.float32] and torch.equal(y1, y2)
    if target_for(x.device).kernels:
        assert y1.is_contiguous(memory_format=fmt)
        assert state_of(norm).norm_plan.program is not None
