"""Every convolution of the FLUX.1/SD3 VAE (decoder and encoder, traced off
the architecture): conv-patch against cuDNN (F.conv2d), in NHWC and in NCHW,
plain and fused.

    python -m bench.layers [--res 512 1024] [--parts decoder encoder] [--dtype bf16] [--rounds 2]
                           [--families flux] [--limit N] [--no-fused]

plain: conv + bias. conv-patch runs what the wrapper runs: the route and
config ``select_route`` picks from the packaged table (its label is in the
row), plus the per-call weight-pack refresh where the model's weight is not
already in the pack layout (an NCHW model). cuDNN gets the weight in the
input's layout, as a model converted with ``.to(memory_format=...)`` holds it.
fused: ``silu(conv + bias + residual)`` in one conv-patch kernel against cuDNN
conv followed by eager add and SiLU.
--graph: both sides are captured in a CUDA graph and the replays timed, so
the rows are GPU time alone (a small conv's kernel is shorter than the host
time of a conv-patch call, which bench.overhead measures).
Rows: name, baseline, baseline_ms, ours_ms, speedup, tflops, pct_of_peak.
"""

import argparse

import torch
import torch.nn.functional as F

from conv_patch import functional
from conv_patch.tools.model_shapes import distinct_calls
from conv_patch.routing.decide import decide
from conv_patch.specs import CallDesc
from conv_patch.tools.tune import geomean, graph_replay
from conv_patch.target import target_for

from .common import PEAK_TFLOPS, bench_device, interleaved_ms, print_table, write_results

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run_layer(call, layout, dtype, rounds, fused, device, graph=False):
    spec, shape = call.spec, call.shape
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype, generator=g).contiguous(memory_format=fmt)
    k = spec.kernel
    w = (torch.randn(spec.out_channels, spec.in_channels, *k, device=device, generator=g)
         * (spec.in_channels * k[0] * k[1]) ** -0.5).to(dtype).contiguous(memory_format=fmt)
    b = torch.randn(spec.out_channels, device=device, dtype=dtype, generator=g)
    packed = w.contiguous(memory_format=torch.channels_last)
    refresh = packed.data_ptr() != w.data_ptr()
    st, pad, dil = spec.stride, spec.padding_arg, spec.dilation
    y = spec.torch_conv2d(x, w, b)
    r = torch.randn(y.shape, device=device, dtype=dtype, generator=g).contiguous(memory_format=fmt)
    decision = decide(spec, CallDesc.of_call(x, packed, b), target_for(x.device), as_called=False)

    def ours(**kw):
        if refresh:
            packed.copy_(w)  # the per-call refresh the wrapper does
        return functional.conv2d(x, packed, b, st, pad, dil, **kw)

    if fused:
        fns = [lambda: F.silu(spec.torch_conv2d(x, w, b) + r),
               lambda: ours(residual=r, activation="silu")]
        ref = F.silu(spec.torch_conv2d(x.float(), w.float(), b.float()) + r.float())
    else:
        fns = [lambda: spec.torch_conv2d(x, w, b), ours]
        ref = spec.torch_conv2d(x.float(), w.float(), b.float())
    err = ((fns[1]().float() - ref).norm() / ref.norm()).item()
    graph = graph and device.type == "cuda"
    timed = [graph_replay(f) for f in fns] if graph else fns
    base_ms, ours_ms = interleaved_ms(timed, rounds=rounds, warmup=10, rep=40)
    flops = 2 * y.numel() // y.shape[1] * spec.out_channels * spec.in_channels * k[0] * k[1]
    tflops = flops / ours_ms / 1e9
    return {
        "name": f"{call.where.split(' @')[0]} {call.describe()} {layout}{' fused' if fused else ''}",
        "baseline": f"cudnn {layout}" + (" + eager add + silu" if fused else ""),
        "baseline_ms": base_ms, "ours_ms": ours_ms, "speedup": base_ms / ours_ms,
        "tflops": tflops, "pct_of_peak": 100 * tflops / PEAK_TFLOPS,
        "route": decision.label(), "config": decision.config, "tier": decision.tier,
        "rel_err_vs_fp32": err, "timing": "cuda graph replay" if graph else "launched",
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--res", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--parts", nargs="+", default=["decoder", "encoder"])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-fused", action="store_true", help="skip the fused rows")
    ap.add_argument("--families", nargs="+", default=["flux"], help="model families (conv_patch.tools.model_shapes)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N distinct convs")
    ap.add_argument("--max-out-channels", type=int, default=None, metavar="C",
                    help="only the convs with at most C output channels")
    ap.add_argument("--max-in-channels", type=int, default=None, metavar="C",
                    help="only the convs with at most C input channels")
    ap.add_argument("--kernel", type=int, default=None, metavar="K", help="only the KxK convs")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of both sides: GPU time without the host's")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    dtype = DTYPES[args.dtype]
    device = bench_device()
    calls = [c for c in distinct_calls(args.families, args.res, [1], args.parts)
             if (args.max_out_channels is None or c.spec.out_channels <= args.max_out_channels)
             and (args.max_in_channels is None or c.spec.in_channels <= args.max_in_channels)
             and (args.kernel is None or c.spec.kernel == (args.kernel, args.kernel))][:args.limit]
    if not calls:
        ap.error("no convolution of those families, sizes and parts passes the filters")
    rows = []
    for call in calls:
        for layout in ("nhwc", "nchw"):
            variants = [False] if args.no_fused else [False, True]
            for fused in variants:
                r = run_layer(call, layout, dtype, args.rounds, fused, device, args.graph)
                rows.append(r)
                write_results("layers", rows, {"dtype": args.dtype, "graph": args.graph}, args.out)  # a cut-off run keeps its rows
                print(f"{r['name']}: cudnn {r['baseline_ms']:.4f} ms  ours {r['ours_ms']:.4f} ms  "
                      f"x{r['speedup']:.2f}  {r['route']}", flush=True)
    summary = {}
    for layout in ("nhwc", "nchw"):
        for fused in (False, True):
            sel = [r for r in rows if r["name"].endswith(layout + (" fused" if fused else ""))]
            if sel:
                summary[f"{layout}{'_fused' if fused else ''}"] = {
                    "geomean_speedup": geomean([r["speedup"] for r in sel]), "rows": len(sel)}
    path = write_results("layers", rows, {"dtype": args.dtype, "graph": args.graph, "peak_tflops": PEAK_TFLOPS,
                                          "summary": summary}, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "tflops", "pct_of_peak", "route"])
    for k, v in summary.items():
        print(k, v)
    print("wrote", path)


if __name__ == "__main__":
    main()
