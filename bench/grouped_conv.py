"""Grouped convs on channels-last inputs: conv-patch's grouped-conv kernels
(``ops.grouped_conv``, what the DC-AE recipe runs for the linear
attention's depthwise ``proj_in`` and grouped 1x1 ``proj_out``) against
PyTorch's conv (cuDNN) as called, side by side.

    python -m bench.grouped_conv [--shapes 1x3072x32x32g96 1x3072x64x64dw5 ...] [--rounds 3]

A shape is NxCxHxW and ``gG`` (a 1x1 conv of G groups) or ``dwK`` (a
depthwise KxK conv, padding K//2).

Rows: name, baseline ("cuDNN, launched"), baseline_ms, ours_ms, speedup,
``rel_err`` (ours) and ``baseline_rel_err`` against float64.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.ops import grouped_conv

from .common import interleaved_ms, print_table, side_by_side_setup, write_results

# DC-AE's proj_out (32-channel groups: 3 x heads) and proj_in (5x5) at a
# 1024^2 decode's resolutions; fewer, wider groups; a 3x3 and a 7x7 depthwise.
SHAPES = ["1x3072x32x32g96", "1x3072x64x64g96", "1x1536x128x128g48", "1x1536x256x256g48",
          "1x512x64x64g2", "2x384x64x64g4", "1x96x128x128g3", "1x3072x32x32dw5", "1x3072x64x64dw5",
          "1x1536x128x128dw5", "1x1536x256x256dw5", "2x256x128x128dw3", "1x128x256x256dw7"]


def _conv(s):
    """(input shape, the conv) of a shape string."""
    if "dw" in s:
        dims, k = s.split("dw")
        n, c, h, w = (int(v) for v in dims.split("x"))
        return (n, c, h, w), nn.Conv2d(c, c, int(k), padding=int(k) // 2, groups=c, bias=False)
    dims, groups = s.split("g")
    n, c, h, w = (int(v) for v in dims.split("x"))
    return (n, c, h, w), nn.Conv2d(c, c, 1, groups=int(groups), bias=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="NxCxHxWgG or NxCxHxWdwK")
    args, device, dtype = side_by_side_setup(ap, argv)
    rows = []
    for s in args.shapes:
        (n, c, h, w), conv = _conv(s)
        g = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * conv.weight[0].numel() ** -0.5)
        conv = conv.to(device, dtype)
        x = (torch.randn(n, c, h, w, generator=g) + 0.5).to(device, dtype).contiguous(
            memory_format=torch.channels_last)
        with torch.no_grad():
            assert grouped_conv.form(conv) is not None
            ref = F.conv2d(x.double(), conv.weight.double(), None, conv.stride, conv.padding, conv.dilation,
                           conv.groups)
            ours_y, theirs_y = grouped_conv.grouped_conv(conv, x), conv(x)
            ours, theirs = interleaved_ms([lambda: grouped_conv.grouped_conv(conv, x), lambda: conv(x)],
                                          rounds=args.rounds)
        rows.append({
            "name": f"{grouped_conv.form(conv)} {s} nhwc", "baseline": "cuDNN, launched", "baseline_ms": theirs,
            "ours_ms": ours,
            "speedup": theirs / ours, "rel_err": ((ours_y.double() - ref).norm() / ref.norm()).item(),
            "baseline_rel_err": ((theirs_y.double() - ref).norm() / ref.norm()).item(),
            "dtype": str(dtype).replace("torch.", ""),
        })
        write_results("grouped_conv", rows, None, args.out)
    path = write_results("grouped_conv", rows, None, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "rel_err", "baseline_rel_err"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
