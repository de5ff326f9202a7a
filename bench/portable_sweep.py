"""Offline sweep of tile configs of the portable kernel on representative VAE
shapes: the evidence behind configs/default.json's values.

    python -m bench.portable_sweep [--dtype bf16]

Each candidate's output is checked against cuDNN before it is timed.
"""

import argparse

import torch
import torch.nn.functional as F

from conv_patch import functional

from .common import print_table, time_ms, write_results

CANDIDATES = [
    # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
    (64, 64, 32, 4, 2), (64, 64, 64, 4, 3), (128, 64, 32, 4, 3), (128, 64, 64, 4, 3),
    (128, 128, 32, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3), (64, 128, 64, 4, 4),
]
SHAPES = [  # C_in, C_out, k, H
    (128, 128, 3, 1024), (256, 256, 3, 512), (512, 512, 3, 128), (16, 512, 3, 128),
    (128, 3, 3, 1024), (512, 256, 1, 512),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    for c_in, c_out, k, h in SHAPES:
        for nhwc in (True, False):
            fmt = torch.channels_last if nhwc else torch.contiguous_format
            x = torch.randn(1, c_in, h, h, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
            w = (torch.randn(c_out, c_in, k, k, device="cuda") * (c_in * k * k) ** -0.5).to(dtype)
            w = w.contiguous(memory_format=torch.channels_last)
            ref = F.conv2d(x, w, padding=k // 2).float()
            name = f"{c_in}->{c_out} k{k} @{h} {'nhwc' if nhwc else 'nchw'}"
            best = None
            for bm, bn, bk, nw, ns in CANDIDATES:
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": nw, "num_stages": ns}
                try:
                    out = functional.conv2d(x, w, padding=k // 2, config=cfg)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = time_ms(lambda: functional.conv2d(x, w, padding=k // 2, config=cfg)) if err < 1e-2 else None
                except Exception as e:  # out of shared memory and similar: recorded, not fatal
                    err, ms = repr(e)[:80], None
                rows.append({"name": name, "config": f"{bm}x{bn}x{bk} w{nw} s{ns}", "ms": ms, "err": err})
                if ms is not None and (best is None or ms < best[0]):
                    best = (ms, rows[-1]["config"])
            print(f"{name}: best {best}", flush=True)
    path = write_results("portable-sweep", rows, {"dtype": args.dtype})
    by_cfg = {}
    for r in rows:
        if r["ms"] is not None:
            by_cfg.setdefault(r["config"], []).append(r)
    # Geometric-mean slowdown of each config against the per-shape best.
    best_ms = {}
    for r in rows:
        if r["ms"] is not None:
            best_ms[r["name"]] = min(best_ms.get(r["name"], 1e9), r["ms"])
    summary = []
    for cfg, rs in by_cfg.items():
        prod = 1.0
        for r in rs:
            prod *= r["ms"] / best_ms[r["name"]]
        summary.append({"config": cfg, "shapes": len(rs), "geomean_vs_best": prod ** (1 / len(rs))})
    print_table(sorted(summary, key=lambda s: s["geomean_vs_best"]), ["config", "shapes", "geomean_vs_best"])
    print("wrote", path)


if __name__ == "__main__":
    main()
