"""torch.compile on a patched model (issue 46): the model compiled unpatched
(the baseline) against the model compiled after ``conv_patch.apply`` (ours)
and the patched model run eagerly, per compile mode, each compiled with
``fullgraph=True`` (a graph break is an error, recorded in the row).

    python -m bench.compile [--only NAME ...] [--modes default,max-autotune-no-cudagraphs,reduce-overhead]
                            [--runs 10] [--warmup 3] [--backend inductor] [--tiny] [--out DIR|FILE]
                            [--name compile] [--in-process] [--warm-cache] [--child-timeout S]
                            [--cudnn-benchmark] [--profile N]

Cases (``--only``): ``flux-vae-decode`` (the FLUX.1 VAE decoder at 1024²,
``bench.zoo``'s model, ``torch.compile(decoder)``), ``flux-vae-decode-fn``
(the whole FLUX.1 ``AutoencoderKL`` of ``bench.vae``, compiled the way
diffusers' docs do it: ``vae.decode = torch.compile(vae.decode)`` after
``apply``), ``sd15-unet`` (512², batch 2) and ``sdxl-unet`` (1024²), zoo
configs with seeded weights, in the zoo's dtypes (bf16 VAE, fp16 UNets).

Per case and mode one row. Each (case, mode) runs in a child process of its
own (``--in-process``: all in this one) whose Inductor and Triton caches
start empty (``--warm-cache``: the user's caches), so every compile is cold
as a user's first one. In the child: a throwaway compile of a one-line
function pays the process's one-time costs (imports, compile workers) first;
then ``torch._dynamo.reset()``, the patched model compiled and called once
(``compile_s``: that first call, synchronised; conv-patch's own kernels are
compiled in it too), ``reset()``, the unpatched one (``baseline_compile_s``:
it may reuse Inductor kernels the patched compile built, so the comparison
leans the baseline's way). Then, after ``--warmup`` rounds (the ``reset``
makes the patched model's compile run again there, from the caches), the
variants timed interleaved in rotated order (``bench.zoo.interleaved``:
each call launched and timed from a synchronised GPU to its finished output,
three inputs rotated), medians over ``--runs`` rounds: ``baseline_ms``
(compiled unpatched), ``ours_ms`` (compiled patched), ``patched_eager_ms``,
``eager_ms`` (unpatched, eager). Under ``reduce-overhead`` every compiled
call starts with ``torch.compiler.cudagraph_mark_step_begin()``. All calls
under ``torch.no_grad()`` (as diffusers' pipelines call them).

Rows also carry ``speedup`` (baseline_ms / ours_ms), ``vs_patched_eager``
(patched_eager_ms / ours_ms), ``compile_ratio`` (compile_s /
baseline_compile_s), ``second_call_s`` / ``baseline_second_call_s`` (the
call right after the first: a recompile shows here, and reduce-overhead's
CUDA-graph capture), ``graphs`` / ``baseline_graphs`` (graphs Dynamo
compiled over those two calls: 1 with fullgraph and no recompile),
``timing_graphs`` (those compiled in the timed rounds and their warm-up: 1,
the patched model's again after the reset), ``first_call_s`` (the patched
model's first eager call, after the compiled ones: its kernels are compiled
by then, so mostly planning), ``op_sites`` / ``op_kernel_sites``
(conv-patch call sites the compiled conv ops created, and those whose last
call ran a conv-patch kernel), ``norm_sites`` / ``norm_kernel_sites`` (the
GroupNorm op's, and those whose plans run the kernels), ``whole_block_calls``
(calls of a block run whole, as eagerly, in those two calls:
``runtime.compiled.whole_block``), ``first_pass`` (what compiling ahead
did at those blocks' first calls, or why it made no pass:
``conv_patch.last_pass``), ``rel_err_vs_baseline`` (ours against the
compiled unpatched output), ``rel_err_vs_fp32`` /
``baseline_rel_err_vs_fp32`` / ``patched_eager_rel_err_vs_fp32`` (against
the unpatched model in fp32, eager), ``peak_gib`` / ``baseline_peak_gib``
(``common.peak_gib``), and ``checks``: the issue's bars (both models
compiled with fullgraph; the patched one compiled once; compiled patched
never slower than patched eager; its compile time at most the baseline's;
``target_speedup``: FLUX decode ours <= 0.6x baseline, UNets >= 1.10x).
``--profile N`` adds one profiled call of the compiled patched, the patched
eager and the compiled unpatched model: ``ours_kernel_ms`` /
``patched_eager_kernel_ms`` / ``baseline_kernel_ms`` (the sum of the call's
GPU kernels: beside ``ours_ms`` and ``host_ms``, whether it is host- or
GPU-bound), ``*_kernel_launches`` and ``*_profile`` (the N largest kernels,
``common.profile_top``); and five calls of each compiled model (one with
``--tiny``) under cProfile, ``ours_host_top`` / ``baseline_host_top`` (the N Python functions
with the most own time per call, ``common.host_top``). A stage that fails leaves
``error`` ("stage: Type: message", ``traceback``) and what was measured
before it; a child that dies or passes
``--child-timeout`` leaves a row with its ``error``. ``--tiny`` runs the
zoo's tiny configs on the CPU (the tests); ``--backend eager`` or
``aot_eager`` traces without Inductor (the mode is then not passed on).
The JSON is written after every row.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

import conv_patch
from conv_patch.runtime.dispatch import NormSite
from conv_patch.runtime.compiled import whole_block_calls

from .common import (bench_device, child_rows, env_info, host_top, pass_records, peak_gib, print_table, profile_top,
                     sync, write_results)
from .zoo import DTYPES, inputs_for, interleaved, load_case, output_tensor, rel_err, seeded, tensor_bytes, \
    size_name

MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
FN_CASE = "flux-vae-decode-fn"
# (case, image size in pixels, batch, dtype or None for the model's own)
CASES = [("flux-vae-decode", 1024, 1, None), (FN_CASE, 1024, 1, None), ("sd15-unet", 512, 2, None),
         ("sdxl-unet", 1024, 1, None)]
TINY = [("flux-vae-decode", 8, 1, "fp32"), (FN_CASE, 8, 1, "fp32"), ("sd15-unet", 16, 1, "fp32"),
        ("sdxl-unet", 32, 1, "fp32")]
# Issue 46's bars on baseline_ms / ours_ms: FLUX.1 decode 1024² compiled and
# patched at most 0.6x compiled unpatched; SD1.5 and SDXL UNets at least 1.10x.
TARGETS = {"flux-vae-decode": 1 / 0.6, "sd15-unet": 1.10, "sdxl-unet": 1.10}
BASELINE = "torch.compile, unpatched"
TABLE = ["name", "baseline_ms", "ours_ms", "patched_eager_ms", "speedup", "vs_patched_eager", "compile_s",
         "baseline_compile_s", "rel_err_vs_baseline", "error"]


# -- the models ------------------------------------------------------------------------

def load(name, size, batch, dtype_name, tiny, device):
    """(row fields, unpatched model, inputs) of a case: ``bench.zoo``'s
    model, or for ``FN_CASE`` the whole FLUX.1 AutoencoderKL
    (``bench.vae.flux_vae``; tiny: the zoo's tiny AutoencoderKL) and latents."""
    if name != FN_CASE:
        return load_case(name, size, batch, dtype_name, tiny, device)
    from . import zoo
    dtype_label = dtype_name or "bf16"
    dtype = DTYPES[dtype_label]
    if tiny:
        with torch.device(device):
            vae = seeded(zoo.kl_vae(16, True))
        vae = vae.to(device, dtype).eval()
    else:
        from .vae import flux_vae
        vae = flux_vae(dtype)[2]
    fields = {"name": f"{name} {size_name(size)} b{batch} {dtype_label}", "model": name, "size": size_name(size),
              "batch": batch, "dtype": dtype_label}
    return fields, vae, inputs_for(zoo.image_inputs(16, 2 if tiny else 8), size, batch, device, dtype)


def entry(m, name):
    """What a case calls on model ``m``: the module, or its ``decode``."""
    return m.decode if name == FN_CASE else m


def compiled(m, name, opts):
    """``m`` compiled as a user does it: ``torch.compile(m)``, or for
    ``FN_CASE`` diffusers' pattern ``m.decode = torch.compile(m.decode)``."""
    if name == FN_CASE:
        m.decode = torch.compile(m.decode, **opts)
        return m.decode
    return torch.compile(m, **opts)


def _cast(obj, dtype):
    """Floating tensors in nested args/kwargs cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj


def _output(fn, inp):
    """``fn``'s answer to ``inp`` as an fp32 copy of its own (a CUDA-graph
    replay overwrites its outputs at the next replay)."""
    args, kw = inp
    return output_tensor(fn(*args, **kw)).detach().float().clone()


def fp32_reference(model, name, inp):
    """The unpatched model's eager answer in fp32."""
    if next(model.parameters()).dtype == torch.float32:
        return _output(entry(model, name), inp)
    m32 = copy.deepcopy(model).float()
    try:
        return _output(entry(m32, name), _cast(inp, torch.float32))
    finally:
        del m32
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- one (case, mode) ------------------------------------------------------------------

