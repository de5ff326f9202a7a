"""A pass's compiles on this machine's CPU: the pass's threads alone against
the threads with worker processes (``kernels/compile_workers.py``); no GPU
needed.

    python -m bench.compile_pass [--kernels N] [--rounds R] [--workers W] [--tiny] [--out DIR]

Each round runs two fresh processes in turn (which goes first alternates),
each with an empty Triton cache: ``N`` distinct specialisations of the 2-D
implicit-GEMM kernel (``conv2d_fwd_kernel``: the dtypes, epilogues and tiles
a pass meets; ``--tiny``: the NCHW-to-NHWC copy's, seconds less each)
compiled for an sm90 target through the form of Triton's async compile, on
``W`` threads (the CPU count, at most 16, as a pass), all submitted at once;
one process with ``CONV_PATCH_COMPILE_PROCESSES=0``. Each times from the
pass's start (the workers' server started there, as ``launch.compile_ahead``
does) until every compile has returned. The row: medians over the rounds
(``baseline_ms`` the threads alone, ``ours_ms`` with workers), each round's
times, where the compiles ran (``compile_workers.stats``) and, from the
threads' process, each compile stage's median wall time (``stages_ms``:
Triton's frontend is ``ir_initialization``, Python under the GIL).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .common import child_rows, print_table, write_results

BASELINE = "the pass's threads alone"


def closures(n: int, tiny: bool) -> list:
    """``n`` closures of the form of Triton's async compile (the names
    ``compile_workers.CLOSURE``), each another specialisation."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import get_cache_invalidating_env_vars
    from conv_patch.kernels import conv2d, layout

    target = GPUTarget("cuda", 90, 64)
    env_vars = get_cache_invalidating_env_vars()
    compiler = type("JIT", (), {"compile": staticmethod(triton_compile)})()
    if tiny:
        fn = layout.nchw_to_nhwc_kernel
        sig = {"x_ptr": "*fp16", "y_ptr": "*fp16", "C": "i32", "HW": "i32", "sxn": "i32", "sxc": "i32",
               "BLOCK_C": "constexpr", "BLOCK_P": "constexpr"}
        variants = [{"BLOCK_C": c, "BLOCK_P": p} for p, c in itertools.product((32, 64, 128, 256), (16, 32, 64, 128))]
        warps = [4] * len(variants)
        dtypes = ["fp16"] * len(variants)
    else:
        fn = conv2d.conv2d_fwd_kernel
        sig = {}
        for p in fn.params:
            sig[p.name] = ("constexpr" if p.is_constexpr else "DT" if p.name.endswith("_ptr")
                           else "fp32" if p.name in ("beta", "out_scale") else "i32")
        combos = itertools.product(("fp16", "bf16"), ((64, 64, 32), (128, 64, 32), (128, 128, 64)),
                                   ((False, False, 0), (True, False, 2), (True, True, 0)))
        variants, warps, dtypes = [], [], []
        for dt, (bm, bn, bk), (bias, res, act) in combos:
            variants.append(dict(HAS_BIAS=bias, HAS_RES=res, ACT=act, IDX64=False, UPCAST=False,
                                 PRECISION="ieee", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8))
            warps.append(8 if bm * bn >= 128 * 128 else 4)
            dtypes.append(dt)
    out = []
    for consts, nw, dt in list(zip(variants, warps, dtypes))[:n]:
        signature = {k: (f"*{dt}" if v == "DT" else v) for k, v in sig.items()}
        out.append(_closure(compiler, ASTSource(fn, signature, consts, {}), target,
                            make_backend(target).parse_options({"num_warps": nw, "num_stages": 3}), env_vars))
    return out


def _closure(self, src, target, options, env_vars):
    def async_compile():
        return self.compile(src, target=target, options=options.__dict__, _env_vars=env_vars)
    return async_compile


def _child_main(args) -> None:
    from concurrent.futures import ThreadPoolExecutor
    from triton import knobs
    from conv_patch.kernels import compile_workers
    jobs = closures(args.kernels, args.tiny)
    stages = []  # (The compiles made in this process: each stage's wall time.)
    knobs.compilation.listener = lambda **kw: None if kw.get("cache_hit") else stages.append(kw.get("times"))
    t0 = time.perf_counter()
    procs = compile_workers.start(args.workers)
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        executor = pool if procs is None else compile_workers.Executor(pool, procs)
        for f in [executor.submit(c) for c in jobs]:
            f.result()
    seconds = time.perf_counter() - t0
    if procs is not None:
        procs.close()
    row = {"seconds": seconds, "kernels": len(jobs), "processes": procs is not None,
           "compile_processes": compile_workers.stats(), "stages_ms": _stage_medians(stages)}
    Path(args.row_out).write_text(json.dumps([row]) + "\n")


def _stage_medians(times) -> dict:
    """Each compile stage's median wall time (ms) over ``times`` (Triton's
    ``CompileTimes``: the frontend's ``ir_initialization``, then each
    lowering stage)."""
    per = {}
    for t in times:
        if t is None:
            continue
        per.setdefault("ir_initialization", []).append(t.ir_initialization / 1e3)
        for stage, us in t.lowering_stages:
            per.setdefault(stage, []).append(us / 1e3)
    return {k: statistics.median(v) for k, v in per.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--tiny", action="store_true", help="the NCHW-to-NHWC copy's specialisations (the tests)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="compile-pass-cpu")
    for flag, kw in (("--child", {"action": "store_true"}), ("--row-out", {"default": None})):
        ap.add_argument(flag, help=argparse.SUPPRESS, **kw)
    args = ap.parse_args(argv)
    if args.child:
        return _child_main(args)
    argv = ["--child", "--kernels", str(args.kernels), "--workers", str(args.workers)] + (["--tiny"] if args.tiny else [])
    times = {"threads": [], "workers": []}
    stats, stages, errors = None, None, []
    for r in range(args.rounds):
        order = ("threads", "workers") if r % 2 == 0 else ("workers", "threads")
        for variant in order:
            with tempfile.TemporaryDirectory(prefix="bench-compile-pass-", ignore_cleanup_errors=True) as tmp:
                env = {"TRITON_CACHE_DIR": tmp, "CONV_PATCH_COMPILE_PROCESSES": "1" if variant == "workers" else "0"}
                env["TRITON_INTERPRET"] = "0"
                rows, error = child_rows("bench.compile_pass", argv, env)
            if error:
                errors.append(f"{variant}: {error}")
                continue
            times[variant].append(rows[0]["seconds"])
            if variant == "workers":
                stats = rows[0]["compile_processes"]
            else:
                stages = rows[0]["stages_ms"]
    kind = "nchw_to_nhwc_kernel" if args.tiny else "conv2d_fwd_kernel"
    row = {"name": f"{kind} x{args.kernels} sm90, {args.workers} threads, cpu {os.cpu_count()}",
           "baseline": BASELINE, "rounds": args.rounds,
           "threads_s": times["threads"], "workers_s": times["workers"], "compile_processes": stats,
           "stages_ms": stages}
    if times["threads"] and times["workers"]:
        base, ours = statistics.median(times["threads"]), statistics.median(times["workers"])
        row.update(baseline_ms=base * 1e3, ours_ms=ours * 1e3, speedup=base / ours)
    if errors:
        row["error"] = "; ".join(errors)
    print_table([row], ["name", "baseline_ms", "ours_ms", "speedup", "error"])
    path = write_results(args.name, [row], {"python": sys.version.split()[0]}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
