"""GroupNorm(32)+SiLU of the FLUX.1/SD VAE: conv-patch's kernels against
PyTorch's ``F.silu(F.group_norm(...))``, NCHW and NHWC, side by side.

    python -m bench.group_norm [--shapes 1x128x1024x1024 ...] [--rounds 3]

Rows: name, baseline ("torch group_norm + silu", same layout), baseline_ms,
ours_ms, speedup, ``tbs`` (our effective bandwidth: the input read twice and
the output written once, over our time) and ``rel_err`` against float64.
"""

import argparse

import torch
import torch.nn.functional as F

from conv_patch import functional

from .common import interleaved_ms, print_table, side_by_side_setup, write_results

# The decoder's GroupNorm inputs at 1024^2 (and the 512-channel low-res ones).
SHAPES = [(1, 128, 1024, 1024), (1, 256, 1024, 1024), (1, 256, 512, 512), (1, 512, 512, 512),
          (1, 512, 256, 256), (1, 512, 128, 128)]


def _shape(s):
    return tuple(int(v) for v in s.split("x"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_shape, nargs="+", default=SHAPES, help="NxCxHxW")
    ap.add_argument("--groups", type=int, default=32)
    args, device, dtype = side_by_side_setup(ap, argv)
    rows = []
    for shape in args.shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(shape, device=device, generator=g).to(dtype) * 2 + 0.5
        w = (1 + 0.1 * torch.randn(shape[1], device=device, generator=g)).to(dtype)
        b = (0.1 * torch.randn(shape[1], device=device, generator=g)).to(dtype)
        for nhwc in (False, True):
            xx = x.contiguous(memory_format=torch.channels_last) if nhwc else x
            ref = F.silu(F.group_norm(xx.double(), args.groups, w.double(), b.double(), 1e-6))
            y = functional.group_norm(xx, args.groups, w, b, 1e-6, "silu")
            err = ((y.double() - ref).norm() / ref.norm()).item()
            ours, theirs = interleaved_ms([
                lambda: functional.group_norm(xx, args.groups, w, b, 1e-6, "silu"),
                lambda: F.silu(F.group_norm(xx, args.groups, w, b, 1e-6)),
            ], rounds=args.rounds)
            nbytes = 3 * x.numel() * x.element_size()
            rows.append({
                "name": f"group_norm({args.groups})+silu {'x'.join(map(str, shape))} {'nhwc' if nhwc else 'nchw'}",
                "baseline": "torch group_norm + silu", "baseline_ms": theirs, "ours_ms": ours,
                "speedup": theirs / ours, "tbs": nbytes / ours / 1e9, "rel_err": err,
                "dtype": str(dtype).replace("torch.", ""),
            })
            write_results("group_norm", rows, {"groups": args.groups}, args.out)
    path = write_results("group_norm", rows, {"groups": args.groups}, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "tbs", "rel_err"])
    print("wrote", path)


if __name__ == "__main__":
    main()
