"""conv3d (kernels/conv3d.py through conv_patch.functional.conv3d) against a float64
reference: F.conv3d of the padded concatenation [cache, x] along time.

Under the Triton interpreter on the CPU (CI) and on the GPU when there is
one. Shapes are small but awkward: odd T/H/W, channel counts not multiples
of 8, per-axis kernel sizes, strides, dilations and front/back paddings,
causal time padding with and without cached frames, both layouts.
"""

import copy
from typing import NamedTuple, Optional

import pytest
import torch
import torch.nn.functional as F

from conv_patch.ops import conv3d as conv3d_mod
from conv_patch import functional
from conv_patch.runtime.state import state_of
from _util import TOL, act64, randn, rel_err

CL3 = torch.channels_last_3d


class Case(NamedTuple):
    n: int
    c_in: int
    c_out: int
    thw: tuple                       # input (T, H, W)
    k: tuple                         # (KT, KH, KW)
    stride: tuple = (1, 1, 1)
    padding: object = 0              # conv3d's padding argument
    dilation: tuple = (1, 1, 1)
    time_padding: Optional[tuple] = None
    tc: int = 0                      # cached frames in front of x
    nhwc: bool = False               # x (and out) channels_last_3d
    bias: bool = True
    residual: Optional[str] = None   # None, "ncdhw", "ndhwc" or "unfoldable" (see _unfoldable)
    act: str = "none"

    def __str__(self):
        return (f"n{self.n}c{self.c_in}-{self.c_out}x{'x'.join(map(str, self.thw))}k{''.join(map(str, self.k))}"
                f"s{''.join(map(str, self.stride))}p{self.padding}d{''.join(map(str, self.dilation))}"
                f"tp{self.time_padding}tc{self.tc}{'cl' if self.nhwc else ''}{'b' if self.bias else ''}"
                f"r{self.residual}{self.act}")


CASES = [
    # 1x1x1 and 3x3x3, plain.
    Case(1, 3, 5, (3, 5, 7), (1, 1, 1)),
    Case(2, 5, 7, (5, 7, 6), (3, 3, 3), padding=1, nhwc=True, bias=False),
    # Mixed kernels: a temporal-only and a spatial-only conv.
    Case(1, 7, 13, (7, 5, 5), (3, 1, 1), stride=(2, 1, 1), padding=(1, 0, 0)),
    Case(1, 13, 3, (3, 9, 7), (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), nhwc=True,
         residual="ndhwc", act="silu"),
    # Strides 2 on every axis, front/back padding differing per axis.
    Case(1, 5, 7, (7, 9, 8), (3, 3, 3), stride=(2, 2, 2), padding=((1, 0), (0, 1), 1)),
    Case(1, 5, 5, (5, 7, 7), (3, 3, 3), stride=(1, 2, 1), padding=(1, 2, 2), dilation=(1, 2, 2), nhwc=True),
    # Causal time padding (front only), no cache; dilation 2 in time.
    Case(1, 5, 7, (5, 6, 7), (3, 3, 3), padding=(0, 1, 1), dilation=(2, 1, 1), time_padding=(4, 0),
         residual="ncdhw"),
    Case(2, 3, 5, (5, 5, 6), (3, 3, 3), padding=(0, 1, 1), time_padding=(2, 0), nhwc=True, act="silu"),
    # Cached frames in front of x: Tc = 2 with the causal front padding of a
    # streaming video VAE (the first chunk is padded, later ones read their
    # cache), Tc = 1 with one front pad, and a strided cache without padding.
    Case(1, 5, 7, (3, 7, 6), (3, 3, 3), padding=(0, 1, 1), tc=2, nhwc=True, residual="ndhwc", act="silu"),
    Case(1, 7, 5, (4, 5, 7), (3, 3, 3), padding=(0, 1, 1), time_padding=(1, 0), tc=1),
    Case(2, 3, 13, (5, 5, 5), (3, 1, 1), stride=(2, 1, 1), tc=2, nhwc=True, bias=False, residual="ncdhw"),
    Case(1, 5, 3, (1, 6, 5), (3, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), time_padding=(1, 1), tc=1,
         act="silu"),
    Case(1, 6, 9, (3, 5, 6), (3, 3, 3), padding=1, nhwc=True, residual="ndhwc", act="leaky_relu_0.2"),
]