def _unique_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _sites():
    """conv-patch's call sites and norm sites of the compiled ops so far."""
    from conv_patch.runtime import dispatch
    return dispatch.sites()


def compile_options(mode, backend):
    opts = {"fullgraph": True, "backend": backend}
    if backend == "inductor":
        opts["mode"] = mode
    return opts


def _first_calls(fn, inp, graphed):
    """(seconds of the first, compiling call up to its finished output, of
    the second call (a recompile shows here; under reduce-overhead the
    CUDA-graph capture), graphs Dynamo compiled over both)."""
    g0 = _unique_graphs()
    args, kw = inp
    times = []
    for _ in range(2):
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        sync()
        t = time.perf_counter()
        fn(*args, **kw)
        sync()
        times.append(time.perf_counter() - t)
    return times[0], times[1], _unique_graphs() - g0


def _warmup_compile(opts, device, dtype) -> float:
    """A throwaway compile that pays the process's one-time costs (Inductor's
    imports, its compile workers, the device's set-up) before the timed ones."""
    torch._dynamo.reset()
    x = torch.randn(64, device=device, dtype=dtype)
    t = time.perf_counter()
    torch.compile(lambda a: torch.nn.functional.silu(a * 2 + 1), **opts)(x)
    sync()
    return time.perf_counter() - t


