"""The zoo's 1x1 convs as cuBLAS GEMMs against ``F.conv2d`` (cuDNN): host
time per call, GPU time, error against float64.

    python -m bench.gemm_1x1 [--dtypes fp16 bf16]

Per distinct stride-1 1x1 conv of the zoo's UNets, ControlNet and tiny
decoders (``bench.layers_zoo.distinct_convs``), NCHW and NHWC: the conv as
``F.conv2d`` and as one GEMM over the same tensors (NHWC: ``F.linear`` over
the [pixels, C] view, the output the channels_last tensor PyTorch's conv
returns; NCHW: ``addmm`` / ``baddbmm`` per image, the bias as the GEMM's
added input). Host time: median of bursts of 20 calls, each burst waited for;
GPU time: CUDA-graph replays of 50 calls (no host time). A measurement for a
route not yet taken: nothing in conv-patch calls these GEMMs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from .common import print_table, write_results
from .layers_zoo import CASES, distinct_convs

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def gemm(x, w2, b):
    """``F.conv2d(x, w2[:, :, None, None], b)`` as one GEMM, same layout out."""
    n, c, h, wd = x.shape
    co = w2.shape[0]
    if x.is_contiguous():
        if n == 1:
            y = torch.addmm(b[:, None], w2, x.view(c, h * wd)) if b is not None else torch.mm(w2, x.view(c, h * wd))
            return y.view(1, co, h, wd)
        if b is not None:
            return torch.baddbmm(b.view(1, co, 1), w2.expand(n, co, c), x.view(n, c, h * wd)).view(n, co, h, wd)
        return torch.matmul(w2, x.view(n, c, h * wd)).view(n, co, h, wd)
    y = F.linear(x.permute(0, 2, 3, 1).reshape(n * h * wd, c), w2, b)
    return y.view(n, h, wd, co).permute(0, 3, 1, 2)


def host_us(fn, reps=40, burst=20):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(burst):
            fn()
        ts.append((time.perf_counter() - t) / burst * 1e6)
    return statistics.median(ts)


def gpu_us(fn, calls=50):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(ts)


def row(call, count, layout, dt):
    s = call.spec
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(call.shape, device="cuda", generator=g).to(dt)
    w = (torch.randn(s.out_channels, s.in_channels, 1, 1, device="cuda", generator=g) * s.in_channels ** -0.5).to(dt)
    b = (torch.randn(s.out_channels, device="cuda", generator=g) * 0.1).to(dt)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    w2 = w.view(s.out_channels, s.in_channels)
    ref = F.conv2d(x.double(), w.double(), b.double())
    conv, mm = (lambda: F.conv2d(x, w, b)), (lambda: gemm(x, w2, b))
    ya, yb = conv(), mm()
    err = [((y.double() - ref).norm() / ref.norm()).item() for y in (ya, yb)]
    hosts = [min(host_us(f), host_us(f)) for f in (conv, mm)]
    gpus = [gpu_us(f) for f in (conv, mm)]
    return {"name": f"{call.where} {s.in_channels}->{s.out_channels} 1x1 on {'x'.join(map(str, call.shape))} "
                    f"{layout} {str(dt)[6:]}",
            "baseline": "cuDNN (F.conv2d), GPU time of CUDA-graph replays", "baseline_ms": gpus[0] / 1e3,
            "ours_ms": gpus[1] / 1e3, "speedup": gpus[0] / gpus[1], "host_conv_us": hosts[0],
            "host_gemm_us": hosts[1], "rel_err_conv": err[0], "rel_err_gemm": err[1],
            "same_strides": ya.stride() == yb.stride(), "calls": count}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = False
    convs = [(c, n) for c, n in distinct_convs(CASES)
             if c.spec.kernel == (1, 1) and c.spec.stride == (1, 1) and c.spec.groups == 1]
    rows = []
    with torch.no_grad():
        for dt in args.dtypes:
            for call, count in convs:
                for layout in ("nchw", "nhwc"):
                    rows.append(row(call, count, layout, DTYPES[dt]))
    path = write_results("gemm-1x1", rows, None, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "host_conv_us", "host_gemm_us"])
    print("wrote", path)


if __name__ == "__main__":
    main()
