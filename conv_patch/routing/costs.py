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
nothing leaves PyTorch there. Host times are ``HOST_US``; docs/performance.md
says where they were measured.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

# Microseconds of host time, measured on the H200's host (bench.overhead
# and the per-call rows of the zoo's A/B run, docs/performance.md), all on
# one host: "conv" F.conv2d of a 3x3 (or larger) kernel, "conv_1x1" of a
# 1x1 one (cuDNN's 1x1 call is about two thirds of its 3x3 one), "op" one
# PyTorch elementwise op, "base" a planned call's own Python (signature,
# lookup, bookkeeping), "refresh" a weight pack's refresh (a PyTorch copy),
# "launch" one replayed Triton launch, "alloc" one output or scratch
# allocation, "desc" one TMA descriptor rebuilt. "unplanned" is the cuDNN
# route's epilogue pass, launched through its launcher with its output
# allocated (measured as that route's host time over the module's call).
HOST_US = {"conv": 43.0, "conv_1x1": 29.0, "op": 10.0, "base": 5.5, "refresh": 12.0, "launch": 19.0,
           "alloc": 3.0, "desc": 4.0, "unplanned": 40.0}
# The lean route is taken for its host time only where it saves at least
# this much of it per call: in the UNets' A/B on the H200 1x1 convs on the
# lean route (about 7 us of host time less than cuDNN's call in a loop of
# one conv) made the whole model 3-10% slower than with cuDNN there.
LEAN_MIN_SAVING_US = 10.0
# The lean route's GPU time (the portable kernel reading an NCHW input and
# the weight in place, dispatch.LEAN_CONFIG: 128x64 tiles, 32-deep K steps)
# is modelled from its tiles: each wave of up to LEAN_CTAS_PER_SM tiles per
# SM takes LEAN_STEP_US per K step (a 1x1 conv's steps gather nothing and
# are shorter; fp16/bf16, fp32 LEAN_FP32_FACTOR times that). Fitted on the
# H200 (bench.overhead's lean rows and the zoo's convs, docs/performance.md)
# from the slow side: a 1280-channel 3x3 conv at 16x16 runs 40 tiles of 360
# steps, 0.35 ms, where its arithmetic alone at the kernel's full-GPU rate
# would say 0.1 ms.
LEAN_TILE = (128, 64, 32)
LEAN_CTAS_PER_SM = 2
LEAN_STEP_US = {False: 1.3, True: 0.65}  # by Problem.one_by_one
LEAN_FP32_FACTOR = 4.0
# SMs assumed where the caller does not say (an H200 has 132).
DEFAULT_SMS = 132
# Device-to-device copy bandwidth (H200, measured) and a launch's fixed GPU
# latency: the memory-bound terms of the lean route and the epilogue passes.
COPY_TBPS = 4.18
LAUNCH_MS = 0.004
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
    ("cudnn", "ours") and kernel class (1x1 or larger) and layout,
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

    def _key(self, side, p):
        k = (side, p.one_by_one, p.layout)
        return k if k in self.models else (side, p.one_by_one, "any")

    def ms(self, side: str, p: Problem) -> Optional[float]:
        """The fitted time, as fitted (no error allowance)."""
        c = self.models.get(self._key(side, p))
        if c is None:
            return None
        return max(LAUNCH_MS, c[0] + c[1] * p.flops / 1e9 + c[2] * p.bytes / 1e6)

    def cudnn_ms(self, p: Problem) -> Optional[float]:
        t = self.ms("cudnn", p)
        return None if t is None else t * self.bias.get(self._key("cudnn", p), 1.0)

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


