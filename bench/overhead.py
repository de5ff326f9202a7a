"""Host time per call on a convolution too small for the GPU to matter: what
Python routing, packing and the Triton launch cost each call.

    python -m bench.overhead
"""

import time

import torch
import torch.nn.functional as F
from torch import nn

import conv_patch
from conv_patch import kernels, ops

from .common import print_table, write_results


def per_call_us(fn, n=500):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    x = torch.randn(1, 16, 8, 8, device="cuda", dtype=torch.bfloat16)
    conv = nn.Conv2d(16, 16, 3, padding=1).to("cuda", torch.bfloat16)
    plain = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1)).to("cuda", torch.bfloat16)
    conv_patch.apply(plain)
    wrapper = plain[0]
    w = conv.weight.detach().contiguous(memory_format=torch.channels_last)
    out = torch.empty(1, 16, 8, 8, device="cuda", dtype=torch.bfloat16)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16}
    cases = {
        "F.conv2d (cuDNN)": lambda: F.conv2d(x, conv.weight, conv.bias, padding=1),
        "wrapper call (route + pack + launch)": lambda: wrapper(x),
        "ops.conv2d (route + launch)": lambda: ops.conv2d(x, w, conv.bias, padding=1),
        "launcher only": lambda: kernels.launch_conv2d(
            x, w, conv.bias, out, None, stride=(1, 1), padding=(1, 1), dilation=(1, 1), beta=1.0,
            activation=0, out_scale=1.0, config=cfg, precision="ieee", upcast=False),
        "pack refresh (torch copy_)": lambda: out.copy_(x),
    }
    rows = []
    with torch.no_grad():
        assert wrapper.route(x).is_kernel
        for name, fn in cases.items():
            rows.append({"name": name, "us_per_call": per_call_us(fn)})
    print_table(rows, ["name", "us_per_call"])
    print("wrote", write_results("overhead", rows))


if __name__ == "__main__":
    main()