def bench_case(name, size, batch, dtype_name, mode, runs, warmup, tiny, device, backend="inductor", profile=0):
    """One row: ``name`` compiled in ``mode``, patched and unpatched (the
    module docstring says what is measured, in what order)."""
    fields, model, inputs = load(name, size, batch, dtype_name, tiny, device)
    row = {**fields, "name": f"{fields['name']} {mode}", "case": name, "mode": mode, "backend": backend,
           "pattern": "vae.decode = torch.compile(vae.decode)" if name == FN_CASE else "torch.compile(model)",
           "baseline": BASELINE, "runs": runs, "warmup": warmup, "target_speedup": TARGETS.get(name)}
    stage = "build"
    opts = compile_options(mode, backend)
    graphed = backend == "inductor" and mode == "reduce-overhead"
    try:
        with torch.no_grad():
            ref32 = fp32_reference(model, name, inputs[0])
            patched = copy.deepcopy(model)
            report = conv_patch.apply(patched)
            row.update(patched_convs=len(report.patched), fused_blocks=len(report.fused))
            eager_patched, eager_unpatched = entry(patched, name), entry(model, name)
            stage = "warm-up compile"
            row["warmup_compile_s"] = _warmup_compile(opts, device, next(model.parameters()).dtype)
            # The patched model first: conv-patch's kernels and plans are made
            # inside this call; the unpatched compile after it may reuse
            # Inductor kernels it built.
            stage = "compile patched"
            torch._dynamo.reset()
            sites0, whole0 = _sites(), whole_block_calls()
            ours = compiled(patched, name, opts)
            row["compile_s"], row["second_call_s"], row["graphs"] = _first_calls(ours, inputs[0], graphed)
            sites1 = _sites()
            row["whole_block_calls"] = whole_block_calls() - whole0
            row["first_pass"] = pass_records(patched)
            new = [s for k, s in sites1.items() if k not in sites0]
            norms = [s for s in new if isinstance(s, NormSite)]
            convs = [s for s in new if not isinstance(s, NormSite)]
            row["op_sites"] = len(convs)
            row["op_kernel_sites"] = sum(1 for s in convs if _last_is_kernel(s))
            row["norm_sites"] = len(norms)
            row["norm_kernel_sites"] = sum(1 for s in norms if _runs_kernels(s))
            stage = "compile unpatched"
            torch._dynamo.reset()
            base = compiled(model, name, opts)
            row["baseline_compile_s"], row["baseline_second_call_s"], row["baseline_graphs"] = _first_calls(
                base, inputs[0], graphed)
            stage = "patched eager first call"
            t = time.perf_counter()
            _output(eager_patched, inputs[0])
            sync()
            row["first_call_s"] = time.perf_counter() - t

            stage = "timing"
            state = {"i": 0}

            def call(fn, mark):
                def f():
                    if mark:
                        torch.compiler.cudagraph_mark_step_begin()
                    args, kw = inputs[state["i"] % len(inputs)]
                    fn(*args, **kw)
                    state["i"] += 1
                return f
            variants = {"baseline": call(base, graphed), "ours": call(ours, graphed),
                        "patched_eager": call(eager_patched, False), "eager": call(eager_unpatched, False)}
            g0 = _unique_graphs()
            res = interleaved(variants, runs, warmup)
            # (1 expected: the patched model's compile again after the reset)
            row["timing_graphs"] = _unique_graphs() - g0
            for k, key in (("baseline", "baseline_ms"), ("ours", "ours_ms"), ("patched_eager", "patched_eager_ms"),
                           ("eager", "eager_ms")):
                row[key] = res[k]["ms"]
            row["host_ms"], row["baseline_host_ms"] = res["ours"]["host_ms"], res["baseline"]["host_ms"]

            stage = "errors"
            if graphed:
                torch.compiler.cudagraph_mark_step_begin()
            y_ours = _output(ours, inputs[0])
            if graphed:
                torch.compiler.cudagraph_mark_step_begin()
            y_base = _output(base, inputs[0])
            row["rel_err_vs_baseline"] = rel_err(y_ours, y_base)
            row["rel_err_vs_fp32"] = rel_err(y_ours, ref32)
            row["baseline_rel_err_vs_fp32"] = rel_err(y_base, ref32)
            row["patched_eager_rel_err_vs_fp32"] = rel_err(_output(eager_patched, inputs[0]), ref32)

            stage = "peak memory"
            args, kw = inputs[0]
            held = tensor_bytes((args, kw))

            def once(fn):
                def f():
                    if graphed:
                        torch.compiler.cudagraph_mark_step_begin()
                    fn(*args, **kw)
                return f
            row["peak_gib"] = peak_gib(once(ours), patched, held)
            row["baseline_peak_gib"] = peak_gib(once(base), model, held)

            if profile:
                # Where the compiled patched call's time goes against the
                # patched eager one: GPU kernels by total time, and the sum
                # of all of them (the call's GPU time, to set beside its
                # wall and host time above).
                stage = "profile"
                for key, fn in (("ours", once(ours)), ("patched_eager", once(eager_patched)),
                                ("baseline", once(base))):
                    whole = profile_top(fn, device, top=100000)
                    row[f"{key}_kernel_ms"] = sum(r["ms"] for r in whole)
                    row[f"{key}_kernel_launches"] = sum(r["calls"] for r in whole)
                    row[f"{key}_profile"] = whole[:profile]
                # Where a host-bound compiled call's host time goes, patched
                # against unpatched: Python functions by own time per call.
                for key, fn in (("ours", once(ours)), ("baseline", once(base))):
                    row[f"{key}_host_top"] = host_top(fn, calls=1 if tiny else 5, top=profile)
    except Exception as e:  # a graph break under fullgraph, a failed capture, OOM: said in the row
        row["error"] = f"{stage}: {type(e).__name__}: {e}"[:4000]
        row["traceback"] = traceback.format_exc()[-4000:]
    _derive(row)
    return row


