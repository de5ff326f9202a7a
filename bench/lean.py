"""The recipes' lean forwards against the blocks' own forwards: one block
at a time, launched eagerly, interleaved, medians (``python -m bench.lean``).

A lean forward (``Recipe.lean``) computes its block's own values through the
functions its parts' forwards call: the gain is host time, which sets the
pace of small calls. Each row times the block as its own class and as the
lean class (the block's class with the mixin in front, as the passthrough
runs it) on the same input, checks the outputs are equal bit for bit, and
writes ``lean-<device>-<date>.json``."""

import argparse
import copy

import torch

from bench import zoo
from bench.common import bench_device, print_table, write_results
from conv_patch.recipes import esrgan, fuse


def _spandrel_dense(nf, gc):
    return next(m for m in zoo.spandrel_rrdbnet(nf, 1, gc).modules() if type(m).__name__ == "ResidualDenseBlock_5C")


def cases(tiny: bool):
    """(name, block, input shape, lean mixin)."""
    nf, gc, dsize = (8, 4, 8) if tiny else (64, 32, 256)
    return [
        (f"dense block new-arch {dsize}x{dsize}", zoo.ResidualDenseBlock_5C(nf, gc), (1, nf, dsize, dsize),
         esrgan.LeanDenseBlock),
        (f"dense block spandrel {dsize}x{dsize}", _spandrel_dense(nf, gc), (1, nf, dsize, dsize),
         esrgan.LeanDenseBlock),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=51)
    ap.add_argument("--tiny", action="store_true", help="small blocks (the tests)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    device = bench_device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    rows = []
    for name, block, shape, lean in cases(args.tiny):
        own = block.to(device, dtype).eval()
        mine = copy.deepcopy(own)
        mine.__class__ = fuse.lean_class(type(own), lean)
        x = torch.randn(shape, device=device, dtype=dtype)
        with torch.no_grad():
            equal = torch.equal(own(x), mine(x))
            t = zoo.interleaved({"own": lambda: own(x), "lean": lambda: mine(x)}, args.rounds, 3)
        a, b = t["own"]["ms"], t["lean"]["ms"]
        rows.append({"name": f"{name} b{shape[0]} {str(dtype)[6:]}", "baseline": "the block's own forward",
                     "baseline_ms": a, "ours_ms": b, "speedup": a / b, "host_ms": t["lean"]["host_ms"],
                     "baseline_host_ms": t["own"]["host_ms"], "bit_equal": equal, "rounds": args.rounds})
    path = write_results(f"lean-{device.type}", rows, out_dir=args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "bit_equal"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
