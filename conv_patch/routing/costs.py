"""What a call costs on each route, host time included: the model behind
"never slower".

A route is taken only where it is faster *as called*. Launched eagerly, a
call costs the larger of its host time (Python, dispatch, the launch) and
its GPU time, because the GPU runs one call while the host prepares the
next; replayed from a CUDA graph, only GPU time counts. So for every conv
plan ``choose`` compares

    kernel:  max(host_kernel, gpu_kernel)
    PyTorch: max(host_base + host_conv, gpu_cudnn) + each eager epilogue op

(``host_base``, the wrapper's own Python, is paid on either route)

(GPU time alone on the graph path) and keeps the kernel only where it wins by
``MARGIN``. GPU times are the table's measurements where it has the exact
shape (``ours_ms``, ``cudnn_ms``); elsewhere a model fitted to those same
measurements (``Fit``): each side's time as a fixed cost plus a term in the
conv's arithmetic and one in its bytes, fitted per kernel class (1x1 or
larger) and layout, slowed by ``fill_factor`` where the route's tiles
cannot fill the GPU (the fit's shapes do). The lean route's GPU time is
modelled from its tiles and K steps (``lean_ms``). A table without
measurements (the
curated default of an architecture nobody tuned) predicts nothing, so
nothing leaves PyTorch there. Host times, copy bandwidth and the lean
route's model are the table's ``Calibration``; docs/performance.md says where
they were measured.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from conv_patch.routing import tables
from conv_patch.routing.calibration import Calibration

# The lean route's tile (the portable kernel reading an NCHW input and the
# weight in place: 128x64 tiles, 32-deep K steps; decide.LEAN_CONFIG).
LEAN_TILE = (128, 64, 32)
def default_calibration() -> Calibration:
    """The curated calibration (configs/default.json's)."""
    return tables.packaged_table("default").calibration


# A kernel must be predicted at least this much faster than PyTorch: run-to-run
# noise (~5% on one shape) must not flip a call to a slower route. (The fit's
# own error is allowed for in ``Fit.bias``.)
MARGIN = 0.92

_KEY = re.compile(r"n(\d+)\.c(\d+)\.h(\d+)\.w(\d+)\.o(\d+)\.k(\d+)x(\d+)\.s(\d+)x(\d+)\.p(\d+)x(\d+)"
                  r"(?:/b\d+x\d+)?\.d(\d+)x(\d+)(?:\.op\d+x\d+)?\.(\w+)\.(\w+)$")


@dataclass(frozen=True)
class Problem:
    """The sizes a conv call's cost depends on."""

    flops: float
    bytes: float
    out_bytes: float
    one_by_one: bool
    layout: str
    # The implicit GEMM's sizes: output pixels, output channels, reduction
    # depth (input channels x taps), and the element size in bytes.
    m: int = 0
    n: int = 0
    k: int = 0
    elem_bytes: int = 2

    @classmethod
    def of(cls, n, c_in, h, w, c_out, kh, kw, oh, ow, elem_bytes, layout) -> "Problem":
        m = n * oh * ow
        return cls(2.0 * m * c_out * c_in * kh * kw,
                   float(elem_bytes) * (n * c_in * h * w + m * c_out + c_out * c_in * kh * kw),
                   float(elem_bytes) * m * c_out, kh * kw == 1, layout, m, c_out, c_in * kh * kw, elem_bytes)

    def tiles(self, block_m: int, block_n: int) -> int:
        """Output tiles of ``block_m`` x ``block_n`` (one program each)."""
        return -(-self.m // block_m) * -(-self.n // block_n)


def problem_of_key(key: str) -> Optional[Problem]:
    """The Problem of a table key (``config_tables.shape_key``), or None."""
    g = _KEY.match(key)
    if g is None:
        return None
    n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw = (int(v) for v in g.groups()[:13])
    layout, dtype = g.group(14), g.group(15)
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh <= 0 or ow <= 0:
        return None
    return Problem.of(n, c, h, w, o, kh, kw, oh, ow, 4 if dtype == "float32" else 2, layout)


@dataclass(frozen=True)
class Fit:
    """GPU time models fitted to a table's measured shapes: per side
    ("theirs": cuDNN as PyTorch calls it, "ours") and kernel class (1x1 or larger) and layout,
    ms = c0 + c1 * GFLOP + c2 * MB moved (least squares on relative error,
    so small and large shapes count alike). c0 is each side's fixed cost,
    1/c1 its arithmetic rate, 1/c2 its bandwidth."""

    models: Dict[Tuple[str, bool, str], Tuple[float, float, float]]
    points: int
    # Per model, the fit's own error on the shapes it was fitted to, taken
    # against the kernels: cuDNN's measured/predicted ratio at its 25th
    # percentile, ours at its 75th. A shape never measured is then judged by
    # a fast cuDNN and a slow kernel, never by the fit's optimistic middle.
    bias: Dict[Tuple[str, bool, str], float] = dataclasses.field(default_factory=dict)
    # No prediction below a launch's fixed GPU latency (the calibration's).
    floor_ms: float = 0.004

    def _key(self, side, p):
        k = (side, p.one_by_one, p.layout)
        return k if k in self.models else (side, p.one_by_one, "any")

    def ms(self, side: str, p: Problem) -> Optional[float]:
        """The fitted time, as fitted (no error allowance)."""
        c = self.models.get(self._key(side, p))
        if c is None:
            return None
        return max(self.floor_ms, c[0] + c[1] * p.flops / 1e9 + c[2] * p.bytes / 1e6)

    def cudnn_ms(self, p: Problem) -> Optional[float]:
        t = self.ms("theirs", p)
        return None if t is None else t * self.bias.get(self._key("theirs", p), 1.0)

    def ours_ms(self, p: Problem) -> Optional[float]:
        t = self.ms("ours", p)
        return None if t is None else t * self.bias.get(self._key("ours", p), 1.0)


def _solve3(a, b):
    """Solve the 3x3 system a x = b (Gaussian elimination); None if singular."""
    m = [row[:] + [v] for row, v in zip(a, b)]
    for i in range(3):
        piv = max(range(i, 3), key=lambda r: abs(m[r][i]))
        if abs(m[piv][i]) < 1e-30:
            return None
        m[i], m[piv] = m[piv], m[i]
        for r in range(3):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * y for x, y in zip(m[r], m[i])]
    return [m[i][3] / m[i][i] for i in range(3)]


def _least_squares(points) -> Optional[Tuple[float, float, float]]:
    """(c0, c1, c2) minimising sum(((c0 + c1 f + c2 b) / t - 1)^2) over
    (f, b, t) points, with every coefficient kept non-negative (a negative
    one would predict negative times outside the measured range)."""
    for keep in ((0, 1, 2), (0, 1), (0, 2), (0,)):
        ata = [[0.0] * 3 for _ in range(3)]
        atb = [0.0] * 3
        for f, b, t in points:
            row = [1.0 / t, f / t, b / t]
            row = [v if i in keep else 0.0 for i, v in enumerate(row)]
            for i in range(3):
                atb[i] += row[i]
                for j in range(3):
                    ata[i][j] += row[i] * row[j]
        for i in range(3):
            if i not in keep:
                ata[i][i] = 1.0
        c = _solve3(ata, atb)
        if c is not None and all(v >= 0 for v in c):
            return tuple(c)
    return None


# A class needs this many measured shapes before its fit is used.
MIN_FIT_POINTS = 4


def fit(table_data: dict, floor_ms: Optional[float] = None) -> Optional[Fit]:
    """The cost fit of a table's measured exact entries (None without any);
    ``floor_ms``: no time below it (default: the calibration's launch)."""
    floor_ms = default_calibration().launch_ms if floor_ms is None else floor_ms
    exact = (table_data.get("conv2d") or {}).get("exact") or {}
    groups: Dict[Tuple[str, bool, str], list] = {}
    for key, cfg in exact.items():
        ours, cudnn = cfg.get("ours_ms"), cfg.get("cudnn_ms")
        p = problem_of_key(key)
        if p is None or not ours or not cudnn or ours <= 0 or cudnn <= 0:
            continue
        for side, t in (("theirs", cudnn), ("ours", ours)):
            for layout in (p.layout, "any"):
                groups.setdefault((side, p.one_by_one, layout), []).append((p.flops / 1e9, p.bytes / 1e6, t))
    models, bias = {}, {}
    for k, pts in groups.items():
        if len(pts) >= MIN_FIT_POINTS:
            c = _least_squares(pts)
            if c is not None:
                models[k] = c
                ratios = sorted(t / max(floor_ms, c[0] + c[1] * f + c[2] * b) for f, b, t in pts)
                bias[k] = ratios[int((0.25 if k[0] == "theirs" else 0.75) * (len(ratios) - 1))]
    if not models:
        return None
    return Fit(models, sum(len(v) for k, v in groups.items() if k[2] != "any") // 2, bias, floor_ms)


@functools.lru_cache(maxsize=None)
def fit_of(table) -> Optional[Fit]:
    """``fit`` of a ``tables.Table``, computed once per table."""
    return fit(table.data, table.calibration.launch_ms)


@dataclass(frozen=True)
class Choice:
    kernel: bool
    why: str
    cost: float = 0.0  # ms as called, of the kernel option


def epilogue_ops(has_residual: bool, beta: float, activation: str, out_scale: float) -> int:
    """Eager PyTorch ops the fused epilogue stands for (the bias is part of
    the module's own call)."""
    return int(has_residual) + int(activation != "none") + int(out_scale != 1.0)


def _cal(cal: Optional[Calibration]) -> Calibration:
    return default_calibration() if cal is None else cal


def pass_ms(p: Problem, cal: Calibration) -> float:
    """GPU time of one elementwise pass over the call's output."""
    return cal.launch_ms + 2 * p.out_bytes / (cal.copy_tbps * 1e9)


def host_ms(launches: int, packed: bool = False, descriptors: int = 0, cal: Optional[Calibration] = None) -> float:
    """Host time of a planned kernel call: its Python, the pack refresh
    where the weight is packed, each launch with its allocation and
    descriptors."""
    h = _cal(cal).host_us
    return (h["base"] + packed * h["refresh"] + launches * (h["launch"] + h["alloc"])
            + descriptors * h["desc"]) / 1e3


def refresh_ms(p: Problem, graph: bool, cal: Optional[Calibration] = None) -> float:
    """GPU time of refreshing the call's weight pack (read and written once):
    eagerly PyTorch's strided copy (``refresh_tbps``), on the graph path the
    pack kernel (``copy_tbps``; conv_patch/runtime/pack.py)."""
    cal = _cal(cal)
    return cal.launch_ms + 2 * p.n * p.k * p.elem_bytes / ((cal.copy_tbps if graph else cal.refresh_tbps) * 1e9)


def conv_host_ms(p: Problem, cal: Optional[Calibration] = None) -> float:
    """Host time of PyTorch's conv call on the planned path: the wrapper's
    own Python ("base", paid on PyTorch's route too) and F.conv2d's, by
    kernel class."""
    h = _cal(cal).host_us
    return (h["base"] + h["conv_1x1" if p.one_by_one else "conv"]) / 1e3


def torch_ms(p: Problem, gpu_cudnn: float, ops: int, graph: bool, cal: Optional[Calibration] = None) -> float:
    """PyTorch's time for the call as made: the module's call, then each
    eager epilogue op."""
    cal = _cal(cal)
    if graph:
        return gpu_cudnn + ops * pass_ms(p, cal)
    return max(conv_host_ms(p, cal), gpu_cudnn) + ops * max(cal.host_us["op"] / 1e3, pass_ms(p, cal))


def gpu_times(p: Problem, fitted: Optional[Fit], exact: Optional[dict]):
    """(cuDNN ms, our ms): the table's measurement of the shape, else the fit's."""
    gpu_c = exact.get("cudnn_ms") if exact else None
    gpu_o = exact.get("ours_ms") if exact else None
    if gpu_c is None and fitted is not None:
        gpu_c = fitted.cudnn_ms(p)
    if gpu_o is None and fitted is not None:
        gpu_o = fitted.ours_ms(p)
    return gpu_c, gpu_o


def choose(p: Problem, fitted: Optional[Fit], exact: Optional[dict], *, launches: int, ops: int,
           graph: bool, packed: bool = True, descriptors: int = 0, cal: Optional[Calibration] = None,
           config: Optional[dict] = None, sms: Optional[int] = None) -> Choice:
    """Whether the table's kernel route beats PyTorch for this call (see the
    module docstring). ``exact``: the table's entry for the shape, if any;
    ``launches``: the route's launches; ``ops``: eager ops its fused
    epilogue replaces; ``graph``: the call runs inside a CUDA graph;
    ``packed``: its weight is refreshed into a pack at every call;
    ``config``: the route's kernel config (a shape never measured is slowed
    by ``fill_factor`` where its tiles leave SMs idle); ``sms``: the
    device's (default: the calibration's)."""
    cal = _cal(cal)
    gpu_c, gpu_o = gpu_times(p, fitted, exact)
    if gpu_c is None or gpu_o is None:
        return Choice(False, "no measurement or model of this shape on this GPU")
    if not (exact and exact.get("ours_ms")):
        gpu_o *= fill_factor(p, config, sms or cal.sms)
    gpu_o += (launches - 1) * cal.launch_ms
    if packed:
        # The tables time the kernel on a ready pack; a call refreshes it.
        gpu_o += refresh_ms(p, graph, cal)
    theirs = torch_ms(p, gpu_c, ops, graph, cal)
    ours = gpu_o if graph else max(host_ms(launches, packed, descriptors, cal), gpu_o)
    how = "graph" if graph else "launched"
    if ours <= MARGIN * theirs:
        return Choice(True, f"kernel {ours:.4g} ms vs PyTorch {theirs:.4g} ms {how}", ours)
    return Choice(False, f"PyTorch faster as called ({theirs:.4g} ms vs kernel {ours:.4g} ms {how})", ours)


def lean_ms(p: Problem, cal: Optional[Calibration] = None, sms: Optional[int] = None) -> float:
    """GPU time of the lean route (the portable kernel, input and weight
    read in place): its waves of tiles times their K steps, or its bytes at
    copy bandwidth where that is longer."""
    cal = _cal(cal)
    bm, bn, bk = LEAN_TILE
    waves = -(-p.tiles(bm, bn) // (cal.lean_ctas_per_sm * (sms or cal.sms)))
    step = (cal.lean_step_1x1_us if p.one_by_one else cal.lean_step_us) * (
        cal.lean_fp32_factor if p.elem_bytes >= 4 else 1.0)
    steps_ms = waves * -(-p.k // bk) * step / 1e3
    return cal.launch_ms + max(steps_ms, p.bytes / (cal.copy_tbps * 1e9))


def fill_factor(p: Problem, config: Optional[dict], sms: int) -> float:
    """How much slower than its fitted rate a kernel config runs on a shape
    whose tiles cannot fill the GPU: SMs / tiles where there are fewer
    tiles than SMs (each tile runs on one SM however few there are), else 1.
    The fit's shapes fill the GPU; a UNet's 16x16 levels do not."""
    if not config or p.m <= 0 or "BLOCK_M" not in config or "BLOCK_N" not in config:
        return 1.0
    tiles = p.tiles(int(config["BLOCK_M"]), int(config["BLOCK_N"]))
    return max(1.0, sms / max(1, tiles))


def choose_lean(p: Problem, fitted: Optional[Fit], exact: Optional[dict], *, ops: int,
                cal: Optional[Calibration] = None, sms: Optional[int] = None) -> Choice:
    """Whether the lean route beats PyTorch for a call launched eagerly: one
    launch, no pack, no staging copy, so the least host time of any route,
    where its slower GPU work still hides behind the host's."""
    cal = _cal(cal)
    gpu_c, _ = gpu_times(p, fitted, exact)
    if gpu_c is None:
        return Choice(False, "no measurement or model of this shape on this GPU")
    theirs = torch_ms(p, gpu_c, ops, False, cal)
    ours_host, theirs_host = host_ms(1, False, 0, cal), conv_host_ms(p, cal)
    saving_us = (theirs_host - ours_host) * 1e3
    if saving_us < cal.lean_min_saving_us:
        return Choice(False, f"PyTorch: the lean kernel would save {saving_us:.0f} us of host time per call "
                             f"(under {cal.lean_min_saving_us:.0f})")
    if gpu_c > theirs_host:
        # Only where PyTorch's own call is host-bound: its GPU time is then
        # hidden and the lean route's, modelled, only has to hide as well. On
        # a GPU-bound call an error of that model is time lost (in the H200
        # A/B a ControlNet's few-channel 3x3 convs at 512^2, modelled 25-50 us
        # on the lean route, made the model 10% slower).
        return Choice(False, f"PyTorch: its call is GPU-bound ({gpu_c:.4g} ms), not the lean route's case")
    ours = max(ours_host, lean_ms(p, cal, sms))
    if ours <= MARGIN * theirs:
        return Choice(True, f"lean kernel {ours:.4g} ms vs PyTorch {theirs:.4g} ms launched "
                            "(host-bound: input and weight read in place)", ours)
    return Choice(False, f"PyTorch faster as called ({theirs:.4g} ms vs lean kernel {ours:.4g} ms)", ours)


def fused_epilogue_pays(p: Problem, ops: int, bias_pass: bool, graph: bool, cal: Optional[Calibration] = None,
                        gpu_conv: float = 0.0) -> bool:
    """Where PyTorch runs the conv: whether cuDNN without its bias plus one
    epilogue pass (bias, residual, activation, scale) beats the module's
    own call followed by ``ops`` eager ops (``bias_pass``: PyTorch adds the
    bias in a pass of its own, as it does on an NHWC output). Launched, each
    side costs the larger of its host time and its GPU time (``gpu_conv``:
    the convolution's own, the same on both sides)."""
    cal = _cal(cal)
    host = cal.host_us
    passes = ops + int(bias_pass)
    if passes == 0:
        return False
    one = pass_ms(p, cal)
    if graph:
        return passes * one > one
    conv_host = conv_host_ms(p, cal)
    eager = max(conv_host + ops * host["op"] / 1e3, gpu_conv + passes * one)
    fused = max(conv_host + host["unplanned"] / 1e3, gpu_conv + one)
    return fused <= MARGIN * eager


# Below this many source multiply-adds per tap (N*H*W*C_in*C_out) the four
# 2x2 launches of the folded upsample cost more host time than they save GPU
# time: on the H200 each Triton launch costs ~70 us of host time
# (bench/results/overhead-*.json), so four of them (~0.6 ms with the weight
# folding) only pay once the GPU work they replace is larger: 4e9 puts the
# FLUX VAE's 512-channel 128^2 upsample and everything above on the folded
# path and TAEF2's 64-channel upsamples, host-bound at every resolution, on
# upsample + one conv. On a CUDA graph's path (no host time per launch) it
# always pays.
SUBPIXEL_MIN_MACS = 4e9


def subpixel_pays(macs: float) -> bool:
    """Whether the folded upsample's four launches pay for ``macs`` source
    multiply-adds per tap, launched eagerly."""
    return macs >= SUBPIXEL_MIN_MACS


# The GroupNorm kernels (statistics, finalize, apply) beat PyTorch's GroupNorm
# + SiLU from about this many elements: on the H200 (bf16, GPU time,
# bench.group_norm) 2.6M elements ran 0.47-0.49x PyTorch's time and 4.2M
# 1.10-1.58x; PyTorch's one call is also less host time.
GROUP_NORM_MIN_ELEMENTS = 4 << 20
# Below that, for a GroupNorm of few (sample, group) rows each holding at
# least GROUP_NORM_ROW_ELEMENTS: PyTorch's statistics kernel gives a row
# one CUDA block, so such a norm runs on a few SMs (TAEF2's pooled blocks,
# GroupNorm(4, 256) at a 512^2 decode's 64^2 latent: four rows of 262K
# elements, 0.23 ms of the H100's time with the SiLU against the kernels'
# 0.017, which split every row over the GPU; at 32^2 0.070 against 0.017:
# group_norm-few-groups-h100-2026-12-06.json). Measured there at 4 rows
# only; at 32 rows (a UNet's, a VAE's) PyTorch's stays in charge.
GROUP_NORM_ROW_ELEMENTS = 1 << 16
GROUP_NORM_FEW_ROWS = 16


def group_norm_pays(numel: int, rows: Optional[int] = None) -> bool:
    """Whether the GroupNorm kernels beat PyTorch's GroupNorm on a tensor of
    ``numel`` elements in ``rows`` (sample, group) rows (eagerly and in a
    graph alike: below the crossover they are slower on the GPU too)."""
    return numel >= GROUP_NORM_MIN_ELEMENTS or (rows is not None and rows <= GROUP_NORM_FEW_ROWS
                                                 and numel >= rows * GROUP_NORM_ROW_ELEMENTS)


# PyTorch's RMS norm as the Wan-family VAEs write it, on a half-precision
# input: .float(), the norm, clamp_min, the division, .to(dtype), * scale,
# * gamma, + bias: 8 launches and ~36 bytes moved per element (the fp32
# copy and quotient are read and written once each); on an fp32 input the
# two casts are no-ops and the same 36 bytes move in 6 launches. The
# activation after it is one more launch and 4 bytes. The kernel reads the input twice and
# writes once; not yet measured on a GPU, so it is modelled here at half the
# copy bandwidth (RMS_NORM_BW_FACTOR) with a recorded program's host time.
RMS_NORM_TORCH = {"ops": 8, "bytes": 36.0, "act_ops": 1, "act_bytes": 4.0}
RMS_NORM_BW_FACTOR = 0.5


def rms_norm_pays(numel: int, element_size: int, activation: bool, graph: bool = False,
                  cal: Optional[Calibration] = None) -> bool:
    """Whether the RMS-norm kernel (with the activation fused where
    ``activation``) beats PyTorch's passes on ``numel`` elements of
    ``element_size`` bytes, launched eagerly (host time included) or from a
    graph (GPU time only)."""
    cal = _cal(cal)
    host = cal.host_us
    t = RMS_NORM_TORCH
    ops = t["ops"] - (2 if element_size >= 4 else 0) + (t["act_ops"] if activation else 0)
    per_elem = t["bytes"] + (t["act_bytes"] if activation else 0.0)
    torch_gpu = ops * cal.launch_ms + numel * per_elem / (cal.copy_tbps * 1e9)
    ours_gpu = cal.launch_ms + 3 * numel * element_size / (RMS_NORM_BW_FACTOR * cal.copy_tbps * 1e9)
    if graph:
        return ours_gpu <= MARGIN * torch_gpu
    torch_host = ops * host["op"] / 1e3
    ours_host = (host["base"] + host["launch"]) / 1e3
    return max(ours_host, ours_gpu) <= MARGIN * max(torch_host, torch_gpu)


def conv3d_choice(ours_ms: float, cudnn_ms: float, ops: int, graph: bool, cal: Optional[Calibration] = None,
                  out_bytes: float = 0.0, repack: bool = False) -> Choice:
    """Whether a Conv3d call takes the kernel, from its table entry's GPU
    times: ``ours_ms`` the kernel reading the cached frames and padding in
    place, ``cudnn_ms`` the cuDNN route (``conv3d.cudnn_conv3d``: the
    concatenation, cuDNN); ``ops`` eager epilogue ops after PyTorch's conv,
    which the kernel fuses, each a pass over the ``out_bytes`` output.
    Launched, each side costs the larger of its host and GPU time (the cuDNN
    route: its conv, the concatenation and the bias pass; the kernel's: a
    launch through its launcher, not a recorded replay, plus the weight's
    repack where ``repack``, one PyTorch copy)."""
    cal = _cal(cal)
    h = cal.host_us
    one = cal.launch_ms + 2 * out_bytes / (cal.copy_tbps * 1e9)
    if graph:
        ours, theirs = ours_ms, cudnn_ms + ops * one
    else:
        ours = max((h["base"] + h["unplanned"] + repack * h["op"]) / 1e3, ours_ms)
        theirs = max((h["base"] + h["conv"] + 2 * h["op"]) / 1e3, cudnn_ms) + ops * max(h["op"] / 1e3, one)
    if ours <= MARGIN * theirs:
        return Choice(True, f"kernel {ours:.4g} ms vs PyTorch {theirs:.4g} ms as called (measured)", ours)
    return Choice(False, f"PyTorch's conv3d measured faster as called ({theirs:.4g} ms vs kernel {ours:.4g} ms)",
                  ours)
