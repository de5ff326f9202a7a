"""The first call of a zoo model in a fresh process, unpatched against
patched, with a cold kernel cache and a warm one (issue 46's cold start).

    python -m bench.first_call [--set quick|full|untuned] [--only NAME ...] [--off] [--tiny] [--out DIR]
                               [--child-timeout S]

Per zoo case three fresh processes, each timing one first call from the
model built on the device to its finished output (synchronised): the
unpatched model (``baseline_s``); the patched one with an empty Triton cache
(``cold_s``: conv-patch's kernels compile in it, ahead of the call where
``PatchConfig.compile_ahead`` can); the patched one again with the cache the
cold process left (``warm_s``: what a user's second session pays). Each
process also times the model's second and third calls (``*_second_s``,
``*_third_s``: a later call may still compile, a CUDA graph's capture at
the second, a call whose arguments differ). Rows carry
``first_call_s`` (the cold one), ``cold_over_s`` / ``warm_over_s`` (over the
unpatched first call) and ``checks``: the issue's bars, cold at most 5 s and
warm at most 1 s over the unpatched first call, and that the warm process
compiled nothing. Each patched process counts the kernels each of its three
calls compiled (``*_compiled``: new entries of Triton's cache holding a
kernel; a warm process that compiles missed the cache the cold one left)
and ``*_first_pass``: what compiling ahead did at its first call, or why
it made no pass (``conv_patch.last_pass``, per module that had one).
``--off`` adds two processes patched with ``PatchConfig(compile_ahead=False)``: one on the warm
cache (``warm_off_s``: what the pass costs where there is nothing left to
compile) and one on an empty cache again (``off_s``: the kernels compiled
one after another as the call reaches them). A child that dies or passes ``--child-timeout`` leaves the
row's ``error``. ``--tiny`` runs the zoo's tiny configs on the CPU (the
tests).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import conv_patch
from conv_patch.kernels import compile_workers

from . import zoo
from .common import bench_device, cached_kernels, child_rows, pass_records, print_table, sync, write_results

BASELINE = "unpatched first call, fresh process"
# The bars: seconds over the unpatched first call.
COLD_OVER_S, WARM_OVER_S = 5.0, 1.0
VARIANTS = ("unpatched", "cold", "warm", "warm_off", "off")
TABLE = ["name", "baseline_s", "cold_s", "warm_s", "warm_off_s", "off_s", "cold_over_s", "warm_over_s", "error"]


def first_calls(name, size, batch, dtype_name, patched: bool, tiny: bool, device, ahead: bool = True) -> dict:
    """This process's first three calls of one zoo case (patched or not;
    ``ahead``: ``PatchConfig.compile_ahead``)."""
    fields, model, inputs = zoo.load_case(name, size, batch, dtype_name, tiny, device, n_inputs=1)
    (args, kw), = inputs
    report = None
    if patched:
        report = conv_patch.apply(model, config=conv_patch.PatchConfig(compile_ahead=ahead))
    times, compiled = [], []
    with torch.inference_mode():
        for _ in range(3):
            before = cached_kernels()
            sync()
            t0 = time.perf_counter()
            model(*args, **kw)
            sync()
            times.append(time.perf_counter() - t0)
            compiled.append(len(cached_kernels() - before))
    extra = {} if report is None else {"compiled_ahead": bool(report.compile_ahead),
                                       "compile_processes": compile_workers.stats(),
                                       "first_pass": pass_records(model)}
    return {**fields, "first_s": times[0], "second_s": times[1], "third_s": times[2], "compiled": compiled, **extra}


def _row(case, args) -> dict:
    name, size, batch, dt = case
    argv = ["--child", "--only", name, "--size", json.dumps(size), "--batch", str(batch), "--dtype", dt or ""]
    argv += ["--tiny"] if args.tiny else []
    row, errors = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-first-call-", ignore_cleanup_errors=True) as tmp:
        env = {"TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
        for variant in VARIANTS:
            if variant in ("off", "warm_off") and not args.off:
                continue
            if variant == "off":
                env = {"TRITON_CACHE_DIR": str(Path(tmp) / "triton-off")}
            rows, error = child_rows("bench.first_call", argv + ["--variant", variant], env, args.child_timeout)
            if error:
                errors.append(f"{variant}: {error}")
                continue
            (got,), key = rows, ("baseline" if variant == "unpatched" else variant)
            row.update({k: v for k, v in got.items() if k in ("name", "model", "size", "batch", "dtype")})
            row[f"{key}_s"], row[f"{key}_second_s"] = got["first_s"], got["second_s"]
            row[f"{key}_third_s"] = got.get("third_s")
            if variant != "unpatched":
                row[f"{key}_compiled"] = got.get("compiled")
            if variant == "cold":
                row["compiled_ahead"] = got.get("compiled_ahead")
                # (Where the pass's compiles ran: kernels/compile_workers.py.)
                row["cold_compile_processes"] = got.get("compile_processes")
            if variant != "unpatched":
                row[f"{key}_first_pass"] = got.get("first_pass")
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
            # (A warm process that compiles missed the cold one's cache.)
            row["checks"]["warm_compiles_nothing"] = not sum(row.get("warm_compiled") or [])
        for k in ("off", "warm_off"):
            if f"{k}_s" in row:
                row[f"{k}_over_s"] = row[f"{k}_s"] - row["baseline_s"]
    return row


def _child_main(args) -> None:
    size = json.loads(args.size)
    size = tuple(size) if isinstance(size, list) else size
    row = first_calls(args.only[0], size, args.batch, args.dtype or None, args.variant != "unpatched", args.tiny,
                      bench_device(), ahead=args.variant not in ("off", "warm_off"))
    Path(args.row_out).write_text(json.dumps([row]) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    zoo.case_args(ap, "first-call")
    ap.add_argument("--set", choices=("quick", "full", "untuned"), default="quick")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds a child may run")
    ap.add_argument("--off", action="store_true",
                    help="also first calls with PatchConfig(compile_ahead=False), on the warm cache and a cold one")
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
