"""The layout a zoo model runs in, measured: the model as built (NCHW, as
diffusers and ComfyUI call it) against the same model with its weights and
its input in channels_last (NHWC; the input converted inside the timed call
and the output returned NCHW-contiguous, as a layout recipe would do it),
unpatched and patched, launched eagerly and interleaved in one process;
``nhwc_input`` is the model's own NCHW weights under an NHWC input; ``--graph``
adds each unpatched layout's CUDA-graph replay (its GPU time
alone: the row is host-bound where that is well under the launched time).

    python -m bench.layout [--only rrdb-x4 sd15-unet ...] [--runs 9] [--graph]

cuDNN's NHWC kernels on the H200 are much faster than its NCHW ones on the
UNets' and the upscalers' shapes (``layers-zoo-*`` rows); this says what a
whole model gains from that before any kernel of ours runs.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import conv_patch

from .common import bench_device, print_table, write_results
from .zoo import interleaved, load_case, output_tensor, selected

CASES = [("rrdb-x4", 256, 1, None), ("sd15-unet", 512, 2, None), ("sdxl-unet", 1024, 1, None),
         ("controlnet", 512, 2, None)]
CL = torch.channels_last


def _nhwc_call(m):
    """The model called as a layout recipe would call it: the input made
    channels_last on entry, the output made NCHW-contiguous on return."""
    def call(args, kw):
        args = (args[0].contiguous(memory_format=CL),) + tuple(args[1:])
        if "controlnet_cond" in kw:
            kw = dict(kw, controlnet_cond=kw["controlnet_cond"].contiguous(memory_format=CL))
        return output_tensor(m(*args, **kw)).contiguous()
    return call


def _plain_call(m):
    def call(args, kw):
        return output_tensor(m(*args, **kw))
    return call


def _graph_ms(call, inp, reps=20):
    """Median CUDA-graph replay time of ``call(*inp)`` (GPU time alone)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            call(*inp)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(*inp)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times)


def layout_row(name, size, batch, dtype_name, runs, warmup, device, graph, tiny=False):
    fields, model, inputs = load_case(name, size, batch, dtype_name, tiny, device)
    nhwc = copy.deepcopy(model).to(memory_format=CL)
    patched = copy.deepcopy(model)
    conv_patch.apply(patched)
    patched_nhwc = copy.deepcopy(model).to(memory_format=CL)
    conv_patch.apply(patched_nhwc)
    # nhwc_input: the model's own (NCHW) weights under an NHWC input, as a
    # layout recipe that leaves the user's parameters alone would run it
    # (cuDNN then converts each weight at each call).
    calls = {"nchw": _plain_call(model), "nhwc": _nhwc_call(nhwc), "nhwc_input": _nhwc_call(model),
             "patched_nchw": _plain_call(patched), "patched_nhwc": _nhwc_call(patched_nhwc)}
    state = {"i": 0}

    def timed(call):
        def fn():
            call(*inputs[state["i"] % len(inputs)])
            state["i"] += 1
        return fn
    row = dict(fields)
    with torch.inference_mode():
        for c in calls.values():  # first calls: compile and plan
            c(*inputs[0])
        res = interleaved({k: timed(c) for k, c in calls.items()}, runs, warmup)
        ref = calls["nchw"](*inputs[0]).float()
        for k, c in calls.items():
            y = c(*inputs[0])
            row[f"{k}_ms"] = res[k]["ms"]
            row[f"{k}_host_ms"] = res[k]["host_ms"]
            row[f"{k}_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
            row[f"{k}_contiguous"] = y.is_contiguous()
        if graph and device.type == "cuda":
            for k in ("nchw", "nhwc", "nhwc_input"):
                try:
                    row[f"{k}_graph_ms"] = _graph_ms(calls[k], inputs[0])
                except Exception as e:  # a model that cannot be captured: said, not fatal
                    row[f"{k}_graph_error"] = f"{type(e).__name__}: {e}"[:200]
    base = row["nchw_ms"]
    row.update({"baseline": "unpatched NCHW, launched eagerly", "baseline_ms": base,
                "ours_ms": row["patched_nhwc_ms"], "speedup": base / row["patched_nhwc_ms"],
                "nhwc_speedup": base / row["nhwc_ms"], "nhwc_input_speedup": base / row["nhwc_input_ms"],
                "patched_nchw_speedup": base / row["patched_nchw_ms"]})
    del model, nhwc, patched, patched_nhwc
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = bench_device()
    rows = []
    for name, size, batch, dt in selected(CASES, args.only):
        rows.append(layout_row(name, size, batch, dt, args.runs, args.warmup, device, args.graph))
        print_table(rows[-1:], ["name", "nchw_ms", "nhwc_ms", "nhwc_input_ms", "patched_nchw_ms", "patched_nhwc_ms", "nchw_graph_ms",
                                "nhwc_graph_ms", "nhwc_rel_err", "patched_nhwc_rel_err"])
    path = write_results("layout", rows, out_dir=args.out)
    print(path)
    print_table(rows, ["name", "nchw_ms", "nhwc_ms", "nhwc_input_ms", "patched_nchw_ms", "patched_nhwc_ms",
                       "nhwc_speedup",
                       "speedup", "nchw_graph_ms", "nhwc_graph_ms"])


if __name__ == "__main__":
    main()