def _inputs(case: Case, dtype, device, gen, *, shift=0.0, outliers=0):
    t, h, w = case.thw
    x = randn(gen, case.n, case.c_in, t, h, w, dtype=torch.float64, device="cpu") + shift
    cache = (randn(gen, case.n, case.c_in, case.tc, h, w, dtype=torch.float64, device="cpu") + shift
             if case.tc else None)
    if outliers:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (outliers,), generator=gen)
        flat[idx] = 1e3 * torch.sign(torch.randn(outliers, generator=gen, dtype=torch.float64))
    fmt = CL3 if case.nhwc else torch.contiguous_format
    x = x.to(dtype=dtype, device=device).contiguous(memory_format=fmt)
    if cache is not None:
        cache = cache.to(dtype=dtype, device=device).contiguous(memory_format=fmt)
    kt, kh, kw = case.k
    wt = randn(gen, case.c_out, case.c_in, kt, kh, kw, scale=(case.c_in * kt * kh * kw) ** -0.5,
               dtype=dtype, device=device)
    b = randn(gen, case.c_out, dtype=dtype, device=device) if case.bias else None
    return x, cache, wt, b


def _reference(case: Case, x, cache, w, b):
    """F.conv3d in float64 of the padded [cache, x]."""
    full = x.double().cpu()
    if cache is not None:
        full = torch.cat([cache.double().cpu(), full], dim=2)
    (t0, t1), (h0, h1), (w0, w1) = functional.conv3d_padding(case.padding, case.time_padding)
    full = F.pad(full, (w0, w1, h0, h1, t0, t1))
    return F.conv3d(full, w.double().cpu(), None if b is None else b.double().cpu(), case.stride, 0,
                    case.dilation)


def check(case: Case, dtype, device, *, seed=0, config=None, force_int64=False, shift=0.0, outliers=0,
          out_view=None):
    gen = torch.Generator().manual_seed(seed)
    x, cache, w, b = _inputs(case, dtype, device, gen, shift=shift, outliers=outliers)
    ref = _reference(case, x, cache, w, b)
    r, beta, scale = None, 1.0, 1.0
    if case.residual is not None:
        r = randn(gen, *ref.shape, dtype=dtype, device=device)
        if case.residual == "ndhwc":
            r = r.contiguous(memory_format=CL3)
        elif case.residual == "unfoldable":
            r = _unfoldable(ref.shape, dtype, device).copy_(r)
        beta = 0.7
        ref = ref + beta * r.double().cpu()
    if case.act != "none" or case.residual is not None:
        scale = 0.5
    ref = scale * act64(ref, case.act)
    if out_view is None:
        out = torch.full(ref.shape, float("nan"), dtype=dtype, device=device)
        out = out.contiguous(memory_format=CL3 if case.nhwc else torch.contiguous_format)
    else:
        out = out_view(ref.shape, dtype, device)
    y = functional.conv3d(x, w, b, case.stride, case.padding, case.dilation, cache=cache,
                   time_padding=case.time_padding, residual=r, beta=beta, activation=case.act,
                   out_scale=scale, out=out, config=config, force_int64=force_int64)
    assert y.data_ptr() == out.data_ptr()
    err = rel_err(y, ref)
    assert err <= TOL[dtype], f"{case} {dtype}: rel err {err:.3g}"
    return y


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv3d_fp32(case, device, exact_fp32):
    check(case, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[1], CASES[8], CASES[10]], ids=str)
def test_conv3d_half(case, dtype, device):
    check(case, dtype, device, seed=1)


