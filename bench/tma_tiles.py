"""The TMA kernel's tile shapes side by side on the FLUX decoder's convs:
tiles of 8 pixel rows x 16 columns (most of the table before 2026-12-01),
tiles of one 128-pixel row, one-row tiles walked by a persistent grid, and
cuDNN.

    python -m bench.tma_tiles [--res 1024] [--rounds 3] [--repeat 5]

A one-row tile's input box reaches wgmma straight from shared memory; a
taller box goes through registers (see kernels/conv2d_tma.py). Rows: name
("<conv> <variant>"), baseline "cuDNN" (NHWC, bias included), baseline_ms,
ours_ms, speedup, tflops, config, ``deterministic`` (``--repeat`` calls give
the same bits) and, for a persistent variant, ``bit_equal_one_tile`` (the
same bits as one program per tile with the same tile: the tile order does
not change a tile's sums).
"""

import argparse

import torch
import torch.nn.functional as F

from conv_patch import functional
from conv_patch.routing.registry import BY_ROUTE, Route

from .common import interleaved_ms, print_table, side_by_side_setup, write_results

TMA = BY_ROUTE[Route.CONV2D_TMA].table  # the TMA route's name in a table


def _tma(bm, bn, bw, warps, stages, persistent=0):
    c = {"route": TMA, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "BLOCK_W": bw, "GROUP_M": 8,
         "num_warps": warps, "num_stages": stages}
    if persistent:
        c["persistent"] = persistent
    return c


VARIANTS = {
    "8x16 128x128 s4": _tma(128, 128, 16, 4, 4),
    "8x16 128x256 s3": _tma(128, 256, 16, 8, 3),
    "row 128x128 s3": _tma(128, 128, 128, 4, 3),
    "row 128x256 s3": _tma(128, 256, 128, 8, 3),
    "row 128x256 s3 persistent": _tma(128, 256, 128, 8, 3, persistent=1),
}


def decoder_shapes(res):
    """(C_in, C_out, H, W, k) of the FLUX decoder's 3x3 convs for an image of
    ``res``^2 (latent res/8): the 512-channel ones at res/8, res/4 and res/2,
    the 256- and 128-channel ones at full size."""
    return [(512, 512, res // 8, res // 8, 3), (512, 512, res // 4, res // 4, 3), (512, 512, res // 2, res // 2, 3),
            (512, 256, res // 2, res // 2, 3), (256, 256, res, res, 3), (256, 128, res, res, 3),
            (128, 128, res, res, 3)]


def _shape(text):
    ci, co, h, w, k = (int(v) for v in text.split(","))
    return ci, co, h, w, k


def conv_rows(shape, device, rounds, repeat):
    """bf16 everywhere: the TMA route takes fp16/bf16 (the interpreter upcasts its dots)."""
    ci, co, h, w, k = shape
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(h * w + ci)
    nhwc = torch.channels_last
    x = torch.randn(1, ci, h, w, generator=g).to(device, dtype).contiguous(memory_format=nhwc)
    wt = (torch.randn(co, ci, k, k, generator=g) * (ci * k * k) ** -0.5).to(device, dtype)
    w_nhwc = wt.contiguous(memory_format=nhwc)
    b = torch.randn(co, generator=g).to(device, dtype)
    name = f"conv {ci}->{co} {k}x{k} @{h}x{w}"
    outs = {v: torch.empty(1, co, h, w, device=device, dtype=dtype).contiguous(memory_format=nhwc) for v in VARIANTS}
    fns = [lambda v=v: functional.conv2d(x, w_nhwc, b, 1, k // 2, out=outs[v], config=VARIANTS[v]) for v in VARIANTS]
    first, det = {}, {}
    for v, fn in zip(VARIANTS, fns):
        runs = []
        for _ in range(repeat):
            outs[v].fill_(float("nan"))
            fn()
            runs.append(outs[v].clone())
        first[v] = runs[0]
        det[v] = all(torch.equal(runs[0], r) for r in runs[1:]) and not bool(runs[0].isnan().any())
    cudnn = lambda: F.conv2d(x, w_nhwc, b, 1, k // 2)  # noqa: E731
    *ours, theirs = interleaved_ms(fns + [cudnn], rounds=rounds)
    flops = 2 * h * w * co * ci * k * k
    rows = []
    for (v, cfg), ms in zip(VARIANTS.items(), ours):
        row = {"name": f"{name} {v}", "baseline": "cuDNN", "baseline_ms": theirs, "ours_ms": ms,
               "speedup": theirs / ms, "tflops": flops / ms / 1e9, "config": cfg, "deterministic": det[v]}
        if cfg.get("persistent"):
            one = v.replace(" persistent", "")
            row["bit_equal_one_tile"] = bool(torch.equal(first[v], first[one]))
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--res", type=int, nargs="*", default=[1024], help="FLUX decoder image sizes")
    ap.add_argument("--shapes", type=_shape, nargs="*", default=[], metavar="CI,CO,H,W,K",
                    help="convs of your own (the tests' tiny shapes) instead of the decoder's")
    ap.add_argument("--repeat", type=int, default=5, help="calls per variant checked for identical bits")
    args, device, _ = side_by_side_setup(ap, argv)
    shapes = args.shapes or [s for r in args.res for s in decoder_shapes(r)]
    rows = []
    for shape in shapes:
        rows += conv_rows(shape, device, args.rounds, args.repeat)
        print_table(rows[-len(VARIANTS):], ["name", "baseline_ms", "ours_ms", "speedup", "tflops", "deterministic"])
    path = write_results("tma_tiles", rows, {}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