def fit(table_data: dict) -> Optional[Fit]:
    """The cost fit of a table's measured exact entries (None without any)."""
    exact = (table_data.get("conv2d") or {}).get("exact") or {}
    groups: Dict[Tuple[str, bool, str], list] = {}
    for key, cfg in exact.items():
        ours, cudnn = cfg.get("ours_ms"), cfg.get("cudnn_ms")
        p = problem_of_key(key)
        if p is None or not ours or not cudnn or ours <= 0 or cudnn <= 0:
            continue
        for side, t in (("cudnn", cudnn), ("ours", ours)):
            for layout in (p.layout, "any"):
                groups.setdefault((side, p.one_by_one, layout), []).append((p.flops / 1e9, p.bytes / 1e6, t))
    models, bias = {}, {}
    for k, pts in groups.items():
        if len(pts) >= MIN_FIT_POINTS:
            c = _least_squares(pts)
            if c is not None:
                models[k] = c
                ratios = sorted(t / max(LAUNCH_MS, c[0] + c[1] * f + c[2] * b) for f, b, t in pts)
                bias[k] = ratios[int((0.25 if k[0] == "cudnn" else 0.75) * (len(ratios) - 1))]
    if not models:
        return None
    return Fit(models, sum(len(v) for k, v in groups.items() if k[2] != "any") // 2, bias)


@functools.lru_cache(maxsize=None)
def fit_of(table) -> Optional[Fit]:
    """``fit`` of a ``config_tables.Table``, computed once per table."""
    return fit(table.data)


@dataclass(frozen=True)
class Choice:
    kernel: bool
    why: str
    cost: float = 0.0  # ms as called, of the kernel option


def epilogue_ops(has_residual: bool, beta: float, activation: str, out_scale: float) -> int:
    """Eager PyTorch ops the fused epilogue stands for (the bias is part of
    the module's own call)."""
    return int(has_residual) + int(activation != "none") + int(out_scale != 1.0)


def host_ms(launches: int, packed: bool = False, descriptors: int = 0, host: Optional[dict] = None) -> float:
    """Host time of a planned kernel call: its Python, the pack refresh
    where the weight is packed, each launch with its allocation and
    descriptors."""
    h = HOST_US if host is None else host
    return (h["base"] + packed * h["refresh"] + launches * (h["launch"] + h["alloc"])
            + descriptors * h["desc"]) / 1e3


def conv_host_ms(p: Problem, host: Optional[dict] = None) -> float:
    """Host time of PyTorch's conv call on the planned path: the wrapper's
    own Python ("base", paid on PyTorch's route too) and F.conv2d's, by
    kernel class."""
    h = HOST_US if host is None else host
    return (h["base"] + h["conv_1x1" if p.one_by_one else "conv"]) / 1e3


def torch_ms(p: Problem, gpu_cudnn: float, ops: int, graph: bool, host: Optional[dict] = None) -> float:
    """PyTorch's time for the call as made: the module's call, then each
    eager epilogue op."""
    h = HOST_US if host is None else host
    pass_ms = LAUNCH_MS + 2 * p.out_bytes / (COPY_TBPS * 1e9)
    if graph:
        return gpu_cudnn + ops * pass_ms
    return max(conv_host_ms(p, h), gpu_cudnn) + ops * max(h["op"] / 1e3, pass_ms)


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
           graph: bool, packed: bool = True, descriptors: int = 0, host: Optional[dict] = None,
           config: Optional[dict] = None, sms: int = DEFAULT_SMS) -> Choice:
    """Whether the table's kernel route beats PyTorch for this call (see the
    module docstring). ``exact``: the table's entry for the shape, if any;
    ``launches``: the route's launches; ``ops``: eager ops its fused
    epilogue replaces; ``graph``: the call runs inside a CUDA graph;
    ``packed``: its weight is refreshed into a pack at every call;
    ``config``: the route's kernel config (a shape never measured is slowed
    by ``fill_factor`` where its tiles leave SMs idle)."""
    gpu_c, gpu_o = gpu_times(p, fitted, exact)
    if gpu_c is None or gpu_o is None:
        return Choice(False, "no measurement or model of this shape on this GPU")
    if not (exact and exact.get("ours_ms")):
        gpu_o *= fill_factor(p, config, sms)
    gpu_o += (launches - 1) * LAUNCH_MS
    theirs = torch_ms(p, gpu_c, ops, graph, host)
    ours = gpu_o if graph else max(host_ms(launches, packed, descriptors, host), gpu_o)
    how = "graph" if graph else "launched"
    if ours <= MARGIN * theirs:
        return Choice(True, f"kernel {ours:.4g} ms vs PyTorch {theirs:.4g} ms {how}", ours)
    return Choice(False, f"PyTorch faster as called ({theirs:.4g} ms vs kernel {ours:.4g} ms {how})", ours)


