"""The Hopper TMA kernel (route conv2d_tma) and the routing rules around it.

The kernel runs under the Triton interpreter in CI (descriptor loads are
emulated there, bf16 dots upcast) and for real on sm90 GPUs, where the same
cases run in bf16 and fp16 against a float64 reference. NCHW cases go through
the NHWC staging copy and must come back NCHW.
"""

import pytest
import torch
import torch.nn.functional as F

from conv_patch import PatchConfig, functional
from conv_patch.routing import tables as config_tables
from conv_patch.routing.registry import Route, tma_problem
from conv_patch.routing.decide import decide
from conv_patch.specs import CallDesc, ConvSpec, layout_of, nhwc_pitch
from conv_patch.target import Target, target_for
from conv_patch.ops import conv2d as conv2d_op
from _util import poisoned, rel_err
from test_kernels import check_conv

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
needs_tma = pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90, reason="GPU without TMA")

# (N, C_in, H, W, C_out, k, stride, padding, dilation, nhwc, bias, act, residual):
# channel counts that leave partial channel blocks (24 with BLOCK_K 16) and
# partial column tiles (20, 33, 17), widths past one BLOCK_W, every padding
# form, dilation, both layouts of input and residual.
TMA_CASES = [
    (2, 24, 9, 16, 20, 3, 1, 1, 1, True, True, "silu", "nchw"),
    (1, 16, 7, 8, 33, 3, 1, 1, 1, False, False, "none", None),
    (1, 8, 10, 16, 5, 2, 1, 0, 1, True, True, "relu", "nhwc"),
    (2, 16, 11, 24, 17, 3, 1, 2, 2, False, True, "gelu", "nhwc"),
    (1, 32, 13, 8, 40, 4, 1, "same", 1, True, True, "none", None),
    (1, 8, 6, 16, 16, 5, 1, (2, 0), 1, False, True, "gelu_tanh", None),
    (1, 16, 12, 40, 24, 3, 1, 1, 1, True, True, "none", None),
    (3, 8, 5, 8, 8, 3, 1, "valid", 1, False, False, "silu", "nchw"),
    (2, 16, 1, 1, 24, 3, 1, 1, 1, False, True, "none", None),  # 1x1 spatial: both layouts at once
    (1, 8, 7, 13, 8, 3, 1, 1, 1, False, True, "relu", None),  # NCHW width 13: any width
    # Stride > 1: boxes of the [N, H/S, S, W/S, S*C] view.
    (2, 32, 10, 18, 24, 3, 2, 1, 1, True, True, "silu", "nhwc"),
    (1, 16, 12, 8, 20, 3, 2, 0, 1, False, True, "none", None),
    (1, 16, 8, 14, 16, 3, 2, 2, 2, True, False, "relu", None),
    (1, 32, 6, 12, 8, 4, 2, 1, 1, True, True, "none", "nchw"),
    (1, 16, 8, 10, 16, 3, (2, 1), 1, 1, True, True, "none", None),
    (1, 48, 16, 16, 16, 3, 4, 1, 1, False, True, "gelu", None),
    (1, 16, 9, 16, 24, 3, 1, 1, 1, True, True, "leaky_relu_0.2", "nhwc"),
]

TMA_TILES = {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_W": 8,
             "GROUP_M": 3, "num_warps": 4, "num_stages": 3}
TMA_WIDE = {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_W": 32,
            "GROUP_M": 8, "num_warps": 4, "num_stages": 2}


@needs_tma
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", TMA_CASES, ids=str)
def test_tma_conv2d(case, dtype, device):
    check_conv(case, dtype, device, config=TMA_TILES, seed=3)


@needs_tma
@pytest.mark.parametrize("case", [TMA_CASES[0], TMA_CASES[3], TMA_CASES[6]], ids=str)
def test_tma_conv2d_wide_tiles_int64(case, device):
    check_conv(case, torch.bfloat16, device, config=TMA_WIDE, force_int64=True, seed=4)


