"""The first call at each new shape of one zoo model, in one process: what a
user pays when the batch or the resolution changes (issue 46's cold start).

    python -m bench.new_shapes --model sd-vae-decode --shapes 512 512:2 832x1216 720 [--dtype fp16]
                               [--cold] [--tiny] [--out DIR] [--name NAME]

A shape is ``SIZE[:BATCH]``, SIZE ``512`` or ``HEIGHTxWIDTH``. The model is
built once and copied before patching; at each shape in turn the unpatched
copy makes its first call there (``baseline_ms``), then the patched one
(``ours_ms``, ``first_call_s``), each timed from the host to its finished
output. Every Triton compile in that patched call is counted (``compiles``,
``compiled_kernels``: Triton's post-compile hook, which also fires for a
kernel loaded from the disk cache into this process). The first shape's row
is the model's first call in the process; the later rows are what a new
batch or size costs once the first one ran. ``--cold`` points Triton at an
empty cache directory first (it must not be imported yet). ``--tiny`` runs
a tiny config on the CPU (the tests): no compiles there, times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch

from . import zoo
from .common import bench_device, launched_call, print_table, write_results

BASELINE = "unpatched, its first call at this shape"
TABLE = ["name", "baseline_ms", "ours_ms", "second_ms", "compiles"]


def parse_shape(text: str):
    """``512``, ``512:2``, ``832x1216:1`` -> (size, batch)."""
    size, _, batch = text.partition(":")
    h, _, w = size.partition("x")
    return ((int(h), int(w)) if w else int(h)), int(batch or 1)


class Compiles:
    """The Triton kernels compiled (or loaded) in this process since
    ``install``, by name."""

    def __init__(self):
        self.names = []

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # an older Triton: nothing counted
            return
        knobs.runtime.jit_post_compile_hook = lambda **kw: self.names.append(kw["fn"].name)


def run(model_name: str, shapes: list, dtype_name, tiny: bool, device) -> list:
    import conv_patch
    build, default_dtype = zoo.MODELS[model_name]
    dtype_label = dtype_name or default_dtype
    dtype = zoo.DTYPES[dtype_label]
    with torch.device(device):
        model, make = build(tiny)
    model = (zoo.seeded(model) if model_name != "taef2" or tiny else model).to(device, dtype).eval()
    unpatched = copy.deepcopy(model)
    conv_patch.apply(model)
    compiles = Compiles()
    if device.type == "cuda":
        compiles.install()
    rows, done = [], []
    with torch.inference_mode():
        for size, batch in shapes:
            (args, kw), = zoo.inputs_for(make, size, batch, device, dtype, n=1)
            base_ms = launched_call(lambda: unpatched(*args, **kw), device)[1]
            before = len(compiles.names)
            ours_ms = launched_call(lambda: model(*args, **kw), device)[1]
            new = compiles.names[before:]
            second_ms = launched_call(lambda: model(*args, **kw), device)[1]
            shape = f"{zoo.size_name(size)} b{batch}"
            rows.append({"name": f"{model_name} {shape} {dtype_label}", "model": model_name, "shape": shape,
                         "after": list(done), "baseline": BASELINE, "baseline_ms": base_ms, "ours_ms": ours_ms,
                         "speedup": base_ms / ours_ms, "first_call_s": ours_ms / 1e3, "second_ms": second_ms,
                         "compiles": len(new), "compiled_kernels": {k: new.count(k) for k in sorted(set(new))}})
            done.append(shape)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(zoo.MODELS), required=True)
    ap.add_argument("--shapes", nargs="+", required=True, help="SIZE[:BATCH], SIZE 512 or HEIGHTxWIDTH")
    ap.add_argument("--dtype", choices=sorted(zoo.DTYPES), default=None, help="default: the zoo's for the model")
    ap.add_argument("--cold", action="store_true", help="an empty Triton cache directory for this process")
    ap.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (the tests)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--name", default=None, help="result file stem (default new-shapes-<model>)")
    args = ap.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes]
    cache = None
    if args.cold:
        import sys
        if "triton" in sys.modules:
            raise SystemExit("--cold: Triton is imported already; its cache directory is fixed")
        cache = tempfile.TemporaryDirectory(prefix="bench-new-shapes-", ignore_cleanup_errors=True)
        os.environ["TRITON_CACHE_DIR"] = cache.name
    try:
        rows = run(args.model, shapes, args.dtype, args.tiny, bench_device())
    finally:
        if cache is not None:
            cache.cleanup()
    path = write_results(args.name or f"new-shapes-{args.model}", rows,
                         {"cache": "cold" if args.cold else "as found", "tiny": args.tiny}, args.out)
    print_table(rows, TABLE)
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