# Tiles smaller than the problem: several row and column tiles, tiles
# inside one output frame (the frame-skipping path), partial GROUP_M groups,
# two channel blocks per tap (20 > BLOCK_K).
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 3, "num_warps": 4, "num_stages": 2}


def test_conv3d_small_tiles(device, exact_fp32):
    check(Case(1, 20, 17, (3, 5, 6), (3, 3, 3), padding=(0, 1, 1), time_padding=(1, 0), tc=1, nhwc=True,
               residual="ncdhw"), torch.float32, device, config=SMALL_TILES)


# The sm90 TMA kernel (kernels/conv3d_tma.py; under the interpreter on the
# CPU): dense NDHWC inputs, H and W at stride 1, C_in a multiple of 8 (16
# bytes in fp16; 8 fp32 values keep both dtypes aligned). Tiles of several
# frame rows and of one, cached frames in front with and without front
# padding left, time stride 2, time dilation, a residual in either layout.
TMA = {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_W": 8, "GROUP_M": 3, "num_warps": 4,
       "num_stages": 1}
TMA_CASES = [
    Case(1, 8, 5, (3, 5, 7), (3, 3, 3), padding=(0, 1, 1), time_padding=(2, 0), nhwc=True),
    Case(2, 16, 7, (3, 6, 5), (3, 3, 3), padding=(0, 1, 1), tc=2, nhwc=True, residual="ncdhw", act="silu"),
    Case(1, 24, 13, (4, 5, 9), (3, 3, 3), padding=(0, 1, 1), time_padding=(1, 0), tc=1, nhwc=True,
         residual="ndhwc"),
    Case(1, 8, 9, (5, 4, 6), (3, 1, 1), stride=(2, 1, 1), tc=1, nhwc=True, bias=False),
    Case(1, 8, 6, (6, 5, 5), (3, 3, 3), padding=(0, 2, 1), dilation=(2, 2, 1), time_padding=(4, 0), nhwc=True),
    Case(1, 16, 4, (2, 7, 5), (1, 1, 1), nhwc=True, act="silu"),
    # Time stride and dilation with cached frames, padding at both ends:
    # taps split unevenly between the cache's loop and the input's.
    Case(1, 8, 5, (5, 4, 5), (3, 3, 3), stride=(2, 1, 1), dilation=(2, 1, 1), padding=(0, 1, 1),
         time_padding=(3, 2), tc=3, nhwc=True, residual="ndhwc"),
]


