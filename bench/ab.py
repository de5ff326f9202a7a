"""A decision rule against its alternative, on whole zoo models: each
variant is the model patched with one rule changed for its calls, launched
eagerly and interleaved with the unpatched model and the default patched
one in one process (``zoo.interleaved``: rotated order, medians after
warm-up).

    python -m bench.ab --only srvgg-x4 taef2 --variants own-dense-blocks size-only-group-norm
                       [--table T] [--packaged-table T] [--graphs] [--sizes 256 512] [--batch 1] [--runs 41]
                       [--tiny] [--out DIR]

A variant (``VARIANTS``) changes a rule the routing or the recipes read at
call time, set around its own calls only, so that the other models in the
rounds keep the default: ``own-dense-blocks`` runs the upscalers' dense
blocks and RRDBs as their own forward launched eagerly (their rule before
the NHWC buffers), ``own-rrdbs`` the RRDBs alone,
``size-only-group-norm`` sends GroupNorms of few long rows back to PyTorch
below the size crossover (``costs.GROUP_NORM_ROW_ELEMENTS`` past any size),
and ``triton-launcher`` replays the recorded launches through Triton's
Python launcher instead of its C launcher (``kernels/direct_launch.py``),
``full-path`` finds kernel plans by their full signature only
(``planner.KERNEL_SLOTS`` off: no ``plans.KernelSlot`` on the bare path),
``cudnn-grouped-convs`` leaves grouped convs to PyTorch (the DC-AE
recipe's ``proj_in`` and ``proj_out``), and ``no-auto-graphs`` runs the
blocks ``PatchConfig(cuda_graphs="auto")`` graphs eagerly (its bound set
to 0 bytes: each key is captured once, then dropped).
``--table T`` adds a variant patched with config table ``T``
(``PatchConfig(table=T)``) instead of the architecture's own: a user's
table, whose choice stands for the shapes it has not measured.
``--packaged-table T`` adds a variant reading ``T`` as the architecture's
own table (swapped in around its calls), weighed against PyTorch as the
packaged one is: a table's new entries against the packaged ones.
``--graphs`` patches every model with ``PatchConfig(cuda_graphs=True)``
(the graph path, where only GPU time counts).

One row per (model, size, variant): name, baseline ("conv-patch, default
rules"), baseline_ms, ours_ms (the variant), speedup (default over
variant: above 1 the variant is faster), unpatched_ms, the variant's and
the default's speedups over the unpatched model, host times and errors
against the unpatched output. Written as ``ab-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from pathlib import Path

import torch

import conv_patch
from conv_patch.kernels import direct_launch
from conv_patch.ops import grouped_conv
from conv_patch.recipes import esrgan
from conv_patch.routing import costs, tables
from conv_patch.runtime import graphs, pack, planner
from conv_patch.runtime.state import peek

from . import zoo
from .common import bench_device, print_table, write_results


@contextlib.contextmanager
def _swapped(owner, name, value):
    """``owner.name`` is ``value`` inside, its own value again after."""
    own = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, own)


@contextlib.contextmanager
def _triton_launcher():
    was = direct_launch.enable(False)
    try:
        yield
    finally:
        direct_launch.enable(was)


def _own_forward_eagerly(m, args, kwargs):
    """The upscalers' blocks' earlier rule: launched eagerly, off the graph
    path, the block's own forward (no swaps)."""
    if pack.GRAPH_PATH or torch.compiler.is_compiling():
        return None
    st = peek(m)
    return None if st is not None and st.graphs is not None else ()


@contextlib.contextmanager
def _own_upscaler_blocks(*recipes):
    with contextlib.ExitStack() as stack:
        for r in recipes:
            stack.enter_context(_swapped(r, "unfused", _own_forward_eagerly))
        yield


def _as_packaged(path):
    """Table ``path`` read as every architecture's packaged table inside."""
    held = _TABLES.get(path)
    if held is None:
        data = tables.validate_table(json.loads(Path(path).read_text()), path)
        held = _TABLES[path] = tables.Table(data, data.get("arch", "sm90"))
    own = tables.packaged_table
    return _swapped(tables, "packaged_table", lambda arch: own(arch) if arch == "default" else held)


_TABLES: dict = {}


VARIANTS = {
    "own-dense-blocks": (lambda: _own_upscaler_blocks(esrgan.RESIDUAL_DENSE, esrgan.RRDB_RECIPE),
                         "the upscalers' dense blocks and RRDBs run their own forward launched eagerly"),
    "own-rrdbs": (lambda: _own_upscaler_blocks(esrgan.RRDB_RECIPE),
                  "each RRDB its own forward launched eagerly, the dense blocks in it fused"),
    "size-only-group-norm": (lambda: _swapped(costs, "GROUP_NORM_ROW_ELEMENTS", 1 << 62),
                             "GroupNorm on the kernels from 4M elements only"),
    "triton-launcher": (_triton_launcher, "replays through Triton's Python launcher, not its C launcher directly"),
    "full-path": (lambda: _swapped(planner, "KERNEL_SLOTS", False),
                  "kernel plans found by the full signature only, not on the bare fast path"),
    "cudnn-grouped-convs": (lambda: _swapped(grouped_conv, "problem", lambda conv, x: "bench.ab: cuDNN's grouped conv"),
                            "grouped convs (DC-AE's proj_in and proj_out) on cuDNN"),
    "no-auto-graphs": (lambda: _swapped(graphs, "AUTO_POOL_BYTES", 0),
                       "cuda_graphs=\"auto\" keeps no graph (every capture over its bound): launched eagerly"),
}

