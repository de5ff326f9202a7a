"""Timing and result files shared by the benchmarks."""

import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def env_info():
    import triton
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def bench_device():
    """The GPU when there is one; else the CPU, where the kernels only run
    under the Triton interpreter and times mean nothing (how the tests drive
    the benchmarks' logic on tiny shapes)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def side_by_side_setup(ap, argv):
    """The options the side-by-side op benchmarks share (``--rounds``,
    ``--out``), parsed; plus the device and the dtype they time in: bf16 on
    a GPU, fp32 on the CPU (the interpreter, where only the logic is
    tested)."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    device = bench_device()
    return args, device, torch.bfloat16 if device.type == "cuda" else torch.float32


def time_ms(fn, warmup=25, rep=100):
    """Median of CUDA-event timings after warm-up, with the L2 flushed before
    each run (triton.testing.do_bench); one wall-clock run on the CPU."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def interleaved_ms(fns, rounds=3, **kw):
    """Time several variants A, B, ... in alternation and keep each one's
    median over the rounds, so drift of the card hits all of them alike."""
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            samples[i].append(time_ms(fn, **kw))
    return [statistics.median(s) for s in samples]


def write_results(name, rows, extra=None, out_dir=None):
    doc = {**env_info(), **(extra or {}), "rows": rows}
    out_dir = Path(out_dir or os.environ.get("BENCH_OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{doc['date'][:10]}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def print_table(rows, cols):
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
