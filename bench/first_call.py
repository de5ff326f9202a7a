"""The first call of a zoo model in a fresh process, unpatched against
patched, with a cold kernel cache and a warm one (issue 46's cold start).

    python -m bench.first_call [--set quick|full|untuned] [--only NAME ...] [--tiny] [--out DIR] [--child-timeout S]

Per zoo case three fresh processes, each timing one first call from the
model built on the device to its finished output (synchronised): the
unpatched model (``baseline_s``); the patched one with an empty Triton cache
(``cold_s``: conv-patch's kernels compile in it); the patched one again with
the cache the cold process left (``warm_s``: what a user's second session
pays). Each process also times the model's second call (``*_second_s``).
Rows carry ``first_call_s`` (the cold one), ``cold_over_s`` / ``warm_over_s``
(over the unpatched first call) and ``checks``: the issue's bars, cold at
most 5 s and warm at most 1 s over the unpatched first call. ``--ahead``
adds a fourth process, patched with an empty cache again, whose first call
is ``conv_patch.warmup(model, *args, calls=1)`` (its kernels compiled ahead
side by side; ``ahead_s``, ``ahead_compile_s``: the compiling pass alone). A child that
dies or passes ``--child-timeout`` leaves the row's ``error``. ``--tiny``
runs the zoo's tiny configs on the CPU (the tests).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import conv_patch

from . import zoo
from .common import bench_device, child_rows, print_table, sync, write_results

BASELINE = "unpatched first call, fresh process"
# The bars: seconds over the unpatched first call.
COLD_OVER_S, WARM_OVER_S = 5.0, 1.0
VARIANTS = ("unpatched", "cold", "warm", "ahead")
TABLE = ["name", "baseline_s", "cold_s", "warm_s", "ahead_s", "cold_over_s", "warm_over_s", "error"]


def first_calls(name, size, batch, dtype_name, patched: bool, tiny: bool, device, ahead: bool = False) -> dict:
    """This process's first and second call of one zoo case (patched or not;
    ``ahead``: the first call made by ``conv_patch.warmup``)."""
    fields, model, inputs = zoo.load_case(name, size, batch, dtype_name, tiny, device, n_inputs=1)
    (args, kw), = inputs
    if patched:
        conv_patch.apply(model)
    times, extra = [], {}
    with torch.inference_mode():
        for i in range(2):
            sync()
            t0 = time.perf_counter()
            if ahead and i == 0:
                extra["compile_s"] = conv_patch.warmup(model, *args, calls=1, **kw).compile_ahead_s
            else:
                model(*args, **kw)
            sync()
            times.append(time.perf_counter() - t0)
    return {**fields, "first_s": times[0], "second_s": times[1], **extra}


def _row(case, args) -> dict:
    name, size, batch, dt = case
    argv = ["--child", "--only", name, "--size", json.dumps(size), "--batch", str(batch), "--dtype", dt or ""]
    argv += ["--tiny"] if args.tiny else []
    row, errors = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-first-call-", ignore_cleanup_errors=True) as tmp:
        env = {"TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
        for variant in VARIANTS:
            if variant == "ahead":
                if not args.ahead:
                    continue
                env = {"TRITON_CACHE_DIR": str(Path(tmp) / "triton-ahead")}
            rows, error = child_rows("bench.first_call", argv + ["--variant", variant], env, args.child_timeout)
            if error:
                errors.append(f"{variant}: {error}")
                continue
            (got,), key = rows, ("baseline" if variant == "unpatched" else variant)
            row.update({k: v for k, v in got.items() if k in ("name", "model", "size", "batch", "dtype")})
            row[f"{key}_s"], row[f"{key}_second_s"] = got["first_s"], got["second_s"]
            if "compile_s" in got:
                row[f"{key}_compile_s"] = got["compile_s"]
    row.setdefault("name", f"{name} {zoo.size_name(size)} b{batch} {dt or ''}".strip())
    row["baseline"] = BASELINE
    if errors:
        row["error"] = "; ".join(errors)
    if "baseline_s" in row and "cold_s" in row:
        row["first_call_s"] = row["cold_s"]
        row["cold_over_s"] = row["cold_s"] - row["baseline_s"]
        row["checks"] = {"cold_within_5s": row["cold_over_s"] <= COLD_OVER_S}
        if "warm_s" in row:
            row["warm_over_s"] = row["warm_s"] - row["baseline_s"]
            row["checks"]["warm_within_1s"] = row["warm_over_s"] <= WARM_OVER_S
        if "ahead_s" in row:
            row["ahead_over_s"] = row["ahead_s"] - row["baseline_s"]
    return row


def _child_main(args) -> None:
    size = json.loads(args.size)
    size = tuple(size) if isinstance(size, list) else size
    row = first_calls(args.only[0], size, args.batch, args.dtype or None, args.variant != "unpatched", args.tiny,
                      bench_device(), ahead=args.variant == "ahead")
    Path(args.row_out).write_text(json.dumps([row]) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    zoo.case_args(ap, "first-call")
    ap.add_argument("--set", choices=("quick", "full", "untuned"), default="quick")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds a child may run")
    ap.add_argument("--ahead", action="store_true", help="also a cold first call made by conv_patch.warmup")
    # A child's own arguments (one case, one variant).
    for flag, kw in (("--child", {"action": "store_true"}), ("--variant", {"choices": VARIANTS}),
                     ("--size", {}), ("--batch", {"type": int}), ("--dtype", {}), ("--row-out", {})):
        ap.add_argument(flag, help=argparse.SUPPRESS, **kw)
    args = ap.parse_args(argv)
    if args.child:
        return _child_main(args)
    cases = zoo.selected(zoo.TINY if args.tiny else {"quick": zoo.QUICK, "full": zoo.FULL,
                                                       "untuned": zoo.UNTUNED}[args.set], args.only)
    rows, path = [], None
    for case in cases:
        rows.append(_row(case, args))
        r = rows[-1]
        print(f"{r['name']}: " + ", ".join(f"{k} {r[k]:.3g}" for k in TABLE[1:-1] if isinstance(r.get(k), float))
              + (f"; ERROR {r['error'][:200]}" if "error" in r else ""), flush=True)
        path = write_results(args.name, rows, {"set": "tiny" if args.tiny else args.set}, args.out)
    print_table(rows, TABLE)
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