@needs_tma
@pytest.mark.parametrize("n,c,h,w", [(1, 32, 10, 14), (2, 16, 6, 8)])
def test_tma_stride2_with_a_folded_downsample_pad(n, c, h, w, device):
    """diffusers' Downsample2D: F.pad(x, (0, 1, 0, 1)) then a stride-2 3x3
    conv, the pad folded into the bounds (the box past the last row and
    column reads TMA zeros)."""
    g = torch.Generator().manual_seed(h)
    x = torch.randn(n, c, h, w, generator=g).to(device, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    wt = (torch.randn(24, c, 3, 3, generator=g) * (9 * c) ** -0.5).to(device, torch.bfloat16)
    b = torch.randn(24, generator=g).to(device, torch.bfloat16)
    ref = F.conv2d(F.pad(x.double().cpu(), (0, 1, 0, 1)), wt.double().cpu(), b.double().cpu(), 2)
    out = poisoned(ref.shape, torch.bfloat16, device, channels_last=True)
    for cfg in (TMA_TILES, TMA_WIDE):
        y = functional.conv2d(x, wt, b, 2, (0, 1, 0, 1), config=cfg, out=out)
        assert rel_err(y, ref) <= 1e-2


def _record_launches(monkeypatch, device, pick):
    """The TMA kernel's launches from here on, each recorded as
    ``pick(grid, meta)``; skips where no kernels run."""
    from conv_patch.kernels import conv2d_tma
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    seen = []
    launch = conv2d_tma.launch
    monkeypatch.setattr(conv2d_tma, "launch", lambda k, g, *a, **m: (seen.append(pick(g, m)), launch(k, g, *a, **m)))
    return seen


@needs_tma
@pytest.mark.parametrize("c_out,stride,with_res", [(24, 1, True), (16, 1, False), (32, 2, True), (20, 1, True)])
def test_tma_boxed_epilogue_equals_the_pointer_epilogue(c_out, stride, with_res, device, monkeypatch):
    """The residual read and the output written as TMA boxes: the same bits
    as the pointer epilogue, into a band of rows of a larger NHWC output
    (rows outside it stay poisoned), with the residual overwritten in place;
    C_out = 20 (40-byte pixel rows, not 16-byte aligned) takes the pointer
    epilogue."""
    seen = _record_launches(monkeypatch, device, lambda g, m: m["TMA_IO"])
    g = torch.Generator().manual_seed(c_out)
    x = torch.randn(1, 16, 12, 20, generator=g).to(device, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(c_out, 16, 3, 3, generator=g) / 12).to(device, torch.bfloat16)
    b = torch.randn(c_out, generator=g).to(device, torch.bfloat16)
    oh, ow = 12 // stride, 20 // stride
    r = torch.randn(1, c_out, oh, ow, generator=g).to(device, torch.bfloat16).contiguous(
        memory_format=torch.channels_last) if with_res else None
    ref = F.conv2d(x.double().cpu(), w.double().cpu(), b.double().cpu(), stride, 1)
    if with_res:
        ref = F.silu(ref + 0.5 * r.double().cpu())
    outs = []
    for tma_io in (True, False):
        big = poisoned((1, c_out, oh + 5, ow), torch.bfloat16, device, channels_last=True)
        out = big[:, :, 2:2 + oh]
        res = None
        if with_res:
            res = out
            res.copy_(r)
        cfg = {**TMA_WIDE, "tma_io": tma_io}
        functional.conv2d(x, w, b, stride, 1, residual=res, beta=0.5, activation="silu" if with_res else "none",
                   out=out, config=cfg)
        assert torch.isnan(big[:, :, :2].float()).all() and torch.isnan(big[:, :, 2 + oh:].float()).all()
        assert rel_err(out, ref) <= 1e-2
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert seen == [c_out != 20, False]


TMA_ROW = {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_W": 64,
           "GROUP_M": 3, "num_warps": 4, "num_stages": 3, "persistent": 1}


@needs_tma
@pytest.mark.parametrize("n,w,stride,dil,persists", [
    (2, 37, 1, 2, True),    # one-row tiles (37 -> BLOCK_W 64 = BLOCK_M): persistent
    (1, 70, 1, 1, True),    # two tiles per row, the last one mostly past the edge
    (2, 20, 1, 1, False),   # BLOCK_W narrows to 32: two-row tiles stay one per program
    (1, 38, 2, 1, False),   # stride 2: one per program
])
def test_tma_persistent_walks_every_tile_once(n, w, stride, dil, persists, device, monkeypatch):
    """``persistent``: a grid of n programs per SM (2 "SMs" under the
    interpreter) walks all the tiles, which gives the same bits as one
    program per tile; the launcher refuses it where the tile is taller than
    one pixel row or the conv strided (a race on the H200, see
    kernels/conv2d_tma.py) and launches one program per tile there."""
    from conv_patch.kernels import conv2d_tma
    seen = _record_launches(monkeypatch, device, lambda g, m: (g[0], m["PERSISTENT"]))
    g = torch.Generator().manual_seed(w)
    x = torch.randn(n, 32, 6, w, generator=g).to(device, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    wt = (torch.randn(20, 32, 3, 3, generator=g) / 17).to(device, torch.bfloat16)
    b = torch.randn(20, generator=g).to(device, torch.bfloat16)
    ref = F.conv2d(x.double().cpu(), wt.double().cpu(), b.double().cpu(), stride, dil, dil)
    r = torch.randn(ref.shape, generator=g).to(device, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    ref = F.silu(ref + 0.5 * r.double().cpu())
    outs = []
    for cfg in (TMA_ROW, {**TMA_ROW, "persistent": 0}):
        out = poisoned(ref.shape, torch.bfloat16, device, channels_last=True)
        functional.conv2d(x, wt, b, stride, dil, dil, residual=r, beta=0.5, activation="silu", out=out, config=cfg)
        assert rel_err(out, ref) <= 1e-2
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    (grid_p, persistent), (tiles, one) = seen
    assert (persistent, one) == (persists, False)
    assert grid_p == (min(tiles, conv2d_tma.sm_count(x.device)) if persists else tiles)


@needs_tma
@pytest.mark.parametrize("n,w,with_res,io", [
    (2, 40, True, 2),    # one-row tiles (BLOCK_W 64), 80-byte rows: NCHW boxes
    (1, 72, False, 2),   # a second, mostly empty tile per row, clipped by the TMA unit
    (1, 20, True, 0),    # BLOCK_W narrows to 32, two-row tiles: pointer epilogue
    (1, 36, True, 0),    # 72-byte rows, not 16-byte aligned: pointer epilogue
])
def test_tma_nchw_output_boxes_equal_the_pointer_epilogue(n, w, with_res, io, device, monkeypatch):
    """An NCHW caller (input staged to NHWC) gets its output, and its
    residual read, as TMA boxes [1, BN, 1, BW] where the tile is one pixel
    row and the rows are 16-byte aligned: the same bits as the pointer
    epilogue, nothing written outside the output."""
    seen = _record_launches(monkeypatch, device, lambda g, m: m["TMA_IO"])
    g = torch.Generator().manual_seed(w)
    x = torch.randn(n, 32, 5, w, generator=g).to(device, torch.bfloat16)
    wt = (torch.randn(24, 32, 3, 3, generator=g) / 17).to(device, torch.bfloat16)
    b = torch.randn(24, generator=g).to(device, torch.bfloat16)
    ref = F.conv2d(x.double().cpu(), wt.double().cpu(), b.double().cpu(), 1, 1)
    r = torch.randn(ref.shape, generator=g).to(device, torch.bfloat16) if with_res else None
    if with_res:
        ref = F.silu(ref + 0.5 * r.double().cpu())
    outs = []
    for tma_io in (True, False):
        big = poisoned((n + 1,) + tuple(ref.shape[1:]), torch.bfloat16, device)
        out = big[:n]
        functional.conv2d(x, wt, b, 1, 1, residual=r, beta=0.5, activation="silu" if with_res else "none",
                   out=out, config={**TMA_ROW, "persistent": 0, "tma_io": tma_io})
        assert torch.isnan(big[n:].float()).all()
        assert rel_err(out, ref) <= 1e-2
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert seen == [io, 0]


@needs_tma
@pytest.mark.parametrize("c_in,k,pad,w,in_place", [
    (48, (1, 1), (0, 0), 40, True),    # a 1x1 shortcut, 80-byte rows: boxed in place
    (40, (3, 1), (1, 0), 72, True),    # row taps (edge rows zero-filled), C_in not a multiple of BLOCK_K
    (48, (1, 1), (0, 0), 36, False),   # 72-byte rows, not 16-byte aligned: staged
    (48, (1, 3), (0, 1), 40, False),   # column taps start off the tile's first column: staged
    (48, (1, 1), (0, 0), 20, False),   # 40-byte rows, a 200-byte plane: staged
    (48, (1, 1), (0, 0), 24, True),    # 48-byte rows (BLOCK_W would narrow to 32): the 5x24 plane as one row
])
def test_tma_reads_nchw_in_place_where_boxes_start_aligned(c_in, k, pad, w, in_place, device, monkeypatch):
    """A 1x1 (or Kx1) conv of an NCHW input under one-row tiles reads the
    input as boxes [1, BK, 1, BW] of the NCHW tensor and runs the GEMM
    transposed, instead of through the NHWC staging copy: the same bits as
    the staged path, into an NCHW output, nothing written outside it. With
    C_in = 40 the last channel block reads the next row tap's weights
    against the input's zero fill."""
    seen = _record_launches(monkeypatch, device, lambda g, m: m["X_NCHW"])
    g = torch.Generator().manual_seed(w + k[1])
    x = torch.randn(2, c_in, 5, w, generator=g).to(device, torch.bfloat16)
    wt = (torch.randn(24, c_in, *k, generator=g) / 17).to(device, torch.bfloat16)
    b = torch.randn(24, generator=g).to(device, torch.bfloat16)
    ref = F.conv2d(x.double().cpu(), wt.double().cpu(), b.double().cpu(), 1, pad)
    r = torch.randn(ref.shape, generator=g).to(device, torch.bfloat16)
    ref = F.silu(ref + 0.5 * r.double().cpu())
    outs = []
    for flag in (True, False):
        big = poisoned((3,) + tuple(ref.shape[1:]), torch.bfloat16, device)
        out = big[:2]
        functional.conv2d(x, wt, b, 1, pad, residual=r, beta=0.5, activation="silu", out=out,
                   config={**TMA_ROW, "persistent": 0, "nchw_in_place": flag})
        assert torch.isnan(big[2:].float()).all()
        assert rel_err(out, ref) <= 1e-2
        outs.append(out)
    if device.type == "cpu" or not in_place:
        assert torch.equal(outs[0], outs[1])
    else:  # the transposed GEMM may round its K=16 steps in another order
        assert rel_err(outs[0], outs[1].double().cpu()) <= 1e-3
    assert seen == [in_place, False]


@needs_tma
def test_a_1x1_convs_plane_is_one_row_only_where_input_output_and_residual_are_nchw(device, monkeypatch):
    """``flat_plane``: an NCHW 1x1 conv into an NCHW output reads and writes
    its 5x24 planes as rows of 120 pixels, boxed in place; into a
    channels_last output (or with a channels_last residual) the planes are
    not one row, the 24-pixel rows narrow BLOCK_W and the input is staged.
    Every case against float64, nothing written outside the output."""
    seen = _record_launches(monkeypatch, device, lambda g, m: m["X_NCHW"])
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 40, 5, 24, generator=g).to(device, torch.bfloat16)
    wt = (torch.randn(24, 40, 1, 1, generator=g) / 7).to(device, torch.bfloat16)
    b = torch.randn(24, generator=g).to(device, torch.bfloat16)
    r = torch.randn(2, 24, 5, 24, generator=g).to(device, torch.bfloat16)
    ref = F.relu(F.conv2d(x.double().cpu(), wt.double().cpu(), b.double().cpu()) - 0.25 * r.double().cpu())
    cases = [(torch.contiguous_format, torch.contiguous_format, True),
             (torch.channels_last, torch.contiguous_format, False),
             (torch.contiguous_format, torch.channels_last, False)]
    for out_fmt, res_fmt, flat in cases:
        big = poisoned((3, 24, 5, 24), torch.bfloat16, device).contiguous(memory_format=out_fmt)
        out = big[:2]
        functional.conv2d(x, wt, b, residual=r.contiguous(memory_format=res_fmt), beta=-0.25, activation="relu",
                          out=out, config={**TMA_ROW, "persistent": 0})
        assert torch.isnan(big[2:].float()).all()
        assert rel_err(out, ref) <= 1e-2
        assert seen.pop() is flat and not seen


@needs_tma
@pytest.mark.parametrize("n,h,w,tma_io", [(1, 9, 13, True), (2, 6, 10, True), (1, 7, 12, False)])
def test_tma_reads_and_writes_channel_slices_in_place(n, h, w, tma_io, device, monkeypatch):
    """A dense block's convs on one NHWC buffer [N, H, W, 48]: each reads a
    channel prefix in place (its pixels 48 apart: no staging copy) and
    writes its output into the next 8-channel slice, the last one adds a
    residual read from the buffer's first slice. The slices it must not
    touch stay poisoned; every output is checked against float64."""
    from conv_patch.ops import conv2d as conv2d_op
    seen = _record_launches(monkeypatch, device, lambda g, m: m["TMA_IO"])
    monkeypatch.setattr(conv2d_op, "to_nhwc", lambda x: pytest.fail("a channel slice was staged"))
    g = torch.Generator().manual_seed(h * w)
    nf, gc, total = 16, 8, 48
    buf = poisoned((n, total, h, w), torch.bfloat16, device, channels_last=True)
    buf[:, :nf] = torch.randn(n, nf, h, w, generator=g).to(device, torch.bfloat16)
    cfg = {**TMA_TILES, "tma_io": tma_io}
    for k in range(4):
        c0 = nf + k * gc
        wt = (torch.randn(gc, c0, 3, 3, generator=g) * (9 * c0) ** -0.5).to(device, torch.bfloat16)
        b = torch.randn(gc, generator=g).to(device, torch.bfloat16)
        x = buf[:, :c0]
        assert layout_of(x) == "nhwc" and nhwc_pitch(x) == total
        ref = F.leaky_relu(F.conv2d(x.double().cpu(), wt.double().cpu(), b.double().cpu(), 1, 1), 0.2)
        functional.conv2d(x, wt, b, 1, 1, activation="leaky_relu_0.2", out=buf[:, c0:c0 + gc], config=cfg)
        assert rel_err(buf[:, c0:c0 + gc], ref) <= 1e-2
        assert torch.isnan(buf[:, c0 + gc:].float()).all()
    wt = (torch.randn(nf, nf + 3 * gc, 3, 3, generator=g) * (9 * 40) ** -0.5).to(device, torch.bfloat16)
    x = buf[:, :nf + 3 * gc]
    ref = F.conv2d(x.double().cpu(), wt.double().cpu(), None, 1, 1) + 5.0 * buf[:, :nf].double().cpu()
    out = poisoned((n, nf, h, w), torch.bfloat16, device, channels_last=True)
    functional.conv2d(x, wt, None, 1, 1, residual=buf[:, :nf], beta=5.0, out=out, config=cfg)
    assert rel_err(out, ref) <= 1e-2
    assert seen == [1 if tma_io else 0] * 5


def test_nhwc_pitch_names_channel_slices():
    buf = torch.empty(2, 48, 5, 7).contiguous(memory_format=torch.channels_last)
    assert nhwc_pitch(buf) == 48 and nhwc_pitch(buf[:, 8:24]) == 48 and layout_of(buf[:, :40]) == "nhwc"
    assert nhwc_pitch(buf[:1, :16, 2:3, :1]) == 16  # one pixel: dense, whatever its strides say
    assert nhwc_pitch(buf[:, :16, :, :1]) == 7 * 48  # one column: its pixels a row apart
    assert nhwc_pitch(buf[:, :, 1:4]) == 0  # rows cut: not W * 48 apart across images
    assert nhwc_pitch(buf[:, :, :, ::2]) == 0 and layout_of(buf[:, :, :, ::2]) == "strided"
    nchw = torch.empty(2, 48, 5, 7)
    assert nhwc_pitch(nchw) == 0 and nhwc_pitch(nchw[:, :16]) == 0 and layout_of(nchw[:, :16]) == "strided"
    assert layout_of(nchw[:1, :16]) == "nchw"
    assert CallDesc.of_call(buf[:, :16], torch.empty(8, 16, 3, 3)).pitch == 48
    assert CallDesc.of_call(buf, torch.empty(8, 48, 3, 3)).pitch == 0


def _spec(c_in=16, c_out=16, k=3, stride=1):
    return ConvSpec.from_module(torch.nn.Conv2d(c_in, c_out, k, stride, padding=k // 2))


def _call(shape, layout="nhwc", dtype=torch.bfloat16, aligned=True, device_type="cuda", pitch=0):
    return CallDesc(shape=shape, dtype=dtype, device_type=device_type, layout=layout,
                    weight_dtype=dtype, aligned16=aligned, pitch=pitch)


SM90 = Target("sm90", True)


@pytest.mark.parametrize("spec,call,target,why", [
    (_spec(stride=2), _call((1, 16, 9, 8)), SM90, "stride (2, 2) does not divide"),
    (_spec(c_in=24, stride=2), _call((1, 24, 8, 8)), SM90, "not a multiple of 16"),
    (_spec(c_in=12), _call((1, 12, 8, 8)), SM90, "C_in=12"),
    (_spec(), _call((1, 16, 8, 8), dtype=torch.float32), SM90, "fp16/bf16"),
    (_spec(), _call((1, 16, 8, 8), layout="strided"), SM90, "strided"),
    (_spec(), _call((1, 16, 8, 8), aligned=False), SM90, "aligned"),
    (_spec(), _call((1, 16, 8, 8)), Target("sm80", True), "no TMA"),
    (_spec(), _call((1, 16, 8, 8), pitch=44), SM90, "44 channels apart"),
    (_spec(stride=2), _call((1, 16, 8, 8), pitch=48), SM90, "channel slice"),
])
def test_tma_problem_names_the_rule(spec, call, target, why):
    assert why in tma_problem(spec, call, call.shape, target)


def test_tma_problem_accepts_the_vae_shapes():
    assert tma_problem(_spec(128, 128), _call((1, 128, 64, 64), "nchw"), (1, 128, 64, 64), SM90) is None
    assert tma_problem(_spec(16, 512), _call((1, 16, 64, 64), "nhwc"), (1, 16, 64, 64), SM90) is None


def _table(exact=None, buckets=(), any_cfg=None):
    sec = {"exact": exact or {}, "buckets": list(buckets)}
    if any_cfg is not None:
        sec["any"] = any_cfg
    return config_tables.Table(config_tables.validate_table({"conv2d": sec}, "t"), "t")


IGEMM = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}


def test_table_routes_tma_and_skips_it_when_ineligible():
    tbl = _table(buckets=[{"max_m": None, "config": dict(TMA_TILES)},
                          {"max_m": None, "config": IGEMM}])
    ok = decide(_spec(), _call((1, 16, 8, 8)), SM90, tbl, as_called=False)
    assert ok.route is Route.CONV2D_TMA and ok.tier == "bucket"
    stride2 = decide(_spec(stride=2), _call((1, 16, 9, 9)), SM90, tbl, as_called=False)
    assert stride2.route is Route.CONV2D_IGEMM and stride2.config is IGEMM
    # No portable entry at all: the curated defaults take over, never a crash.
    only_tma = _table(any_cfg=dict(TMA_TILES))
    d = decide(_spec(c_in=12), _call((1, 12, 8, 8)), SM90, only_tma, as_called=False)
    assert d.route is Route.CONV2D_IGEMM and d.is_kernel


def test_cudnn_route_is_exact_only_and_shared_by_fp16():
    spec, shape = _spec(), (1, 16, 8, 8)
    key = config_tables.shape_key(spec, shape, "nhwc", torch.bfloat16)
    tbl = _table(exact={key: {"route": "cudnn", "cudnn_ms": 0.01, "ours_ms": 0.02}}, any_cfg=IGEMM)
    for dtype in (torch.bfloat16, torch.float16):
        d = decide(spec, _call(shape, dtype=dtype), SM90, tbl, as_called=False)
        assert d.route is Route.CUDNN and not d.is_kernel and "0.01 vs 0.02" in d.label()
    # fp32 has keys of its own; under the interpreter cuDNN is no option.
    assert decide(spec, _call(shape, dtype=torch.float32), SM90, tbl, as_called=False).route is Route.CONV2D_IGEMM
    interp = decide(spec, _call(shape, device_type="cpu"), Target("interpreter", True, interpreter=True), tbl, as_called=False)
    assert interp.route is Route.CONV2D_IGEMM
    with pytest.raises(config_tables.TableError, match="only allowed for an exact shape"):
        _table(any_cfg={"route": "cudnn"})


@pytest.mark.parametrize("bad,match", [
    ({**TMA_TILES, "BLOCK_W": 128}, "BLOCK_W"),
    ({**TMA_TILES, "BLOCK_W": 12}, "BLOCK_W"),
    ({**TMA_TILES, "BLOCK_M": 32, "BLOCK_W": 8}, "BLOCK_M >= 64"),
    ({**TMA_TILES, "num_warps": 2}, "num_warps"),
    ({**TMA_TILES, "tma_io": "no"}, "tma_io"),
    ({**TMA_TILES, "persistent": -1}, "persistent"),
    ({**TMA_TILES, "persistent": True}, "persistent"),
    ({**IGEMM, "route": "cutlass"}, "route must be one of"),
])
def test_bad_tma_configs_are_refused(bad, match):
    with pytest.raises(config_tables.TableError, match=match):
        _table(any_cfg=bad)


def test_functional_cudnn_config_computes_with_pytorch(device):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 8, 6, 7, generator=g).to(device)
    w = torch.randn(4, 8, 3, 3, generator=g).to(device)
    r = torch.randn(1, 4, 6, 7, generator=g).to(device)
    y = functional.conv2d(x, w, None, padding=1, residual=r, beta=0.5, activation="relu",
                   config={"route": "cudnn"})
    ref = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), padding=1) + 0.5 * r.double())
    assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-4)