def _last_is_kernel(site) -> bool:
    from conv_patch.runtime.state import state_of
    last = state_of(site).last
    return bool(last is not None and last.is_kernel)


def _runs_kernels(site) -> bool:
    """Whether a norm site's plans run the GroupNorm kernels."""
    from conv_patch.runtime.state import state_of
    return any(getattr(p, "kernel", False) for p in (state_of(site).plans or {}).values())


def _derive(row):
    """Ratios and the issue's checks from what the row measured."""
    b, o, pe = row.get("baseline_ms"), row.get("ours_ms"), row.get("patched_eager_ms")
    if b and o:
        row["speedup"] = b / o
    if pe and o:
        row["vs_patched_eager"] = pe / o
    if row.get("eager_ms") and b:
        row["baseline_vs_eager"] = row["eager_ms"] / b
    c, bc = row.get("compile_s"), row.get("baseline_compile_s")
    if c is not None and bc:
        row["compile_ratio"] = c / bc
    # fullgraph: both models compiled with fullgraph=True and ran (a graph
    # break raises); compiled_once: no recompile on the patched model's second call.
    checks = {"fullgraph": "compile_s" in row and "baseline_compile_s" in row}
    if "graphs" in row:
        checks["compiled_once"] = row["graphs"] == 1
    if o and pe:
        checks["not_slower_than_patched_eager"] = o <= pe
    if c is not None and bc is not None:
        checks["compile_not_slower"] = c <= bc
    if row.get("target_speedup") and "speedup" in row:
        checks["target_speedup"] = row["speedup"] >= row["target_speedup"]
    row["checks"] = checks


