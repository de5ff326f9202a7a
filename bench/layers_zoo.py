"""Every distinct convolution of the zoo's models without a big-VAE recipe
(UNets, ControlNet, tiny decoders, upscalers, the architectures nobody tuned
for), traced off the models: one
row per (conv, input shape, layout, dtype), conv-patch against cuDNN.

    python -m bench.layers_zoo [--only M ...] [--layouts nchw nhwc] [--dtype fp16]
                               [--cudnn-benchmark] [--sweep [--write-table T]] [--table T] [--tiny]

Default (launched): each conv as an ``nn.Conv2d`` module, unpatched against
patched with ``conv_patch.apply`` (the route the decision takes for it as
called, pack refresh and host time included), timed as a model runs its
convs: back-to-back calls launched eagerly, wall time from a synchronised
GPU to the last call's finished output divided by the calls, the two sides
alternated over several rounds, medians. Rows: name, baseline ("cuDNN,
launched"), baseline_ms, ours_ms, speedup, route, calls (how often one
forward of the model runs it), rel_err_vs_fp32 (both sides). Convs that
only the block recipes run (a folded pad, an upsample's 2x2 parity convs)
are not modules: they appear in ``--sweep`` only.

``--sweep``: every tuner candidate of every kernel route on each conv and
layout (``tools.tune.measure``: checked against exact fp32, GPU-timed),
cuDNN beside them; a row per job with each route's best. ``--write-table
T`` merges the measured shapes into table ``T`` as exact entries
(``tune.build_table(..., exact_only=True)``: its buckets stay) and writes
the result under the results folder.
"""

import argparse
import copy
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

import conv_patch
from conv_patch.routing.registry import BY_ROUTE, Route
from conv_patch.runtime.state import state_of
from conv_patch.specs import ConvSpec
from conv_patch.target import target_for
from conv_patch.tools import tune
from conv_patch.tools.model_shapes import ConvCall, trace_convs

from . import zoo
from .common import bench_device, print_table, rotated, write_results

# (model, image size, batch): the zoo rows whose convs run without a big-VAE recipe.
CASES = [("sd15-unet", 512, 2), ("sdxl-unet", 1024, 1), ("controlnet", 512, 2), ("rrdb-x4", 256, 1),
         ("autoencoder-tiny", 512, 1), ("autoencoder-tiny", 256, 1), ("taef2", 512, 1), ("taef2", 256, 1),
         ("sdxl-unet", 1024, 2),
         # The zoo's architectures nobody tuned for (zoo.UNTUNED; SVD's temporal decoder does not run on
         # the meta device the convs are traced on: its 2-D convs are the SD VAE decoder's).
         ("dc-ae-decode", 1024, 1), ("ddpm-unet", 256, 1), ("movq-decode", 512, 1), ("asym-vae-decode", 512, 1),
         ("srvgg-x4", 256, 1)]