def lean_ms(p: Problem, sms: int = DEFAULT_SMS) -> float:
    """GPU time of the lean route (the portable kernel, input and weight
    read in place): its waves of tiles times their K steps, or its bytes at
    copy bandwidth where that is longer."""
    bm, bn, bk = LEAN_TILE
    waves = -(-p.tiles(bm, bn) // (LEAN_CTAS_PER_SM * sms))
    step = LEAN_STEP_US[p.one_by_one] * (LEAN_FP32_FACTOR if p.elem_bytes >= 4 else 1.0)
    steps_ms = waves * -(-p.k // bk) * step / 1e3
    return LAUNCH_MS + max(steps_ms, p.bytes / (COPY_TBPS * 1e9))


def fill_factor(p: Problem, config: Optional[dict], sms: int = DEFAULT_SMS) -> float:
    """How much slower than its fitted rate a kernel config runs on a shape
    whose tiles cannot fill the GPU: SMs / tiles where there are fewer
    tiles than SMs (each tile runs on one SM however few there are), else 1.
    The fit's shapes fill the GPU; a UNet's 16x16 levels do not."""
    if not config or p.m <= 0 or "BLOCK_M" not in config or "BLOCK_N" not in config:
        return 1.0
    tiles = p.tiles(int(config["BLOCK_M"]), int(config["BLOCK_N"]))
    return max(1.0, sms / max(1, tiles))


def choose_lean(p: Problem, fitted: Optional[Fit], exact: Optional[dict], *, ops: int,
                host: Optional[dict] = None, sms: int = DEFAULT_SMS) -> Choice:
    """Whether the lean route beats PyTorch for a call launched eagerly: one
    launch, no pack, no staging copy, so the least host time of any route,
    where its slower GPU work still hides behind the host's."""
    gpu_c, _ = gpu_times(p, fitted, exact)
    if gpu_c is None:
        return Choice(False, "no measurement or model of this shape on this GPU")
    theirs = torch_ms(p, gpu_c, ops, False, host)
    ours_host, theirs_host = host_ms(1, False, 0, host), conv_host_ms(p, host)
    saving_us = (theirs_host - ours_host) * 1e3
    if saving_us < LEAN_MIN_SAVING_US:
        return Choice(False, f"PyTorch: the lean kernel would save {saving_us:.0f} us of host time per call "
                             f"(under {LEAN_MIN_SAVING_US:.0f})")
    if gpu_c > theirs_host:
        # Only where PyTorch's own call is host-bound: its GPU time is then
        # hidden and the lean route's, modelled, only has to hide as well. On
        # a GPU-bound call an error of that model is time lost (in the H200
        # A/B a ControlNet's few-channel 3x3 convs at 512^2, modelled 25-50 us
        # on the lean route, made the model 10% slower).
        return Choice(False, f"PyTorch: its call is GPU-bound ({gpu_c:.4g} ms), not the lean route's case")
    ours = max(ours_host, lean_ms(p, sms))
    if ours <= MARGIN * theirs:
        return Choice(True, f"lean kernel {ours:.4g} ms vs PyTorch {theirs:.4g} ms launched "
                            "(host-bound: input and weight read in place)", ours)
    return Choice(False, f"PyTorch faster as called ({theirs:.4g} ms vs lean kernel {ours:.4g} ms)", ours)


def fused_epilogue_pays(p: Problem, ops: int, bias_pass: bool, graph: bool, host: Optional[dict] = None,
                        gpu_conv: float = 0.0) -> bool:
    """Where PyTorch runs the conv: whether cuDNN without its bias plus one
    epilogue pass (bias, residual, activation, scale) beats the module's
    own call followed by ``ops`` eager ops (``bias_pass``: PyTorch adds the
    bias in a pass of its own, as it does on an NHWC output). Launched, each
    side costs the larger of its host time and its GPU time (``gpu_conv``:
    the convolution's own, the same on both sides)."""
    host = HOST_US if host is None else host
    passes = ops + int(bias_pass)
    if passes == 0:
        return False
    pass_ms = LAUNCH_MS + 2 * p.out_bytes / (COPY_TBPS * 1e9)
    if graph:
        return passes * pass_ms > pass_ms
    conv_host = conv_host_ms(p, host)
    eager = max(conv_host + ops * host["op"] / 1e3, gpu_conv + passes * pass_ms)
    fused = max(conv_host + host["unplanned"] / 1e3, gpu_conv + pass_ms)
    return fused <= MARGIN * eager


# The GroupNorm kernels (statistics, finalize, apply) beat PyTorch's GroupNorm
# + SiLU from about this many elements: on the H200 (bf16, GPU time,
# bench.group_norm) 2.6M elements ran 0.47-0.49x PyTorch's time and 4.2M
# 1.10-1.58x; PyTorch's one call is also less host time.
GROUP_NORM_MIN_ELEMENTS = 4 << 20


def group_norm_pays(numel: int) -> bool:
    """Whether the GroupNorm kernels beat PyTorch's GroupNorm on a tensor of
    ``numel`` elements (eagerly and in a graph alike: below the crossover
    they are slower on the GPU too)."""
    return numel >= GROUP_NORM_MIN_ELEMENTS


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
                  host: Optional[dict] = None) -> bool:
    """Whether the RMS-norm kernel (with the activation fused where
    ``activation``) beats PyTorch's passes on ``numel`` elements of
    ``element_size`` bytes, launched eagerly (host time included) or from a
    graph (GPU time only)."""
    host = HOST_US if host is None else host
    t = RMS_NORM_TORCH
    ops = t["ops"] - (2 if element_size >= 4 else 0) + (t["act_ops"] if activation else 0)
    per_elem = t["bytes"] + (t["act_bytes"] if activation else 0.0)
    torch_gpu = ops * LAUNCH_MS + numel * per_elem / (COPY_TBPS * 1e9)
    ours_gpu = LAUNCH_MS + 3 * numel * element_size / (RMS_NORM_BW_FACTOR * COPY_TBPS * 1e9)
    if graph:
        return ours_gpu <= MARGIN * torch_gpu
    torch_host = ops * host["op"] / 1e3
    ours_host = (host["base"] + host["launch"]) / 1e3
    return max(ours_host, ours_gpu) <= MARGIN * max(torch_host, torch_gpu)


def conv3d_choice(ours_ms: float, cudnn_ms: float, ops: int, graph: bool, out_bytes: float = 0.0,
                  repack: bool = False, host: Optional[dict] = None) -> Choice:
    """Whether a Conv3d call takes the kernel, from its table entry's GPU
    times: ``ours_ms`` the kernel reading the cached frames and padding in
    place, ``cudnn_ms`` the cuDNN route (``conv3d.cudnn_conv3d``: the
    concatenation, cuDNN); ``ops`` eager epilogue ops after PyTorch's conv,
    which the kernel fuses, each a pass over the ``out_bytes`` output.
    Launched, each side costs the larger of its host and GPU time (the cuDNN
    route: its conv, the concatenation and the bias pass; the kernel's: a
    launch through its launcher, not a recorded replay, plus the weight's
    repack where ``repack``, one PyTorch copy)."""
    h = HOST_US if host is None else host
    pass_ms = LAUNCH_MS + 2 * out_bytes / (COPY_TBPS * 1e9)
    if graph:
        ours, theirs = ours_ms, cudnn_ms + ops * pass_ms
    else:
        ours = max((h["base"] + h["unplanned"] + repack * h["op"]) / 1e3, ours_ms)
        theirs = max((h["base"] + h["conv"] + 2 * h["op"]) / 1e3, cudnn_ms) + ops * max(h["op"] / 1e3, pass_ms)
    if ours <= MARGIN * theirs:
        return Choice(True, f"kernel {ours:.4g} ms vs PyTorch {theirs:.4g} ms as called (measured)", ours)
    return Choice(False, f"PyTorch's conv3d measured faster as called ({theirs:.4g} ms vs kernel {ours:.4g} ms)",
                  ours)