# Default sizes of the models this benchmark was written for (else the zoo's first).
SIZES = {"srvgg-x4": (256,), "rrdb-x4": (256,), "rrdb-spandrel-x4": (256,), "taef2": (256, 512),
         "autoencoder-tiny": (512,)}


def _sizes(name):
    if name in SIZES:
        return SIZES[name]
    return tuple(sorted({s for n, s, _, _ in zoo.FULL + zoo.UNTUNED if n == name})[:1]) or (512,)


def _wrapped(model, args, kwargs, rule):
    def call():
        with rule():
            return model(*args, **kwargs)
    return call


def _meta(args) -> dict:
    return {"variants": args.variants, "table": args.table, "packaged_table": args.packaged_table,
            "graphs": args.graphs, "batch": args.batch}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(zoo.MODELS), required=True)
    ap.add_argument("--variants", nargs="*", choices=sorted(VARIANTS), default=[])
    ap.add_argument("--table", default=None, help="a config table to run as a variant")
    ap.add_argument("--packaged-table", default=None, help="a config table to run as a variant, read as the GPU's own")
    ap.add_argument("--graphs", action="store_true", help="patch with PatchConfig(cuda_graphs=True)")
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=41)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (the tests)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    if not args.variants and args.table is None and args.packaged_table is None:
        ap.error("name at least one variant, a --table or a --packaged-table")
    device = bench_device()
    rows = []
    for name in args.only:
        for size in (args.sizes or _sizes(name)):
            fields, model, inputs = zoo.load_case(name, 16 if args.tiny else size, args.batch, "fp32" if args.tiny else None,
                                                  args.tiny, device, 1)
            x, kw = inputs[0]
            graph_config = conv_patch.PatchConfig(cuda_graphs=True) if args.graphs else None
            default = copy.deepcopy(model)
            conv_patch.apply(default, config=graph_config)
            calls = {"unpatched": lambda: model(*x, **kw), "default": lambda: default(*x, **kw)}
            what = {}
            for v in args.variants:
                m = copy.deepcopy(model)
                conv_patch.apply(m, config=graph_config)
                calls[v] = _wrapped(m, x, kw, VARIANTS[v][0])
                what[v] = VARIANTS[v][1]
            if args.table is not None:
                m = copy.deepcopy(model)
                conv_patch.apply(m, config=conv_patch.PatchConfig(table=args.table, cuda_graphs=args.graphs or "auto"))
                calls["table"] = lambda m=m: m(*x, **kw)
                what["table"] = f"patched with the table {args.table}"
            if args.packaged_table is not None:
                m = copy.deepcopy(model)
                conv_patch.apply(m, config=graph_config)
                calls["packaged-table"] = _wrapped(m, x, kw, lambda: _as_packaged(args.packaged_table))
                what["packaged-table"] = f"patched with {args.packaged_table} as the GPU's own table"
            with torch.inference_mode():
                ref = zoo.output_tensor(calls["unpatched"]()).float()
                # Each model's error at its third call: the first calls may
                # run blocks as they are while the passthrough learns.
                for f in calls.values():
                    f(), f()
                errs = {k: ((zoo.output_tensor(f()).float() - ref).norm() / ref.norm()).item()
                        for k, f in calls.items() if k != "unpatched"}
                t = zoo.interleaved(calls, 2 if args.tiny else args.runs, 1 if args.tiny else args.warmup)
            base, dflt = t["unpatched"]["ms"], t["default"]["ms"]
            for v in what:
                ms = t[v]["ms"]
                rows.append({"name": f"{fields['name']} {v}", "variant": v, "what": what[v],
                             "baseline": "conv-patch, default rules", "baseline_ms": dflt, "ours_ms": ms,
                             "speedup": dflt / ms, "unpatched_ms": base, "variant_speedup": base / ms,
                             "default_speedup": base / dflt, "host_ms": t[v]["host_ms"],
                             "baseline_host_ms": t["default"]["host_ms"], "rel_err_vs_unpatched": errs[v],
                             "default_rel_err_vs_unpatched": errs["default"], "rounds": args.runs})
                print(f"{rows[-1]['name']}: unpatched {base:.3f} ms, default {dflt:.3f}, {v} {ms:.3f} "
                      f"(default/variant x{dflt / ms:.3f})", flush=True)
            write_results("ab", rows, _meta(args), args.out)
    path = write_results("ab", rows, _meta(args), args.out)
    print_table(rows, ["name", "unpatched_ms", "baseline_ms", "ours_ms", "speedup"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
