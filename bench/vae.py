"""End-to-end VAE decode and encode: unpatched NCHW, unpatched channels_last,
conv-patch with convolutions only and conv-patch with its block recipes, side
by side in one process.

    python -m bench.vae [--models flux taef2] [--res 512 1024 2048] [--runs 20]

Models: the diffusers AutoencoderKL in the FLUX.1 configuration (seeded
random weights: speed does not depend on the values) and TAEF2 with its real
weights (``$CONV_PATCH_SHARED/models`` or ``../shared/models``; fp16, as
published). The patched model is the NCHW model after ``conv_patch.apply``
(what a user gets without converting anything): ``apply(m, recipes=False)``
for the convs-only column, ``apply(m)`` (block recipes on) for ours.
``--graph`` adds the patched model with ``PatchConfig(cuda_graphs=True)``
(``graphed_ms``: its decoder/encoder replayed from a CUDA graph per input
shape, the host's launch cost removed; the warm-up call captures) and the
memory all graphs captured so far keep (``graph_pools_gib``), with the graph
caches' captures, replays and eager calls so far (``graph_calls``). ``--table T``
adds the patched model with ``PatchConfig(table=T)`` (``table_ms``: an A/B
of two config tables, e.g. an earlier packaged one, on the same calls).
``--profile`` adds each
row's top GPU kernels of one patched call (torch
profiler) as ``profile``. Variants run interleaved
(A, B, C, A, B, C, ...) with ``--runs`` timed calls each after warm-up (which
includes the first call's kernel compilation), cycling through three
different inputs; the median is reported. Peak memory is that of a process
holding only the variant's model and the input: the allocator's high-water
mark during one call above what was allocated before it (the other variants'
models are on the GPU too), plus the model's parameters, buffers and weight
packs and the input. The calls run back to back by default, which on an
H200 can hold the GPU at its power cap with lowered clocks; ``--idle S``
rests it S seconds before each timed call (``idle_s``), ``--clocks``
samples its SM clock and power during each variant's calls (``clocks``:
per variant the median MHz and W and the fraction of samples at the power
cap).
Rows: name, baseline (eager NCHW), baseline_ms, ours_ms, speedup, peak_gib,
plus the channels_last and convs-only times and peaks.
"""

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch

import conv_patch

from .common import ClockSampler, bench_device, clock_stats, peak_gib, print_table, sync, write_results

SHARED = Path(os.environ.get("CONV_PATCH_SHARED") or Path(__file__).resolve().parents[2] / "shared")


def flux_vae(dtype):
    from diffusers import AutoencoderKL

    from conv_patch.tools.taesd import seeded_
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512], layers_per_block=2,
        use_quant_conv=False, use_post_quant_conv=False)
    seeded_(vae)
    vae = vae.to(bench_device(), dtype).eval()
    return (lambda m, z: m.decoder(z)), (lambda m, x: m.encoder(x)), vae, 16


def taef2(dtype):
    from safetensors.torch import load_file

    from conv_patch.tools import taesd
    enc, dec = taesd.encoder(32), taesd.decoder(32)
    enc.load_state_dict(load_file(str(SHARED / "models" / "taef2_encoder.safetensors")))
    dec.load_state_dict(load_file(str(SHARED / "models" / "taef2_decoder.safetensors")))
    pair = torch.nn.ModuleDict({"enc": enc, "dec": dec}).to(bench_device(), dtype).eval()
    return (lambda m, z: m["dec"](z)), (lambda m, x: m["enc"](x)), pair, 32