def test_functional_tma_config_on_ineligible_call_says_why(device):
    x = torch.randn(1, 12, 8, 8, device=device, dtype=torch.bfloat16)
    w = torch.randn(8, 12, 3, 3, device=device, dtype=torch.bfloat16)
    if not target_for(x.device).kernels:
        pytest.skip("no kernels here")
    with pytest.raises(functional.UnsupportedConv, match="C_in=12"):
        functional.conv2d(x, w, padding=1, config=TMA_TILES)


@pytest.mark.parametrize("shape", [(2, 24, 9, 16), (1, 3, 5, 7), (1, 70, 1, 65), (3, 8, 4, 1)])
def test_nchw_to_nhwc_copy(shape, device):
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(6)).to(device, torch.bfloat16)
    y = conv2d_op.to_nhwc(x)
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, x)
    assert conv2d_op.to_nhwc(y) is y


def test_patched_model_takes_the_tma_route_through_a_table(device):
    """apply() with a table whose configs name the TMA route: 3x3 stride-1
    and 1x1 convs run it (weights packed by the wrapper, an NCHW input
    staged), the stride-2 conv of an odd height falls back to the portable
    kernel in the same table, and the model's output matches the unpatched one."""
    import conv_patch
    if not target_for(device).kernels:
        pytest.skip("no kernels here")
    g = torch.Generator().manual_seed(8)
    net = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.SiLU(),
                              torch.nn.Conv2d(16, 16, 3, stride=2, padding=1),
                              torch.nn.Conv2d(16, 24, 1), torch.nn.Conv2d(24, 8, 3, padding=2, dilation=2))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    net = net.to(device, torch.bfloat16).eval()
    table = {"conv2d": {"buckets": [{"max_m": None, "config": dict(TMA_WIDE)},
                                    {"max_m": None, "config": dict(IGEMM)}]}}
    x = torch.randn(2, 8, 13, 16, generator=g).to(device, torch.bfloat16)
    with torch.no_grad():
        ref = net.double()(x.double()) if device.type == "cpu" else net.float()(x.float())
        net.to(torch.bfloat16)
        conv_patch.apply(net, config=PatchConfig(table=table))
        out = net(x)
    labels = [m.extra_repr().split("route=")[1] for m in net if isinstance(m, torch.nn.Conv2d)]
    assert labels == ["conv2d_tma", "conv2d_igemm", "conv2d_tma", "conv2d_tma"]
    assert out.is_contiguous() and rel_err(out, ref) <= 2e-2
