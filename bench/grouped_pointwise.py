"""Grouped 1x1 convs on channels-last inputs: conv-patch's grouped-pointwise
kernel (``ops.grouped_pointwise``, what the DC-AE recipe runs for the
linear attention's ``proj_out``) against PyTorch's conv (cuDNN) as called,
side by side.

    python -m bench.grouped_pointwise [--shapes 1x3072x32x32g96 ...] [--rounds 3]

Rows: name, baseline ("cuDNN, launched"), baseline_ms, ours_ms, speedup,
``rel_err`` (ours) and ``baseline_rel_err`` against float64.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.ops import grouped_pointwise

from .common import interleaved_ms, print_table, side_by_side_setup, write_results

# DC-AE's proj_out (32-channel groups: 3 x heads) at a 1024^2 decode's
# resolutions, and fewer, wider groups.
SHAPES = ["1x3072x32x32g96", "1x3072x64x64g96", "1x1536x128x128g48", "1x1536x256x256g48",
          "1x512x64x64g2", "2x384x64x64g4", "1x96x128x128g3"]


def _shape(s):
    dims, groups = s.split("g")
    return tuple(int(v) for v in dims.split("x")), int(groups)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="NxCxHxWgG")
    args, device, dtype = side_by_side_setup(ap, argv)
    rows = []
    for s in args.shapes:
        (n, c, h, w), groups = _shape(s)
        g = torch.Generator(device="cpu").manual_seed(0)
        conv = nn.Conv2d(c, c, 1, groups=groups, bias=False)
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * (groups / c) ** 0.5)
        conv = conv.to(device, dtype)
        x = (torch.randn(n, c, h, w, generator=g) + 0.5).to(device, dtype).contiguous(
            memory_format=torch.channels_last)
        with torch.no_grad():
            assert grouped_pointwise.problem(conv, x) is None, grouped_pointwise.problem(conv, x)
            ref = F.conv2d(x.double(), conv.weight.double(), groups=groups)
            ours_y, theirs_y = grouped_pointwise.grouped_pointwise(conv, x), conv(x)
            ours, theirs = interleaved_ms([lambda: grouped_pointwise.grouped_pointwise(conv, x), lambda: conv(x)],
                                          rounds=args.rounds)
        rows.append({
            "name": f"grouped 1x1 {s} nhwc", "baseline": "cuDNN, launched", "baseline_ms": theirs, "ours_ms": ours,
            "speedup": theirs / ours, "rel_err": ((ours_y.double() - ref).norm() / ref.norm()).item(),
            "baseline_rel_err": ((theirs_y.double() - ref).norm() / ref.norm()).item(),
            "dtype": str(dtype).replace("torch.", ""),
        })
        write_results("grouped_pointwise", rows, None, args.out)
    path = write_results("grouped_pointwise", rows, None, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "rel_err", "baseline_rel_err"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
