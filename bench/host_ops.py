"""Where a host-bound model's host time goes: per model call, the PyTorch
ops, CUDA runtime calls and kernel launches of the unpatched and the patched
model side by side, and the Python functions that differ most.

    python -m bench.host_ops [--only NAME ...] [--calls 5] [--tiny]

Per zoo case (``bench.zoo``'s host-bound rows by default) one row: for each
op or runtime call (``aten::conv2d``, ``cudaLaunchKernel``,
``cuLaunchKernelEx``, ``cudaMemGetInfo``, ...) its count and self CPU time
per model call in both models (``torch.profiler``, which slows every op by
about the same amount: compare counts first, times between the two sides),
the Python functions whose own time differs most (cProfile), and the plain
host time per call without a profiler (median of calls alternating between
the two models; the time until the call returns, before its GPU work is
waited for). Counts are exact; the times are indications.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats

import torch

import conv_patch

from . import zoo
from .common import bench_device, sync, write_results

HOST_BOUND = [("sd15-unet", 512, 2, None), ("controlnet", 512, 2, None), ("rrdb-x4", 256, 1, None),
              ("autoencoder-tiny", 512, 1, None), ("taef2", 256, 1, None), ("taef2", 512, 1, None),
              ("flux-vae-decode", 512, 1, None)]
TINY = [("taef2", 16, 1, "fp32"), ("sd15-unet", 16, 1, "fp32")]


def op_table(fn, calls: int) -> dict:
    """name -> [count, self CPU us] per call of ``fn`` under torch.profiler."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        sync()
    out = {}
    for e in prof.key_averages():
        out[e.key] = [e.count / calls, e.self_cpu_time_total / calls]
    return out


def function_table(fn, calls: int) -> dict:
    """'file:line(name)' -> [calls, own seconds * 1e6] per call of ``fn``."""
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    out = {}
    for (path, line, name), (cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items():
        short = "/".join(path.split("/")[-2:])
        out[f"{short}:{line}({name})"] = [nc / calls, tt * 1e6 / calls]
    return out


def diff(a: dict, b: dict, top: int) -> list:
    """The ``top`` entries by |time difference|, then any whose count differs."""
    rows = []
    for k in set(a) | set(b):
        ca, ta = a.get(k, [0, 0.0])
        cb, tb = b.get(k, [0, 0.0])
        rows.append({"name": k, "unpatched_n": ca, "patched_n": cb, "unpatched_us": ta, "patched_us": tb,
                     "delta_us": tb - ta})
    by_time = sorted(rows, key=lambda r: -abs(r["delta_us"]))[:top]
    seen = {r["name"] for r in by_time}
    by_count = [r for r in rows if r["name"] not in seen and abs(r["patched_n"] - r["unpatched_n"]) >= 1]
    return by_time + sorted(by_count, key=lambda r: -abs(r["patched_n"] - r["unpatched_n"]))[:top]


def case_row(name, size, batch, dtype_name, calls, tiny, device, top=25) -> dict:
    fields, model, ((args, kw),) = zoo.load_case(name, size, batch, dtype_name, tiny, device, n_inputs=1)
    patched = copy.deepcopy(model)
    conv_patch.apply(patched)
    fns = {"unpatched": lambda: model(*args, **kw), "patched": lambda: patched(*args, **kw)}
    with torch.inference_mode():
        for _ in range(3):
            for f in fns.values():
                f()
        sync()
        # Interleaved (A B, B A, ...): a slow stretch of the host hits both.
        host = {k: v["host_ms"] for k, v in zoo.interleaved(fns, max(calls, 9), 0).items()}
        ops = {k: op_table(f, calls) for k, f in fns.items()}
        funcs = {k: function_table(f, calls) for k, f in fns.items()}
    total = {k: {"ops": sum(n for kk, (n, _) in v.items() if kk.startswith("aten::")),
                 "launches": sum(n for kk, (n, _) in v.items() if kk in ("cudaLaunchKernel", "cuLaunchKernelEx",
                                                                       "cuLaunchKernel", "cudaLaunchKernelExC")),
                 "python_calls": sum(n for n, _ in funcs[k].values())} for k, v in ops.items()}
    row = {"name": fields["name"],
           "baseline": "unpatched, host time per call (GPU work not waited for)",
           "baseline_ms": host["unpatched"], "ours_ms": host["patched"],
           "speedup": host["unpatched"] / host["patched"],
           "host_ms": host, "totals": total, "routes": zoo.route_counts(patched),
           "ops": diff(ops["unpatched"], ops["patched"], top),
           "functions": diff(funcs["unpatched"], funcs["patched"], top)}
    del model, patched
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5)
    zoo.case_args(ap, "host-ops")
    args = ap.parse_args(argv)
    device = bench_device()
    cases = zoo.selected(TINY if args.tiny else HOST_BOUND, args.only)
    rows = []
    for case in cases:
        row = case_row(*case, args.calls, args.tiny, device)
        rows.append(row)
        t, h = row["totals"], row["host_ms"]
        print(f"{row['name']}: host {h['unpatched']:.2f} -> {h['patched']:.2f} ms; aten ops "
              f"{t['unpatched']['ops']:.0f} -> {t['patched']['ops']:.0f}; launches {t['unpatched']['launches']:.0f}"
              f" -> {t['patched']['launches']:.0f}; python calls {t['unpatched']['python_calls']:.0f} -> "
              f"{t['patched']['python_calls']:.0f}; routes {row['routes']}", flush=True)
        for r in row["ops"][:12]:
            print(f"    {r['name'][:48]:48s} n {r['unpatched_n']:7.1f} -> {r['patched_n']:7.1f}   "
                  f"us {r['unpatched_us']:9.1f} -> {r['patched_us']:9.1f}", flush=True)
    path = write_results(args.name, rows, {}, args.out)
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
