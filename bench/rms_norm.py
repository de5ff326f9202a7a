"""RMS norm + SiLU of the Wan-family video VAEs: conv-patch's kernel
(``functional.rms_norm``) against the module's own PyTorch computation
(``F.normalize`` of an fp32 copy, back to the dtype, ``* scale * gamma + 0.0``,
then ``F.silu``), NCDHW and NDHWC, side by side. This is the measurement
``costs.rms_norm_pays`` models until it exists.

    python -m bench.rms_norm [--shapes 1x384x4x120x208 ...] [--rounds 3]

Rows: name, baseline, baseline_ms, ours_ms, speedup, ``tbs`` (our effective
bandwidth: the input read twice and the output written once, over our time)
and ``rel_err`` against float64.
"""

import argparse

import torch
import torch.nn.functional as F

from conv_patch import functional

from .common import interleaved_ms, print_table, side_by_side_setup, write_results

# A Wan 2.1 decoder's norm inputs at 480x832, per chunk (latent 60x104).
SHAPES = [(1, 384, 2, 60, 104), (1, 384, 4, 120, 208), (1, 192, 4, 240, 416), (1, 96, 4, 480, 832)]


def _shape(s):
    return tuple(int(v) for v in s.split("x"))


def module_expr(x, gamma, scale):
    """What ``WanRMS_norm`` + ``nn.SiLU`` compute, as they compute it."""
    return F.silu(F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma + 0.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_shape, nargs="+", default=SHAPES, help="NxCxTxHxW")
    args, device, dtype = side_by_side_setup(ap, argv)
    rows = []
    for shape in args.shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x = (torch.randn(shape, device=device, generator=g) * 2 + 0.5).to(dtype)
        gamma = (1 + 0.1 * torch.randn(shape[1], *([1] * (len(shape) - 2)), device=device, generator=g)).to(dtype)
        scale = shape[1] ** 0.5
        for last in (False, True):
            xx = x.contiguous(memory_format=torch.channels_last_3d) if last else x
            ref = F.silu(F.normalize(xx.double(), dim=1) * scale * gamma.double())
            y = functional.rms_norm(xx, gamma, None, scale, activation="silu")
            err = ((y.double() - ref).norm() / ref.norm()).item()
            ours, theirs = interleaved_ms([lambda: functional.rms_norm(xx, gamma, None, scale, activation="silu"),
                                           lambda: module_expr(xx, gamma, scale)], rounds=args.rounds)
            rows.append({
                "name": f"rms_norm+silu {'x'.join(map(str, shape))} {'ndhwc' if last else 'ncdhw'}",
                "baseline": "the module's F.normalize, affine and silu", "baseline_ms": theirs, "ours_ms": ours,
                "speedup": theirs / ours, "tbs": 3 * x.numel() * x.element_size() / ours / 1e9, "rel_err": err,
                "dtype": str(dtype).replace("torch.", ""),
            })
    path = write_results("rms_norm", rows, {}, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "tbs", "rel_err"])
    print("wrote", path)


if __name__ == "__main__":
    main()