MODELS = {"flux": (flux_vae, torch.bfloat16), "taef2": (taef2, torch.float16)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time(fn, inputs, n):
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn(inputs[n % len(inputs)])
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(inputs[n % len(inputs)])
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _peak(fn, x, model):
    """``common.peak_gib`` of ``fn(x)``, the input counted."""
    return peak_gib(lambda: fn(x), model, x.numel() * x.element_size())


def _gib(v):
    return "n/a" if v is None else f"{v:.2f} GiB"


def _graph_pool_bytes() -> int:
    """GPU memory held by the private pools of the CUDA graphs captured so far
    (the graphed model's, every resolution and part up to this row)."""
    segs = torch.cuda.memory._snapshot()["segments"]
    return sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


def _graph_calls(model) -> dict:
    """Captures, replays and eager calls so far over the graphed model's
    graph caches (a capture that failed shows as eager calls)."""
    from conv_patch.runtime import graphs
    total = {"captures": 0, "replays": 0, "eager": 0}
    for m in model.modules():
        cache = graphs.cache_of(m)
        if cache is not None:
            for k in total:
                total[k] += cache.stats[k]
    return total


def bench_variants(variants, runs, warmup=3, idle=0.0, spans=None):
    """variants: name -> (fn, inputs in that variant's layout, its model or
    None when no peak is wanted). ``idle``: seconds the GPU rests before
    each timed call. ``spans`` (a dict), when given, receives each variant's
    [(start, end)] of time.time() over its timed calls."""
    times = {k: [] for k in variants}
    with torch.inference_mode():
        for i in range(warmup + runs):
            for k, (fn, xs, _) in variants.items():
                if idle and i >= warmup:
                    time.sleep(idle)
                t0 = time.time()
                t = _time(fn, xs, i)
                if i >= warmup:
                    times[k].append(t)
                    if spans is not None:
                        spans.setdefault(k, []).append((t0, time.time()))
        peaks = {k: _peak(fn, xs[0], m) for k, (fn, xs, m) in variants.items() if m is not None}
    return {k: statistics.median(v) for k, v in times.items()}, peaks


def profile_top(fn, top=15):
    """[name, calls, total ms] of the GPU kernels of one call, largest first
    (on the CPU, under the interpreter, the CPU ops instead)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.inference_mode(), profile(activities=acts) as prof:
        fn()
        sync()
    cuda = torch.cuda.is_available()
    evs = [e for e in prof.key_averages()
           if (e.device_type.name == "CUDA") == cuda and (cuda or e.cpu_parent is None)]
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    evs.sort(key=key, reverse=True)
    return [[e.key[:90], e.count, round(key(e) / 1000, 4)] for e in evs[:top]]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["flux", "taef2"])
    ap.add_argument("--res", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--parts", nargs="+", choices=["decode", "encode"], default=["decode", "encode"])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="override the model's dtype (bf16 for FLUX, fp16 for TAEF2)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--profile", action="store_true", help="record the top GPU kernels of one patched call")
    ap.add_argument("--table", default=None, metavar="T",
                    help="also time the model patched with this config table (table_ms)")
    ap.add_argument("--graph", action="store_true",
                    help="add the patched model with PatchConfig(cuda_graphs=True) as graphed_ms")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="seconds the GPU rests before each timed call (a single call on a cool GPU, "
                         "against the default back-to-back calls that can run it into its power cap)")
    ap.add_argument("--clocks", action="store_true",
                    help="sample SM clock and power (nvidia-smi) during each variant's calls: row 'clocks'")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    rows = []
    device = bench_device()
    for name in args.models:
        build, dtype = MODELS[name]
        dtype = DTYPES[args.dtype] if args.dtype else dtype
        decode, encode, model, latent = build(dtype)
        cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
        convs = copy.deepcopy(model)
        conv_patch.apply(convs, recipes=False)
        patched = copy.deepcopy(model)
        report = conv_patch.apply(patched)
        tabled = None
        if args.table:
            tabled = copy.deepcopy(model)
            conv_patch.apply(tabled, config=conv_patch.PatchConfig(table=args.table))
        graphed = None
        if args.graph:
            graphed = copy.deepcopy(model)
            conv_patch.apply(graphed, config=conv_patch.PatchConfig(cuda_graphs=True, max_graphs=len(args.res)))
        # The first patched call compiles every kernel the model needs (cold
        # when TRITON_CACHE_DIR is empty); no autotuning runs at any point.
        first = {}
        with torch.inference_mode():
            for part in args.parts:
                r0 = min(args.res)
                x0 = torch.randn((1, latent, r0 // 8, r0 // 8) if part == "decode" else (1, 3, r0, r0),
                                 device=device, dtype=dtype)
                t0 = time.perf_counter()
                (decode if part == "decode" else encode)(patched, x0)
                sync()
                first[part] = time.perf_counter() - t0
        print(name, "first patched call (compiles):", {k: round(v, 2) for k, v in first.items()}, "s", flush=True)
        for part in args.parts:
            run = decode if part == "decode" else encode
            for res in args.res:
                g = torch.Generator(device=device).manual_seed(res)
                shape = (1, latent, res // 8, res // 8) if part == "decode" else (1, 3, res, res)
                xs = [torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(3)]
                xs_cl = [x.contiguous(memory_format=torch.channels_last) for x in xs]
                extra = {}
                if graphed is not None:
                    extra["graphed"] = (lambda x, m=graphed, f=run: f(m, x), xs, None)
                if tabled is not None:
                    extra["table"] = (lambda x, m=tabled, f=run: f(m, x), xs, None)
                spans, sampler = {}, ClockSampler() if args.clocks else None
                try:
                    ms, peak = bench_variants({
                        "eager_nchw": (lambda x, m=model, f=run: f(m, x), xs, model),
                        "eager_channels_last": (lambda x, m=cl, f=run: f(m, x), xs_cl, cl),
                        "convs_only": (lambda x, m=convs, f=run: f(m, x), xs, convs),
                        "patched": (lambda x, m=patched, f=run: f(m, x), xs, patched),
                        **extra,
                    }, args.runs, args.warmup, args.idle, spans)
                except torch.cuda.OutOfMemoryError:
                    print(f"{name} {part} {res}: out of memory, skipped", flush=True)
                    continue
                finally:
                    samples = sampler.stop() if sampler is not None else []
                row = {
                    "name": f"{name} {part} {res}x{res}", "baseline": "eager nchw",
                    "baseline_ms": ms["eager_nchw"], "ours_ms": ms["patched"],
                    "speedup": ms["eager_nchw"] / ms["patched"], "peak_gib": peak["patched"],
                    "device": str(device),
                    "baseline_peak_gib": peak["eager_nchw"],
                    "channels_last_ms": ms["eager_channels_last"],
                    "channels_last_peak_gib": peak["eager_channels_last"],
                    "dtype": str(dtype).replace("torch.", ""), "runs": args.runs,
                    "first_call_s": first[part],
                    "convs_only_ms": ms["convs_only"], "convs_only_peak_gib": peak["convs_only"],
                    "idle_s": args.idle,
                }
                if args.clocks:
                    row["clocks"] = {k: clock_stats(samples, v) for k, v in spans.items()}
                if "table" in ms:
                    row["table_ms"], row["table"] = ms["table"], args.table
                if "graphed" in ms:
                    row["graphed_ms"] = ms["graphed"]
                    row["graph_calls"] = _graph_calls(graphed)
                    if torch.cuda.is_available():
                        row["graph_pools_gib"] = _graph_pool_bytes() / 2**30
                if args.profile:
                    row["profile"] = profile_top(lambda x=xs[0], m=patched, f=run: f(m, x))
                rows.append(row)
                write_results("vae", rows, {}, args.out)  # kept current: a cut-off run keeps its rows
                print(f"{row['name']}: eager {row['baseline_ms']:.2f} ms, channels_last "
                      f"{row['channels_last_ms']:.2f} ms, convs only {row['convs_only_ms']:.2f} ms, "
                      f"patched {row['ours_ms']:.2f} ms "
                      f"(x{row['speedup']:.2f}), peak {_gib(row['peak_gib'])}", flush=True)
        print(name, str(report).splitlines()[0], flush=True)
        del model, cl, convs, patched, graphed, tabled
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    path = write_results("vae", rows, {}, args.out)
    print_table(rows, ["name", "baseline_ms", "channels_last_ms", "convs_only_ms", "ours_ms", "graphed_ms",
                       "table_ms", "speedup", "peak_gib", "baseline_peak_gib"])
    print("wrote", path)


if __name__ == "__main__":
    main()
