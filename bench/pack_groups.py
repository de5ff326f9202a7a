"""Grouped weight-pack refreshes against one refresh per conv, per model.

    python -m bench.pack_groups [--only NAME ...] [--runs 30] [--tiny]

conv_patch/pack.py refreshes the packs a fused block's convs read in one
launch at the start of the block's call (``PackGroup``) where each conv used
to refresh its own (a launch and its host time per conv per call; cuDNN's
PyTorch route on an NHWC input copied each NCHW weight itself). Per zoo
case one row: the unpatched model (``baseline_ms``), the patched model
(``ours_ms``, grouped) and the same patched model with every pack refreshed
at its conv's call (``per_conv_ms``: the grouped path is switched off for
those calls, as inside a block that has no group), interleaved in one
process, wall-clock medians after warm-up, and the packs each call
refreshed both ways. Measured in one process because the H200's host speed
moves by tens of percent between processes.
"""

from __future__ import annotations

import argparse
import copy

import torch

import conv_patch
from conv_patch.runtime import pack

from . import zoo
from .common import bench_device, print_table, write_results

CASES = [("autoencoder-tiny", 512, 1, None), ("taef2", 256, 1, None), ("taef2", 512, 1, None),
         ("flux-vae-decode", 512, 1, None), ("flux-vae-decode", 1024, 1, None), ("sd-vae-decode", 512, 1, None)]
TINY = [("taef2", 16, 1, "fp32"), ("flux-vae-decode", 16, 1, "fp32")]

# Set as this thread's active group, it makes every fused block run without
# grouping (a block inside another's call does not group) and learns nothing.
OFF = pack.PackGroup()
OFF.broken = "bench.pack_groups: per-conv refreshes"


def per_conv(fn):
    def f():
        pack.ACTIVE.group, pack.ACTIVE.epoch = OFF, 0
        try:
            fn()
        finally:
            pack.ACTIVE.group = None
    return f


def refreshes(fn) -> tuple:
    before = dict(pack.stats())
    fn()
    after = pack.stats()
    return after["refreshes"] - before["refreshes"], after["group_refreshes"] - before["group_refreshes"]


def case_row(name, size, batch, dtype_name, runs, warmup, tiny, device) -> dict:
    fields, model, inputs = zoo.load_case(name, size, batch, dtype_name, tiny, device)
    patched = copy.deepcopy(model)
    conv_patch.apply(patched)
    state = {"i": 0}

    def call(m):
        def fn():
            args, kw = inputs[state["i"] % len(inputs)]
            m(*args, **kw)
            state["i"] += 1
        return fn

    variants = {"unpatched": call(model), "grouped": call(patched), "per_conv": per_conv(call(patched))}
    with torch.inference_mode():
        variants["grouped"]()  # compiles, builds the plans, learns the groups
        counts = {k: refreshes(variants[k]) for k in ("grouped", "per_conv")}
        res = zoo.interleaved(variants, runs, warmup)
    base = res["unpatched"]
    row = {
        **fields,
        "baseline": "unpatched, launched eagerly", "baseline_ms": base["ms"],
        "ours_ms": res["grouped"]["ms"], "speedup": base["ms"] / res["grouped"]["ms"],
        "per_conv_ms": res["per_conv"]["ms"], "per_conv_speedup": base["ms"] / res["per_conv"]["ms"],
        "host_ms": res["grouped"]["host_ms"], "per_conv_host_ms": res["per_conv"]["host_ms"],
        "baseline_host_ms": base["host_ms"],
        "refreshes_grouped": counts["grouped"][0], "group_launches": counts["grouped"][1],
        "refreshes_per_conv": counts["per_conv"][0], "runs": runs,
    }
    del model, patched
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    zoo.case_args(ap, "pack-groups")
    args = ap.parse_args(argv)
    device = bench_device()
    cases = zoo.selected(TINY if args.tiny else CASES, args.only)
    rows = [case_row(*c, args.runs, args.warmup, args.tiny, device) for c in cases]
    path = write_results(args.name, rows, None, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "per_conv_ms", "host_ms", "per_conv_host_ms",
                       "refreshes_per_conv", "group_launches"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
