"""The offline tuner behind ``convpatch tune`` and the packaged tables.

For every distinct convolution of the chosen model families (traced off the
architectures, see ``model_shapes``) and each layout, it runs every candidate
config the GPU can take, rejects a candidate whose output differs from
PyTorch's beyond the dtype's tolerance or that fails to build, times the
rest against cuDNN (medians, after warm-up, L2 flushed), and writes a table:

  * ``exact`` entries: the fastest candidate per shape key, with the measured
    times; where cuDNN was faster than every candidate by more than the noise
    margin, the entry routes to cuDNN (the only way a table may do that).
  * ``buckets`` per layout and M range (output pixels), then ``any``: the
    candidate with the best geometric-mean slowdown against each shape's own
    best over the shapes in range, so shapes never tuned still get a measured
    choice.

Nothing here runs on the hot path: the wrappers only read the table.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time
from typing import Callable, Dict, Iterable, List, Optional

import torch

from conv_patch import functional
from conv_patch.ops.loader import kernel_errors
from conv_patch.routing import tables as config_tables
from conv_patch.runtime import pack
from conv_patch.routing.registry import (BY_ROUTE, CUDNN_TABLE_ROUTE, Route, flat_problem, route_of_table,
                                         route_problem, taps_problem, tile_config, tma_problem, tuner_candidates)
from conv_patch.specs import CallDesc, layout_of
from conv_patch.target import Target, conv_tf32, target_for
from conv_patch.tools.model_shapes import ConvCall, distinct_calls

# The table names of the 2-D kernel routes the tables' buckets are derived
# for (the registry's), and PyTorch's measured route.
PORTABLE, TMA, TAPS, FLAT = (BY_ROUTE[r].table for r in (Route.CONV2D_IGEMM, Route.CONV2D_TMA, Route.CONV2D_TAPS,
                                                         Route.CONV2D_FLAT))
CUDNN = CUDNN_TABLE_ROUTE

# cuDNN must beat the best candidate by this much to take a shape: run-to-run
# noise on one shape is up to ~8% on the H200, and a fused epilogue (which the
# cuDNN route runs as a pass of its own after the convolution) is worth more
# than a few percent.
CUDNN_MARGIN = 0.95
# ||candidate - reference|| / ||reference||, reference = PyTorch in exact fp32.
# A candidate passes within TOLERANCE, and on a GPU also within
# CUDNN_ERR_FACTOR x cuDNN's own error (+ CUDNN_ERR_SLACK): the first bound
# alone is loose enough to let a tile that miscomputes a few pixels through.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}
CUDNN_ERR_FACTOR = 1.5
CUDNN_ERR_SLACK = 1e-3
M_BUCKETS = (4096, 16384, 65536, 262144, 1048576, None)


def candidates(target: Target) -> List[dict]:
    """The configs measured on ``target`` (the route registry's)."""
    return tuner_candidates(target)


def config_label(c: dict) -> str:
    if config_tables.route_of(c) == CUDNN:
        return CUDNN
    lab = f"{config_tables.route_of(c)} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}"
    if c.get("BLOCK_N2"):
        lab += f" n{c['BLOCK_N2']}"
    if "BLOCK_W" in c:
        lab += f" w{c['BLOCK_W']}"
    lab += f" nw{c.get('num_warps', 4)} s{c.get('num_stages', 2)}"
    return lab + (f" p{c['persistent']}" if c.get("persistent") else "")


def config_of_label(label: str) -> Optional[dict]:
    """The candidate config a report's label names (``config_label``'s
    inverse); None for a label it cannot have written."""
    parts = label.split()
    try:
        bm, bn, bk = (int(v) for v in parts[1].split("x"))
        fields = {"n": 0, "w": None, "nw": 4, "s": 2, "p": 0}
        for p in parts[2:]:
            name = p.rstrip("0123456789")
            if name not in fields:
                return None
            fields[name] = int(p[len(name):])
    except (IndexError, ValueError):
        return None
    cfg = tile_config(parts[0], bm, bn, bk, fields["nw"], fields["s"], bw=fields["w"], persistent=fields["p"],
                      bn2=fields["n"])
    return cfg if config_label(cfg) == label else None


@dataclasses.dataclass
class Measurement:
    key: str
    call: ConvCall
    layout: str
    m: int
    tma_ok: bool
    times: Dict[str, float]  # config label -> ms (valid candidates only)
    rejected: Dict[str, str]  # config label -> why
    cudnn_ms: Optional[float]
    configs: Dict[str, dict]

    @property
    def best(self) -> Optional[str]:
        return min(self.times, key=self.times.get) if self.times else None


def graph_replay(fn: Callable, warmup: int = 3) -> Callable:
    """``fn`` captured once in a CUDA graph, returned as the graph's replay
    (``fn`` itself off the GPU). Timing the replay times the GPU work alone:
    a conv-patch call spends ~0.1-0.2 ms of host time on routing and the
    launch (bench/results/overhead-*.json), more than a small conv's kernel,
    and CUDA events would count the GPU waiting for it (cuDNN's ~40 us of
    host time hide behind do_bench's L2 flush). Warm-up runs first on a
    side stream, as capture requires; cuDNN picks its algorithm there."""
    if not torch.cuda.is_available():
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _timer(device: torch.device, graph: bool = False) -> Callable[[Callable], float]:
    if device.type == "cuda":
        import triton.testing

        def cuda_ms(fn):
            return triton.testing.do_bench(graph_replay(fn) if graph else fn, warmup=2, rep=10,
                                           return_mode="median")
        return cuda_ms

    def wall_ms(fn):  # the interpreter: only the tuner's logic is under test
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return wall_ms


def measure(call: ConvCall, layout: str, dtype: torch.dtype, device: torch.device,
            cands: List[dict], target: Target, timer=None) -> Measurement:
    """Run, check and time every candidate on one shape and layout."""
    timer = timer or _timer(device)
    spec, shape = call.spec, call.shape
    g = torch.Generator().manual_seed(0)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(shape, generator=g).to(device, dtype).contiguous(memory_format=fmt)
    k = spec.kernel
    w = (torch.randn(spec.out_channels, spec.in_channels, *k, generator=g)
         * (spec.in_channels * k[0] * k[1]) ** -0.5).to(device, dtype)
    b = torch.randn(spec.out_channels, generator=g).to(device, dtype)
    packed = pack.kernel_layout(w)  # the kernels are timed on a ready pack, as the runtime keeps it
    w_torch = w.contiguous(memory_format=fmt)
    pad = spec.padding_arg
    with conv_tf32(False):
        ref = spec.torch_conv2d(x.float(), w.float(), b.float())
    oh, ow = ref.shape[2], ref.shape[3]
    tol = TOLERANCE[dtype]
    if device.type == "cuda":
        cudnn_out = spec.torch_conv2d(x, w_torch, b).float()
        cudnn_err = ((cudnn_out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        tol = min(tol, CUDNN_ERR_FACTOR * cudnn_err + CUDNN_ERR_SLACK)
        del cudnn_out
    desc = CallDesc.of_call(x, packed, b)
    # A route reading the module's own weight in place is timed on it.
    dense = CallDesc.of_call(x, w, b)
    tma_ok = tma_problem(spec, desc, shape, target) is None
    times, rejected, configs = {}, {}, {}
    for cfg in cands:
        lab = config_label(cfg)
        configs[lab] = cfg
        name = config_tables.route_of(cfg)
        in_place = BY_ROUTE[route_of_table(spec.kind, name)].weight_in_place
        wk = w if in_place else packed
        if route_problem(name, spec, dense if in_place else desc, shape, target):
            continue
        out = torch.empty(ref.shape, dtype=dtype, device=device, memory_format=fmt)
        _try_candidate(lab, lambda: functional.conv2d(x, wk, b, spec.stride, pad, spec.dilation, out=out, config=cfg),
                       out, ref, tol, timer, times, rejected)
    cudnn_ms = None
    if device.type == "cuda":
        cudnn_ms = timer(lambda: spec.torch_conv2d(x, w_torch, b))
    key = config_tables.shape_key(spec, shape, layout, dtype)
    return Measurement(key, call, layout, shape[0] * oh * ow, tma_ok, times, rejected, cudnn_ms, configs)


def _try_candidate(label, fn, out, ref, tol, timer, times, rejected):
    """Run candidate ``fn`` (writing ``out``, poisoned first) once; into
    ``times`` its time where its output is within ``tol`` of ``ref``, else
    into ``rejected`` why not (wrong output, or the kernel cannot be built)."""
    try:
        out.fill_(float("nan"))
        fn()
        err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not math.isfinite(err) or err > tol:
            rejected[label] = f"wrong output (rel err {err:.3g})"
            return
        times[label] = timer(fn)
    except kernel_errors() as e:
        rejected[label] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"


def exact_entry(m: Measurement) -> Optional[dict]:
    if m.best is None:
        return None
    best_ms = m.times[m.best]
    entry = dict(m.configs[m.best])
    entry["ours_ms"] = round(best_ms, 5)
    if m.cudnn_ms is not None:
        entry["cudnn_ms"] = round(m.cudnn_ms, 5)
        if m.cudnn_ms < CUDNN_MARGIN * best_ms:
            return {"route": CUDNN, "cudnn_ms": round(m.cudnn_ms, 5), "ours_ms": round(best_ms, 5),
                    "best_kernel": m.best}
    return entry


def _pick(ms: List[Measurement], route: str) -> Optional[str]:
    """The config label of ``route`` with the best geomean slowdown against
    each shape's best, among configs valid on every shape given."""
    return _best(ms, (route,))[0]


def _best(ms: List[Measurement], routes) -> tuple:
    """(label, summed log slowdown) of the best config of any of ``routes``
    valid on every shape given; (None, inf) when there is none."""
    labels = None
    for m in ms:
        ok = {lab for lab in m.times if config_tables.route_of(m.configs[lab]) in routes}
        labels = ok if labels is None else labels & ok
    if not labels:
        return None, math.inf

    def score(lab):
        return sum(math.log(m.times[lab] / min(m.times.values())) for m in ms)
    lab = min(sorted(labels), key=score)
    return lab, score(lab)


def build_table(measurements: List[Measurement], arch: str, dtype: torch.dtype, note: str = "",
                base: Optional[dict] = None, exact_only: bool = False, ranges_only: bool = False) -> dict:
    """The table of these measurements. With ``base`` (an earlier table of
    the same GPU), its exact entries stay unless re-measured, and its buckets
    stay for the layouts not measured now; with ``exact_only`` too, all of
    its buckets and its ``any`` stay (a re-measure of a few shapes refreshes
    their entries without re-deriving the ranges from those few). With
    ``ranges_only`` it is the other way round: the base's exact entries all
    stay and the buckets of the measured layouts and ``any`` are derived anew
    (measurements read back from reports, ``measurements_from_reports``)."""
    dname = config_tables.dtype_name(dtype)
    dtypes = [dname] + [k for k, v in config_tables.SHARED_EXACT_DTYPE.items() if v == dname]
    table = {"schema": 1, "arch": arch, "source": note, "conv2d": {"exact": {}, "buckets": []}}
    sec = table["conv2d"]
    old = (base or {}).get("conv2d") or {}
    if base:
        # One line, this run's: the base table's own runs are its history
        # (docs/tuning-log.md), and its calibration stays.
        table["source"] = f"{note} Extends an earlier table of this GPU."
        if base.get("calibration"):
            table["calibration"] = base["calibration"]
        sec["exact"].update(old.get("exact") or {})
        if base.get("conv3d"):
            table["conv3d"] = base["conv3d"]  # measured apart (measure_conv3d)
    measured_layouts = sorted({m.layout for m in measurements})
    for m in ([] if ranges_only else measurements):
        e = exact_entry(m)
        if e is not None:
            sec["exact"][m.key] = e
    configs = {}
    for m in measurements:
        configs.update(m.configs)

    def bucketed(route, sel, layouts, unless_beaten_by=()):
        lo = 0
        for hi in M_BUCKETS:
            inside = [m for m in sel if m.m > lo and (hi is None or m.m <= hi)]
            lab, score = _best(inside, (route,)) if inside else (None, math.inf)
            if lab and unless_beaten_by and _best(inside, unless_beaten_by)[1] < score:
                lab = None
            if lab:
                b = {"max_m": hi, "dtypes": dtypes, "config": configs[lab]}
                if unless_beaten_by:
                    # Closed below too: where this route lost in a smaller
                    # range, its convs must not fall through to it here.
                    b["min_m"] = lo
                if layouts:
                    b["layouts"] = layouts
                sec["buckets"].append(b)
            lo = hi or lo
    if (exact_only or ranges_only) and not base:
        raise ValueError("exact_only and ranges_only refresh part of a base table; no base given")
    if exact_only and ranges_only:
        raise ValueError("exact_only and ranges_only exclude each other")
    rebuilt = [] if exact_only else measured_layouts
    for layout in rebuilt:
        # Taps and flat first: only convs those routes can take match their
        # buckets, which are looked up before the general ones; so a range
        # gets one only where its best config beat the general routes' best
        # over the same convs (64 -> 3 3x3 convs take the TMA kernel).
        general = (TMA, PORTABLE)
        bucketed(TAPS, [m for m in measurements if m.layout == layout and taps_problem(m.call.spec) is None],
                 [layout], general)
        bucketed(FLAT, [m for m in measurements if m.layout == layout and flat_problem(m.call.spec) is None],
                 [layout], general)
        bucketed(TMA, [m for m in measurements if m.layout == layout and m.tma_ok], [layout])
        bucketed(PORTABLE, [m for m in measurements if m.layout == layout], [layout])
    for b in old.get("buckets") or []:
        if not set(b.get("layouts") or ("nhwc", "nchw")) <= set(rebuilt):
            sec["buckets"].append(b)
    any_lab = _pick([m for m in measurements if m.tma_ok], TMA) or _pick(measurements, PORTABLE)
    if old.get("any") and not (ranges_only and any_lab):
        sec["any"] = old["any"]
    elif any_lab:
        sec["any"] = configs[any_lab]
    return config_tables.validate_table(table, f"tuned table for {arch}")


def jobs_of(calls: Iterable[ConvCall], layouts, dtype: torch.dtype, skip_keys=()) -> list:
    """(call, layout) pairs to measure: conv2d only (tables key nothing
    else), without the shape keys in ``skip_keys`` (those a base table
    already holds, for ``--missing``)."""
    skip = set(skip_keys)
    return [(c, lay) for c in calls for lay in layouts if not c.spec.transposed
            and config_tables.shape_key(c.spec, c.shape, lay, dtype) not in skip]


def tune(calls: Iterable[ConvCall], layouts, dtype: torch.dtype, device: torch.device,
         target: Target, cands: Optional[List[dict]] = None, progress=None, timer=None,
         time_limit_s: Optional[float] = None, on_measure=None, skip_keys=(),
         graph: bool = False) -> List[Measurement]:
    """Measure every call in every layout, in the order given, except the
    shape keys in ``skip_keys``. With ``time_limit_s`` it stops starting new
    shapes once the time is spent (the table then covers what was measured;
    buckets and 'any' still come from measurements). ``on_measure(m)`` sees
    each result as it lands. ``graph``: time CUDA-graph replays (GPU time
    without the host's, see ``graph_replay``)."""
    start = time.monotonic()
    timer = timer or _timer(device, graph)
    cands = cands if cands is not None else candidates(target)
    # Asymmetric padding (diffusers' Downsample2D pad as the block recipe
    # folds it) is measured against F.pad + cuDNN, what the cudnn route would
    # run.
    jobs = jobs_of(calls, layouts, dtype, skip_keys)
    out = []
    for i, (call, layout) in enumerate(jobs):
        if time_limit_s is not None and time.monotonic() - start > time_limit_s:
            break
        if progress:
            progress(i, len(jobs), f"{call.describe()} {layout}")
        out.append(measure(call, layout, dtype, device, cands, target, timer))
        if on_measure:
            on_measure(out[-1])
    if progress:
        progress(len(jobs), len(jobs), "done")
    return out


def measurements_from_reports(rows: Iterable[dict], calls: Iterable[ConvCall], layouts,
                              dtype: torch.dtype) -> tuple:
    """Measurements read back from report lines (``summary_row``, one JSON
    object per line of a ``--report`` file), for the keys of ``calls`` in
    ``layouts``; a key's last line wins. Returns (measurements, lines whose
    key is not among the calls, labels no candidate config has)."""
    known = {config_tables.shape_key(c.spec, c.shape, lay, dtype): (c, lay) for c, lay in jobs_of(calls, layouts, dtype)}
    latest, unknown_keys, bad_labels = {}, set(), set()
    for r in rows:
        if r.get("key") in known:
            latest[r["key"]] = r
        else:
            unknown_keys.add(r.get("key"))
    out = []
    for key, r in latest.items():
        call, layout = known[key]
        configs = {}
        for lab in list(r.get("times") or {}) + list(r.get("rejected") or {}):
            cfg = config_of_label(lab)
            if cfg is None:
                bad_labels.add(lab)
            else:
                configs[lab] = cfg
        times = {lab: float(t) for lab, t in (r.get("times") or {}).items() if lab in configs}
        oh, ow = call.spec.output_hw(call.shape[2], call.shape[3])
        # A TMA label in the report means the route took the shape: the
        # tuner skips the candidates of a route that cannot.
        tma_ok = any(config_tables.route_of(c) == TMA for c in configs.values())
        out.append(Measurement(key, call, layout, call.shape[0] * oh * ow, tma_ok, times,
                               dict(r.get("rejected") or {}), r.get("cudnn_ms"), configs))
    return out, unknown_keys, bad_labels


def source_note(families, resolutions, batches, layouts, dtype, n_shapes, n_jobs=None, exact_only=False) -> str:
    import triton
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "interpreter"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return (f"convpatch tune on {gpu}, torch {torch.__version__}, triton {triton.__version__}, {date}: "
            f"{n_shapes} shape keys{'' if n_jobs in (None, n_shapes) else f' (of {n_jobs}: time limit reached)'} = "
            f"the convs of {'/'.join(families)} at {resolutions} px, batch {batches}, "
            f"{'/'.join(layouts)}, {config_tables.dtype_name(dtype)} (fp16 shares the exact keys). "
            f"Exact entries hold the measured ms; "
            + ("only they were refreshed, buckets and 'any' are the base table's; " if exact_only else
               "buckets and 'any' are the best geomean configs over the shapes in range; ")
            + f"cuDNN routes only where it was faster than every candidate by "
            f">{round((1 - CUDNN_MARGIN) * 100)}%.")


@dataclasses.dataclass
class Conv3dMeasurement:
    """One Conv3d call measured: each candidate tile of the Conv3d kernel
    (reading the cached frames and padding in place) against what the
    dispatch core runs where it does not take the kernel, the cuDNN route
    (``conv3d.cudnn_conv3d``: ``cudnn_ms``), and beside it the module's own
    forward (the concatenation, F.pad, cuDNN's conv3d: ``module_ms``), what
    an unpatched model runs."""

    key: str
    name: str
    times: Dict[str, float]
    rejected: Dict[str, str]
    cudnn_ms: Optional[float]
    configs: Dict[str, dict]
    module_ms: Optional[float] = None

    @property
    def best(self) -> Optional[str]:
        return min(self.times, key=self.times.get) if self.times else None


def measure_conv3d(spec, x, cache, weight, bias, module_forward: Callable, cands: List[dict],
                   timer=None) -> Conv3dMeasurement:
    """Run, check and time every candidate on one Conv3d call (``spec`` the
    call's ``conv3d.Conv3dSpec``: its ``pads`` this call's (front, back) per
    axis, as the dispatch core keys the call, not the module's own;
    ``module_forward()`` the module's own computation of it). A candidate
    whose output is further from exact fp32 than the dtype's tolerance
    (and than 1.5x PyTorch's own error on a GPU) or that fails to build is
    rejected with the reason."""
    from conv_patch.ops import conv3d as conv3d_op
    timer = timer or _timer(x.device)
    with conv_tf32(False):
        ref = conv3d_op.torch_conv3d(x.float(), weight.float(), None if bias is None else bias.float(),
                                     None if cache is None else cache.float(), spec.pads, spec.stride,
                                     spec.dilation)
    tol = TOLERANCE[x.dtype]
    theirs = module_forward().float()
    if x.is_cuda:
        tol = min(tol, CUDNN_ERR_FACTOR * ((theirs - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                  + CUDNN_ERR_SLACK)
    del theirs
    fmt = torch.channels_last_3d if layout_of(x) == "ndhwc" else torch.contiguous_format
    times, rejected, configs = {}, {}, {}
    desc = CallDesc.of_call(x, weight, bias, cache=cache)
    for cfg in cands:
        lab = config_label(cfg)
        configs[lab] = cfg
        if route_problem(config_tables.route_of(cfg), spec, desc, tuple(x.shape), target_for(x.device)):
            continue  # (an NCDHW call, say: the route's own rule)
        out = torch.empty(ref.shape, dtype=x.dtype, device=x.device, memory_format=fmt)
        _try_candidate(lab, lambda: functional.conv3d(x, weight, bias, spec.stride, spec.pads, spec.dilation,
                                               cache=cache, out=out, route="kernel", config=cfg),
                       out, ref, tol, timer, times, rejected)
    tc = 0 if cache is None else cache.shape[2]
    route_ms = timer(lambda: conv3d_op.cudnn_conv3d(x, weight, bias, cache, spec.pads, spec.stride,
                                                    spec.dilation))
    return Conv3dMeasurement(config_tables.conv3d_call_key(spec, x, cache),
                             f"conv3d {spec.describe()} on {tuple(x.shape)} cache {tc}", times, rejected,
                             route_ms, configs, module_ms=timer(module_forward))


def conv3d_entry(m: Conv3dMeasurement) -> Optional[dict]:
    """The table entry of a measured Conv3d call: the fastest tile with both
    times, or ``cudnn`` where the cuDNN route beat every tile by the
    noise margin; None where no tile ran correctly."""
    if m.best is None or m.cudnn_ms is None:
        return None
    best_ms = m.times[m.best]
    if m.cudnn_ms < CUDNN_MARGIN * best_ms:
        return {"route": CUDNN, "ours_ms": round(best_ms, 5), "cudnn_ms": round(m.cudnn_ms, 5),
                "best_kernel": m.best}
    return dict(m.configs[m.best], ours_ms=round(best_ms, 5), cudnn_ms=round(m.cudnn_ms, 5))


def merge_conv3d(table: dict, measurements: List[Conv3dMeasurement], note: str = "") -> dict:
    """``table`` (an architecture's, as read from its JSON) with the conv3d
    entries of these measurements added or replaced; validated."""
    out = dict(table)
    sec = dict(out.get("conv3d") or {})
    exact = dict(sec.get("exact") or {})
    for m in measurements:
        e = conv3d_entry(m)
        if e is not None:
            exact[m.key] = e
    sec["exact"] = exact
    out["conv3d"] = sec
    if note:
        # One line, this run's (as ``write`` does): the table's earlier runs
        # are its history (docs/tuning-log.md), not lost but not repeated.
        out["source"] = f"{note} Extends an earlier table of this GPU." if table.get("source") else note
    return config_tables.validate_table(out, f"table for {out.get('arch', '?')} with conv3d entries")


def write_table(table: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def geomean(xs) -> Optional[float]:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def summary_row(m: Measurement) -> dict:
    best = m.best
    return {
        "name": f"{m.call.describe()} {m.layout}", "where": m.call.where, "key": m.key,
        "best": best, "ours_ms": m.times.get(best) if best else None, "cudnn_ms": m.cudnn_ms,
        "speedup": (m.cudnn_ms / m.times[best]) if best and m.cudnn_ms else None,
        "times": m.times, "rejected": m.rejected,
    }


def summary_rows(measurements: List[Measurement]) -> List[dict]:
    return [summary_row(m) for m in measurements]


__all__ = ["candidates", "measure", "tune", "build_table", "distinct_calls", "write_table",
           "measurements_from_reports", "measure_conv3d", "conv3d_entry", "merge_conv3d"]