@pytest.mark.parametrize("case", TMA_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_conv3d_tma(case, dtype, device, exact_fp32):
    if device.type == "cuda" and (dtype == torch.float32 or torch.cuda.get_device_capability() < (9, 0)):
        pytest.skip("the TMA kernel runs fp16/bf16 on sm90+")
    check(case, dtype, device, seed=2, config=TMA if dtype == torch.float32 else dict(TMA, BLOCK_W=64))


# Output channels split in two blocks (BLOCK_N2): one tile covering all of
# them, the second block cut short by C_out; and two tiles over 40 channels,
# the second partly past C_out.
@pytest.mark.parametrize("case", [
    Case(1, 16, 24, (3, 5, 6), (3, 3, 3), padding=(0, 1, 1), tc=2, nhwc=True, residual="ndhwc", act="silu"),
    Case(1, 8, 40, (2, 4, 9), (3, 3, 3), padding=(0, 1, 1), time_padding=(1, 0), tc=1, nhwc=True),
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_conv3d_tma_split_n(case, dtype, device, exact_fp32):
    if device.type == "cuda" and (dtype == torch.float32 or torch.cuda.get_device_capability() < (9, 0)):
        pytest.skip("the TMA kernel runs fp16/bf16 on sm90+")
    check(case, dtype, device, seed=3, config=dict(TMA, BLOCK_N2=16))


def test_conv3d_tma_refuses_what_it_cannot_take(device):
    # (On a GPU in half precision: there fp32 is refused before the layout is looked at.)
    dt = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, 8, 3, 5, 5, device=device, dtype=dt)  # NCDHW
    w = torch.randn(4, 8, 3, 3, 3, device=device, dtype=dt)
    with pytest.raises(ValueError, match="not dense NDHWC"):
        functional.conv3d(x, w, padding=1, config=TMA, route="kernel")
    with pytest.raises(ValueError, match="H and W at stride 1"):
        functional.conv3d(x.contiguous(memory_format=CL3), w, stride=(1, 2, 2), padding=1, config=TMA, route="kernel")


def test_conv3d_int64_offsets(device, exact_fp32):
    check(CASES[8], torch.float32, device, force_int64=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv3d_adversarial(dtype, device, exact_fp32):
    """A large mean (the reduction's cancellation) and a few outliers."""
    check(Case(1, 7, 5, (3, 6, 5), (3, 3, 3), padding=(0, 1, 1), time_padding=(1, 0), tc=1, nhwc=True),
          dtype, device, seed=2, shift=100.0, outliers=5)


def _unfoldable(shape, dtype, device):
    """An output view whose D stride is not OH * its H stride."""
    n, c, d, h, w = shape
    return torch.full((n, c, d, h + 3, w), float("nan"), dtype=dtype, device=device)[:, :, :, 1:h + 1]


def test_conv3d_unfoldable_output_and_residual(device, exact_fp32):
    case = Case(1, 5, 7, (3, 5, 6), (3, 3, 3), padding=(0, 1, 1), tc=2, residual="unfoldable", act="silu")
    check(case, torch.float32, device, out_view=_unfoldable)


def test_conv3d_cache_strided_view(device, exact_fp32):
    """The cache is a slice of the previous chunk (its last two frames), in
    the other layout than x."""
    g = torch.Generator().manual_seed(3)
    x = randn(g, 1, 5, 3, 7, 6, device=device).contiguous(memory_format=CL3)
    prev = randn(g, 1, 5, 4, 7, 6, device=device)
    w = randn(g, 6, 5, 3, 3, 3, scale=0.1, device=device)
    b = randn(g, 6, device=device)
    y = functional.conv3d(x, w, b, padding=(0, 1, 1), cache=prev[:, :, -2:])
    assert y.is_contiguous(memory_format=CL3)
    full = torch.cat([prev[:, :, -2:], x], dim=2).double().cpu()
    ref = F.conv3d(full, w.double().cpu(), b.double().cpu(), 1, (0, 1, 1))
    assert rel_err(y, ref) <= TOL[torch.float32]


def test_joined_frames_keep_the_inputs_layout():
    """The PyTorch routes join a cache sliced from an NCDHW chunk and an
    NDHWC input in the input's layout (torch.cat alone would follow the
    first piece's), so that cuDNN's output keeps it too."""
    from conv_patch.ops.conv3d import join_frames
    g = torch.Generator().manual_seed(5)
    x = randn(g, 1, 5, 3, 4, 6).contiguous(memory_format=CL3)
    prev = randn(g, 1, 5, 4, 4, 6)
    for fmt in (CL3, torch.contiguous_format):
        full = join_frames([prev[:, :, -2:], x], fmt)
        assert full.is_contiguous(memory_format=fmt) and torch.equal(full, torch.cat([prev[:, :, -2:], x], 2))
    assert join_frames([x], CL3) is x


def test_conv3d_output_layout(device):
    g = torch.Generator().manual_seed(4)
    x = randn(g, 1, 3, 3, 5, 5, device=device)
    w = randn(g, 4, 3, 1, 3, 3, device=device)
    assert functional.conv3d(x, w, padding=(0, 1, 1)).is_contiguous()
    assert functional.conv3d(x.contiguous(memory_format=CL3), w, padding=(0, 1, 1)).is_contiguous(memory_format=CL3)


def test_conv3d_pytorch_fallback(device):
    """float64 (no kernel takes it) runs the PyTorch expression, epilogue and cache included."""
    case = Case(1, 3, 5, (3, 5, 5), (3, 3, 3), padding=(0, 1, 1), time_padding=(1, 0), tc=1,
                residual="ncdhw", act="silu")
    g = torch.Generator().manual_seed(5)
    x, cache, w, b = _inputs(case, torch.float64, device, g)
    r = randn(g, 1, 5, 3, 5, 5, dtype=torch.float64, device=device)
    ref = 0.5 * F.silu(_reference(case, x, cache, w, b) + 0.7 * r.cpu())
    y = functional.conv3d(x, w, b, padding=(0, 1, 1), time_padding=(1, 0), cache=cache, residual=r, beta=0.7,
                   activation="silu", out_scale=0.5)
    assert rel_err(y, ref) <= 1e-12


def test_conv3d_bad_calls_raise(device):
    g = torch.Generator().manual_seed(6)
    x = randn(g, 1, 4, 3, 5, 5, device=device)
    w = randn(g, 6, 4, 3, 3, 3, device=device)
    with pytest.raises(ValueError, match="groups = 2"):
        functional.conv3d(x, randn(g, 6, 2, 3, 3, 3, device=device), padding=1)
    with pytest.raises(ValueError, match="input channels"):
        functional.conv3d(x, randn(g, 6, 3, 3, 3, 3, device=device), padding=1)
    with pytest.raises(ValueError, match="5-D"):
        functional.conv3d(x[0], w)
    with pytest.raises(ValueError, match="cache has shape"):
        functional.conv3d(x, w, padding=1, cache=randn(g, 1, 4, 2, 5, 4, device=device))
    with pytest.raises(ValueError, match="larger than the padded input"):
        functional.conv3d(x[:, :, :2], w, padding=(0, 1, 1))
    with pytest.raises(ValueError, match="residual has shape"):
        functional.conv3d(x, w, padding=1, residual=torch.ones(1, 6, 3, 5, 4, device=device))
    with pytest.raises(ValueError, match="negative padding"):
        functional.conv3d(x, w, padding=1, time_padding=(-1, 0))
    with pytest.raises(ValueError, match="activation 'tanh'"):
        functional.conv3d(x, w, padding=1, activation="tanh")


@pytest.mark.gpu
def test_conv3d_bf16_wan_shape_gpu():
    """bf16 on a Wan-VAE-like causal conv (96 channels, 3x3x3, a 5-frame chunk
    after 2 cached frames): no further from float64 than 1.5x PyTorch's own
    bf16 F.conv3d of the concatenation."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    x = randn(g, 1, 96, 5, 40, 40, dtype=torch.bfloat16, device=dev).contiguous(memory_format=CL3)
    cache = randn(g, 1, 96, 2, 40, 40, dtype=torch.bfloat16, device=dev).contiguous(memory_format=CL3)
    w = randn(g, 96, 96, 3, 3, 3, scale=(96 * 27) ** -0.5, dtype=torch.bfloat16, device=dev)
    b = randn(g, 96, dtype=torch.bfloat16, device=dev)
    out = torch.full((1, 96, 5, 40, 40), float("nan"), dtype=torch.bfloat16, device=dev)
    y = functional.conv3d(x, w, b, padding=(0, 1, 1), cache=cache, out=out.contiguous(memory_format=CL3),
                   route="kernel")
    full = torch.cat([cache, x], dim=2)
    ref = F.conv3d(full.double(), w.double(), b.double(), 1, (0, 1, 1))
    torch_bf16 = F.conv3d(full, w, b, 1, (0, 1, 1))
    err, base = rel_err(y, ref), rel_err(torch_bf16, ref)
    assert err <= 1.5 * base, f"rel err {err:.3g} against PyTorch's bf16 {base:.3g}"


def test_gpu_default_route_is_pytorch_until_measured(monkeypatch):
    """On a GPU (a target that is not the interpreter) the kernel runs only
    where ``route="kernel"`` asks: conv3d has no measured table entries, so
    it is not known to beat cuDNN. ``route="pytorch"`` never launches."""
    from conv_patch.target import Target
    launched = []
    from conv_patch.kernels import conv3d as kernel_module
    monkeypatch.setattr(kernel_module, "launch_conv3d", lambda *a, **kw: launched.append(1) or kw and a[4])
    g = torch.Generator().manual_seed(3)
    x, w = randn(g, 1, 3, 3, 5, 5), randn(g, 4, 3, 3, 3, 3)
    ref = F.conv3d(x, w, None, 1, 1)
    assert rel_err(functional.conv3d(x, w, padding=1, route="pytorch"), ref) <= TOL[torch.float32]
    assert not launched
    monkeypatch.setattr(functional, "target_for", lambda device: Target("sm90", True))
    assert rel_err(functional.conv3d(x, w, padding=1), ref) <= TOL[torch.float32]
    assert not launched
    functional.conv3d(x, w, padding=1, route="kernel")
    assert launched
    with pytest.raises(ValueError, match="route"):
        functional.conv3d(x, w, route="cudnn")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cudnn_route_equals_the_padded_concatenation(case, exact_fp32):
    """The cuDNN route (``cudnn_conv3d``: time padding and cached frames in
    one concatenation, the symmetric padding given to the conv, bias and
    epilogue as one pass on NDHWC) computes what the module's own forward
    does (the concatenation, F.pad, F.conv3d, eager epilogue ops), in both
    layouts, with every padding, stride, cache and epilogue of the matrix."""
    gen = torch.Generator().manual_seed(7)
    x, cache, w, b = _inputs(case, torch.float32, "cpu", gen)
    ref = _reference(case, x, cache, w, b)
    r, beta, scale = None, 1.0, 1.0
    if case.residual is not None:
        r = randn(gen, *ref.shape, dtype=torch.float32, device="cpu")
        if case.residual == "ndhwc":
            r = r.contiguous(memory_format=CL3)
        beta, scale = 0.7, 0.5
        ref = ref + beta * r.double()
    ref = scale * act64(ref, case.act)
    pads = functional.conv3d_padding(case.padding, case.time_padding)
    y = conv3d_mod.cudnn_conv3d(x, w, b, cache, pads, case.stride, case.dilation, residual=r, beta=beta,
                                activation=case.act, out_scale=scale)
    assert y.shape == ref.shape and rel_err(y, ref) <= TOL[torch.float32], case


def test_dispatch_takes_the_cudnn_route_for_unmeasured_calls_on_a_gpu(monkeypatch, exact_fp32):
    """On a GPU whose table has conv3d entries, a causal conv call the table
    never measured runs the cuDNN route (its label says so) and equals the
    module's own forward, with and without cached frames, in NDHWC; with
    autograd it is the module's own forward."""
    pytest.importorskip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
    import conv_patch
    from conv_patch.routing.registry import Route
    from conv_patch.target import Target
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.conv = WanCausalConv3d(5, 7, 3, padding=1)
    twin = copy.deepcopy(holder.conv)
    conv_patch.apply(holder)
    m = holder.conv
    from conv_patch.runtime import dispatch, planner
    for mod in (dispatch, planner):
        monkeypatch.setattr(mod, "target_for", lambda device: Target("sm90", True, sms=132))
    g = torch.Generator().manual_seed(1)
    x = randn(g, 1, 5, 3, 6, 7).contiguous(memory_format=CL3)
    cache = randn(g, 1, 5, 2, 6, 7).contiguous(memory_format=CL3)
    with torch.no_grad():
        for args in ((x,), (x, cache)):
            y = m(*args)
            assert rel_err(y, twin(*args)) <= TOL[torch.float32]
            assert state_of(m).last.route is Route.CUDNN and "not measured on sm90" in state_of(m).last.label()
    x.requires_grad_(True)
    m(x).sum().backward()
    assert state_of(m).last.route is Route.FALLBACK and x.grad is not None