# -- the run ---------------------------------------------------------------------------

def _child(case, mode, args) -> dict:
    """``bench_case`` in a fresh process (``--in-process``, one case and
    mode), with empty Inductor and Triton caches unless ``--warm-cache``."""
    name, size, batch, dt = case
    argv = ["--in-process", "--only", name, "--modes", mode, "--runs", str(args.runs), "--warmup", str(args.warmup),
            "--backend", args.backend]
    argv += [f for f, on in (("--tiny", args.tiny), ("--cudnn-benchmark", args.cudnn_benchmark)) if on]
    argv += ["--profile", str(args.profile)] if args.profile else []
    with tempfile.TemporaryDirectory(prefix="bench-compile-", ignore_cleanup_errors=True) as tmp:
        env = {} if args.warm_cache else {"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
                                          "TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
        rows, error = child_rows("bench.compile", argv, env, args.child_timeout)
    if rows:
        (row,) = rows
        row["cache"] = "warm" if args.warm_cache else "cold"
        return row
    row = {"name": f"{name} {size_name(size)} b{batch} {dt or ''} {mode}".replace("  ", " "), "case": name,
           "mode": mode, "backend": args.backend, "baseline": BASELINE, "error": error}
    _derive(row)
    return row


def _write(rows, args, extra):
    out = args.out
    if out and out.endswith(".json"):
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**env_info(), **extra, "rows": rows}, indent=1) + "\n")
        return path
    return write_results(args.name, rows, extra, out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=[c[0] for c in CASES], default=None)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated torch.compile modes (default {','.join(MODES)})")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (the mode only goes to inductor)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (the tests)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results) or a .json file")
    ap.add_argument("--name", default="compile", help="result file stem (in a results folder)")
    ap.add_argument("--in-process", action="store_true",
                    help="every case and mode in this process (default: a fresh process each, cold caches)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="the children keep the user's Inductor and Triton caches (default: empty ones)")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds a child may run")
    ap.add_argument("--cudnn-benchmark", action="store_true",
                    help="torch.backends.cudnn.benchmark on for every variant (the stronger eager baseline)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile one call of the compiled patched and the patched eager model: their N "
                         "largest GPU kernels and the sum of all (on the CPU: top-level ops)")
    ap.add_argument("--row-out", default=None, help=argparse.SUPPRESS)  # a child's rows
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {MODES}")
    cases = [c for c in (TINY if args.tiny else CASES) if not args.only or c[0] in args.only]
    device = bench_device()
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    rows = []
    extra = {"modes": modes, "backend": args.backend, "isolated": not args.in_process,
             "cache": "warm" if args.warm_cache or args.in_process else "cold",
             "cudnn_benchmark": args.cudnn_benchmark}
    for case in cases:
        for mode in modes:
            if args.in_process:
                row = bench_case(*case, mode, args.runs, args.warmup, args.tiny, device, args.backend, args.profile)
                torch._dynamo.reset()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            else:
                row = _child(case, mode, args)
            rows.append(row)
            if args.row_out:
                continue
            print(f"{row['name']}: " + ", ".join(
                f"{k} {row[k]:.4g}" for k in ("baseline_ms", "ours_ms", "patched_eager_ms", "speedup", "compile_s",
                                               "baseline_compile_s") if isinstance(row.get(k), float))
                  + (f"; ERROR {row['error'][:300]}" if "error" in row else ""), flush=True)
            _write(rows, args, extra)
    if args.row_out:
        Path(args.row_out).write_text(json.dumps(rows) + "\n")
        return rows
    path = _write(rows, args, extra)
    print_table([{**r, "error": (r.get("error") or "")[:60]} for r in rows], TABLE)
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
