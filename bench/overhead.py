"""Host time per call on a convolution too small for the GPU to matter: what
the dispatch (signature, plan lookup, pack refresh) and the launch cost each
call, against PyTorch's own call of the same conv.

    python -m bench.overhead

Rows (microseconds per call, the median of several rounds of back-to-back
calls): the unpatched ``nn.Conv2d`` module and ``F.conv2d``; the patched
module on a kernel route (the whole planned call) and on PyTorch's route;
the parts of a planned call; the Triton launcher as ``ops`` calls it; the
GroupNorm kernels against PyTorch's. The kernel route is forced by a user
table (the cost model would rightly give so small a conv to PyTorch).
"""

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import conv_patch
from conv_patch import functional
from conv_patch.routing import tables as config_tables
from conv_patch.routing.decide import LEAN, LEAN_CONFIG
from conv_patch.routing.registry import BY_ROUTE, CUDNN_TABLE_ROUTE, Route, launcher_of
from conv_patch.call import Call
from conv_patch.runtime.plans import conv_key
from conv_patch.runtime.state import state_of
from conv_patch.specs import ConvSpec

from .common import kernel_device, print_table, sync, write_results

TMA = BY_ROUTE[Route.CONV2D_TMA].table  # the TMA route's name in a table
KERNEL_TABLE = {"conv2d": {"any": {"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16}}}
TMA_TABLE = {"conv2d": {"any": {"route": TMA, "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_W": 8}}}


def per_call_us(fn, n=400, rounds=5, warmup=50):
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def main(argv=None, n=400, rounds=5, warmup=50):
    dev = kernel_device("bench.overhead")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(1, 16, 8, 8, device=dev, dtype=dt)
    conv = nn.Conv2d(16, 16, 3, padding=1).to(dev, dt)
    kernel_net = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1)).to(dev, dt)
    conv_patch.apply(kernel_net, config=conv_patch.PatchConfig(table=KERNEL_TABLE), recipes=False)
    # PyTorch's route, forced the same way: the table's cuDNN entry for the shape.
    key = config_tables.shape_key(ConvSpec.from_module(conv), tuple(x.shape), "nchw", dt)
    torch_table = {"conv2d": {"exact": {key: {"route": CUDNN_TABLE_ROUTE}}, "any": KERNEL_TABLE["conv2d"]["any"]}}
    torch_net = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1)).to(dev, dt)
    conv_patch.apply(torch_net, config=conv_patch.PatchConfig(table=torch_table), recipes=False)
    lean_net = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1)).to(dev, dt)
    conv_patch.apply(lean_net, recipes=False)
    tma_net = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1)).to(dev, dt)
    conv_patch.apply(tma_net, config=conv_patch.PatchConfig(table=TMA_TABLE), recipes=False)
    x_nhwc = x.contiguous(memory_format=torch.channels_last)
    wrapper, routed, lean, tma = kernel_net[0], torch_net[0], lean_net[0], tma_net[0]
    w = conv.weight.detach().contiguous(memory_format=torch.channels_last)
    out = torch.empty(1, 16, 8, 8, device=dev, dtype=dt)
    cfg = KERNEL_TABLE["conv2d"]["any"]
    gn_x = torch.randn(1, 64, 8, 8, device=dev, dtype=dt)
    with torch.no_grad():
        wrapper(x)
        routed(x)
        lean(x)
        tma(x_nhwc)
        plan = next(iter(state_of(wrapper).plans.values()))
        roles = (x, plan.weight(wrapper, wrapper.weight), wrapper.bias, None, None)
        cases = {
            "nn.Conv2d module (unpatched)": lambda: conv(x),
            "F.conv2d": lambda: F.conv2d(x, conv.weight, conv.bias, padding=1),
            "patched, PyTorch route (planned call)": lambda: routed(x),
            "patched, lean route (planned call)": lambda: lean(x),
            "patched, packed portable kernel (planned call)": lambda: wrapper(x),
            "patched, TMA kernel on NHWC (planned call)": lambda: tma(x_nhwc),
            "plan: signature + lookup": lambda: conv_key(Call(x), wrapper.weight, wrapper.bias),
            "plan: pack refresh": lambda: plan.weight(wrapper, wrapper.weight),
            "plan: replayed launch": lambda: plan.program(roles),
            "launcher (Triton launch path)": lambda: launcher_of(Route.CONV2D_IGEMM)(
                x, w, conv.bias, out, None, stride=(1, 1), padding=(1, 1), dilation=(1, 1), beta=1.0,
                activation=0, out_scale=1.0, config=cfg, precision="ieee", upcast=False),
            "F.group_norm + F.silu": lambda: F.silu(F.group_norm(gn_x, 32, None, None, 1e-6)),
            "functional.group_norm (silu)": lambda: functional.group_norm(gn_x, 32, None, None, 1e-6, "silu"),
            "torch copy_ (one small op)": lambda: out.copy_(x),
        }
        if dev.type == "cuda":
            # Off the GPU (the tests, under the interpreter) every route is the kernels'.
            assert state_of(wrapper).last.is_kernel and not state_of(routed).last.is_kernel, (state_of(wrapper).last, state_of(routed).last)
            assert state_of(lean).last.tier == LEAN and state_of(tma).last.route is Route.CONV2D_TMA, (
                state_of(lean).last, state_of(tma).last)
        rows = [{"name": name, "us_per_call": per_call_us(fn, n, rounds, warmup)} for name, fn in cases.items()]
    print_table(rows, ["name", "us_per_call"])
    lean = lean_rows(dev, dt) if dev.type == "cuda" else []
    if lean:
        print_table(lean, ["name", "lean_ms", "cudnn_ms", "lean_tflops", "cudnn_tflops"])
    print("wrote", write_results("overhead", rows, {"lean": lean}))


# NCHW convs of the zoo's host-bound models (an upscaler's 64 channels, SD
# UNet widths): (N, C_in, C_out, size).
LEAN_SHAPES = [(1, 64, 32, 256), (1, 192, 64, 256), (2, 320, 320, 64), (2, 640, 640, 32), (2, 1280, 1280, 16),
               (1, 64, 64, 512), (1, 16, 16, 64)]


def lean_rows(dev, dt):
    """GPU time (graph replays) of the lean route, the portable kernel with
    the NCHW input and weight read in place, against cuDNN: what
    ``costs.lean_ms``'s step times are checked against."""
    import triton.testing

    from conv_patch.tools import tune
    rows = []
    for n, ci, co, s in LEAN_SHAPES:
        x = torch.randn(n, ci, s, s, device=dev, dtype=dt)
        w = torch.randn(co, ci, 3, 3, device=dev, dtype=dt) * 0.05
        out = torch.empty(n, co, s, s, device=dev, dtype=dt)
        fl = 2.0 * n * s * s * co * ci * 9
        lean = tune.graph_replay(lambda: functional.conv2d(x, w, None, padding=1, out=out, config=LEAN_CONFIG))
        cudnn = tune.graph_replay(lambda: F.conv2d(x, w, None, padding=1))
        t_l = triton.testing.do_bench(lean, return_mode="median")
        t_c = triton.testing.do_bench(cudnn, return_mode="median")
        rows.append({"name": f"{n}x{ci}x{s}x{s} -> {co} 3x3 nchw", "lean_ms": t_l, "cudnn_ms": t_c,
                     "lean_tflops": fl / t_l / 1e9, "cudnn_tflops": fl / t_c / 1e9})
    return rows


if __name__ == "__main__":
    main()
