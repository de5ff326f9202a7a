"""Every convolution of the FLUX.1/SD3 VAE decoder: conv-patch against cuDNN
(F.conv2d) in NHWC and in NCHW, plus what the weight pack costs.

    python -m bench.layers [--res 512 1024] [--dtype bf16] [--rounds 3]

Per layer and layout: cuDNN time (weight in the input's layout, as a
channels_last model would hold it), conv-patch time (pack refresh included,
as the wrapper runs it), the refresh alone, and the kernel reading the NCHW
weight in place with no pack. The summary weighs each layer by how often the
decoder runs it. Results go to bench/results/layers-<date>.json.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from conv_patch import ops
from conv_patch.routing import select_route
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import target_for

from .common import interleaved_ms, print_table, write_results
from .shapes import autoencoder_kl_decoder_convs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run_layer(c_in, c_out, k, h, dtype, nhwc, rounds):
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    x = torch.randn(1, c_in, h, h, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    w = (torch.randn(c_out, c_in, k, k, device="cuda") * (c_in * k * k) ** -0.5).to(dtype)
    b = torch.randn(c_out, device="cuda", dtype=dtype)
    w_cudnn = w.contiguous(memory_format=fmt)
    packed = w.contiguous(memory_format=torch.channels_last)
    pad = k // 2

    def ours():
        packed.copy_(w)  # the per-call refresh the wrapper does
        return ops.conv2d(x, packed, b, padding=pad)

    fns = [lambda: F.conv2d(x, w_cudnn, b, padding=pad), ours,
           lambda: packed.copy_(w), lambda: ops.conv2d(x, w, b, padding=pad)]
    cudnn_ms, ours_ms, pack_ms, direct_ms = interleaved_ms(fns, rounds=rounds)
    err = (ours().float() - F.conv2d(x, w, b, padding=pad).float()).norm().item() / \
        F.conv2d(x, w, b, padding=pad).float().norm().item()
    spec = ConvSpec.from_module(torch.nn.Conv2d(c_in, c_out, k, padding=pad))
    route = select_route(spec, CallDesc.of_call(x, packed, b), target_for(x.device))
    flops = 2 * h * h * c_in * c_out * k * k
    return {
        "baseline": f"cudnn {'nhwc' if nhwc else 'nchw'}",
        "baseline_ms": cudnn_ms, "ours_ms": ours_ms, "speedup": cudnn_ms / ours_ms,
        "tflops": flops / ours_ms / 1e9, "pack_ms": pack_ms,
        "pack_pct": 100 * pack_ms / ours_ms, "direct_ms": direct_ms,
        "route": route.label(), "config": route.config, "rel_err_vs_cudnn": err,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--res", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    dtype = DTYPES[args.dtype]
    rows, summary = [], {}
    for res in args.res:
        for (c_in, c_out, k, h), count in sorted(autoencoder_kl_decoder_convs(res).items(),
                                                 key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][3] ** 2):
            for nhwc in (True, False):
                r = run_layer(c_in, c_out, k, h, dtype, nhwc, args.rounds)
                r = {"name": f"dec{res} {c_in}->{c_out} k{k} @{h} {'nhwc' if nhwc else 'nchw'}",
                     "count_in_decoder": count, **r}
                rows.append(r)
                print(f"{r['name']}: cudnn {r['baseline_ms']:.4f} ms  ours {r['ours_ms']:.4f} ms  "
                      f"pack {r['pack_pct']:.2f}%", flush=True)
        for layout in ("nhwc", "nchw"):
            sel = [r for r in rows if r["name"].startswith(f"dec{res} ") and r["name"].endswith(layout)]
            total = lambda key: sum(r[key] * r["count_in_decoder"] for r in sel)  # noqa: E731
            summary[f"dec{res}_{layout}"] = {
                "cudnn_ms": total("baseline_ms"), "ours_ms": total("ours_ms"),
                "pack_ms": total("pack_ms"), "pack_pct_of_ours": 100 * total("pack_ms") / total("ours_ms"),
                "direct_ms": total("direct_ms"),
                "median_layer_speedup": statistics.median(r["speedup"] for r in sel),
            }
    path = write_results("layers", rows, {"dtype": args.dtype, "summary": summary}, args.out)
    print_table(rows, ["name", "count_in_decoder", "baseline_ms", "ours_ms", "speedup", "tflops",
                       "pack_pct", "direct_ms"])
    for k, v in summary.items():
        print(k, {a: round(b, 3) for a, b in v.items()})
    print("wrote", path)


if __name__ == "__main__":
    main()