TINY_CASES = [("sd15-unet", 16, 1), ("rrdb-x4", 8, 1)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# The kernel routes a sweep measures (the others' problems exclude UNet shapes or they never win there).
SWEEP_ROUTES = (Route.CONV2D_TMA, Route.CONV2D_TMA_PADDED, Route.CONV2D_IM2COL, Route.CONV2D_IGEMM, Route.CONV2D_TAPS,
                Route.CONV2D_FLAT)


def _meta_model(name, tiny):
    """The zoo model ``name`` on the meta device (no weights) and its input maker."""
    if name == "taef2":
        from conv_patch.tools import taesd
        with torch.device("meta"):
            return taesd.decoder(32, channels=8 if tiny else 64), zoo.image_inputs(32, 8)
    with torch.device("meta"):
        return zoo.MODELS[name][0](tiny)


def distinct_convs(cases, tiny=False):
    """[(ConvCall, calls per forward)], each distinct (conv without its bias,
    input shape) once, labelled by the first case that runs it."""
    import dataclasses
    seen, counts = {}, Counter()
    for name, size, batch in cases:
        model, make = _meta_model(name, tiny)
        args, kw = make(size, batch, None, "meta", torch.float32)
        traced = trace_convs(model, lambda m: m(*args, **kw))
        for (spec, shape), n in traced.items():
            if spec.transposed:
                continue
            key = (dataclasses.replace(spec, has_bias=False), shape)
            seen.setdefault(key, ConvCall(spec, shape, f"{name} {size} b{batch}"))
            counts[key] += n
    return [(c, counts[k]) for k, c in seen.items()]


def module_of(spec: ConvSpec):
    """An ``nn.Conv2d`` of ``spec``, or None where no module has it (a pad
    folded into the conv: only the recipes run that)."""
    if spec.pad_begin != spec.pad_end:
        return None
    return nn.Conv2d(spec.in_channels, spec.out_channels, spec.kernel, spec.stride, spec.pad_begin,
                     spec.dilation, bias=spec.has_bias)


def back_to_back_ms(fn, calls):
    """Wall ms per call of ``calls`` back-to-back calls, from a synchronised
    GPU to the last one's finished output."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / calls


def launched_row(call, count, layout, dtype, device, rounds, min_ms, config=None):
    spec, shape = call.spec, call.shape
    conv = module_of(spec)
    if conv is None:
        return None
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        k = spec.kernel
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * (spec.in_channels * k[0] * k[1]) ** -0.5)
        if conv.bias is not None:
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.1)
    base = conv.to(device, dtype).to(memory_format=fmt).eval()
    net = nn.Sequential(copy.deepcopy(base))
    conv_patch.apply(net, config=config)
    ours = net[0]
    x = torch.randn(shape, generator=g).to(device, dtype).contiguous(memory_format=fmt)
    with torch.no_grad():
        ref = spec.torch_conv2d(x.double(), base.weight.double(),
                                None if base.bias is None else base.bias.double())
        errs = [((f(x).double() - ref).norm() / ref.norm()).item() for f in (base, ours)]
        fns = [lambda: base(x), lambda: ours(x)]
        for f in fns:
            for _ in range(3):
                f()
        one = back_to_back_ms(fns[0], 3)
        calls = max(5, min(200, int(min_ms / max(one, 1e-3))))
        samples = [[], []]
        for r in range(rounds):
            for i in rotated(2, r):
                samples[i].append(back_to_back_ms(fns[i], calls))
    base_ms, ours_ms = (statistics.median(s) for s in samples)
    last = state_of(ours).last
    return {"name": f"{call.where} {call.describe()} {layout} {tune.config_tables.dtype_name(dtype)}",
            "baseline": "cuDNN, launched", "baseline_ms": base_ms, "ours_ms": ours_ms, "speedup": base_ms / ours_ms,
            "route": last.label() if last is not None else None, "calls": count,
            "rel_err_vs_fp32": errs[1], "baseline_rel_err_vs_fp32": errs[0], "layout": layout,
            "timing": f"launched, {calls} back-to-back calls a sample, {rounds} rounds alternated"}


def sweep_row(m, count):
    by_route = {}
    for lab, ms in m.times.items():
        r = tune.config_tables.route_of(m.configs[lab])
        if r not in by_route or ms < m.times[by_route[r]]:
            by_route[r] = lab
    best = m.best
    return {"name": f"{m.call.where} {m.call.describe()} {m.layout}", "key": m.key, "calls": count,
            "baseline": "cuDNN (GPU time)", "baseline_ms": m.cudnn_ms,
            "ours_ms": m.times[best] if best else None, "best": best,
            "speedup": (m.cudnn_ms / m.times[best]) if best and m.cudnn_ms else None,
            "best_by_route": {r: {"label": lab, "ms": m.times[lab]} for r, lab in by_route.items()},
            "times": m.times, "rejected": m.rejected}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", default=None, help="only these zoo models")
    ap.add_argument("--layouts", nargs="+", default=["nchw", "nhwc"], choices=["nchw", "nhwc"])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-ms", type=float, default=5.0, help="a sample's length (back-to-back calls)")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    ap.add_argument("--sweep", action="store_true", help="every tuner candidate against cuDNN, GPU time")
    ap.add_argument("--write-table", default=None, metavar="T", help="with --sweep: merge into table T")
    ap.add_argument("--limit", type=int, default=None, help="only the first N distinct convs")
    ap.add_argument("--folded", action="store_true",
                    help="with --sweep: the recipes' folded convs too (pads folded in, upsample parities)")
    ap.add_argument("--routes", nargs="+", default=None, metavar="R",
                    help="with --sweep: only these table routes' candidates")
    ap.add_argument("--kernel", type=int, default=None, metavar="K", help="with --sweep: only the KxK convs")
    ap.add_argument("--stride", type=int, default=None, metavar="S", help="with --sweep: only the stride-S convs")
    ap.add_argument("--graph", action="store_true",
                    help="with --sweep: time CUDA-graph replays (GPU time without the host's)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="stop starting new convs after S seconds (the rows so far are kept)")
    ap.add_argument("--table", default=None, metavar="T",
                    help="launched: patch with config table T (PatchConfig(table=T)) instead of the GPU's own")
    ap.add_argument("--tiny", action="store_true", help="tiny models (the logic's test on the CPU)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device = bench_device()
    dtype = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
    cases = [c for c in (TINY_CASES if args.tiny else CASES) if args.only is None or c[0] in args.only]
    convs = distinct_convs(cases, args.tiny)[:args.limit]
    meta = {"dtype": tune.config_tables.dtype_name(dtype), "cases": [list(c) for c in cases],
            "cudnn_benchmark": args.cudnn_benchmark}
    rows = []
    if args.sweep:
        target = target_for(device)
        names = set(args.routes) if args.routes else {BY_ROUTE[r].table for r in SWEEP_ROUTES}
        cands = [c for c in tune.candidates(target) if tune.config_tables.route_of(c) in names]
        if not args.folded:
            convs = [(c, n) for c, n in convs if module_of(c.spec) is not None]
        if args.kernel:
            convs = [(c, n) for c, n in convs if c.spec.kernel == (args.kernel, args.kernel)]
        if args.stride:
            convs = [(c, n) for c, n in convs if c.spec.stride == (args.stride, args.stride)]
        counts = {id(c): n for c, n in convs}

        def landed(m):
            rows.append(sweep_row(m, counts[id(m.call)]))
            write_results("layers-zoo-sweep", rows, meta, args.out)
            r = rows[-1]
            print(f"{r['name']}: cudnn {r['baseline_ms']} best {r['best']} {r['ours_ms']}", flush=True)
        ms = tune.tune([c for c, _ in convs], args.layouts, dtype, device, target, cands,
                       time_limit_s=args.time_limit, on_measure=landed, graph=args.graph)
        meta["graph"] = args.graph
        if args.write_table:
            base = json.loads(Path(args.write_table).read_text())
            note = (f"bench.layers_zoo --sweep on {target.arch}: {len(ms)} convs of "
                    f"{', '.join(sorted({c[0] for c in cases}))}, {meta['dtype']}"
                    + (", CUDA-graph replays (GPU time)" if args.graph else ""))
            table = tune.build_table(ms, base.get("arch", target.arch), dtype, note, base, exact_only=True)
            out = Path(args.out or "bench/results") / Path(args.write_table).name
            tune.write_table(table, out)
            print("wrote table", out)
        path = write_results("layers-zoo-sweep", rows, meta, args.out)
        print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "best"])
    else:
        config = conv_patch.PatchConfig(table=args.table) if args.table else None
        meta["table"] = args.table
        t0 = time.perf_counter()
        for call, count in convs:
            if args.time_limit and time.perf_counter() - t0 > args.time_limit:
                print(f"time limit: {len(rows)} rows timed, the rest left", flush=True)
                break
            for layout in args.layouts:
                r = launched_row(call, count, layout, dtype, device, args.rounds, args.min_ms, config)
                if r is None:
                    continue
                rows.append(r)
                write_results("layers-zoo", rows, meta, args.out)
                print(f"{r['name']}: cudnn {r['baseline_ms']:.4f} ours {r['ours_ms']:.4f} x{r['speedup']:.2f} "
                      f"{r['route']}", flush=True)
        sp = [r["speedup"] for r in rows]
        meta["summary"] = {"rows": len(rows), "geomean_speedup": tune.geomean(sp), "min_speedup": min(sp),
                           "below_1": sum(s < 1.0 for s in sp)}
        path = write_results("layers-zoo", rows, meta, args.out)
        print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "route"])
        print(meta["summary"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
