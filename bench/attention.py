"""The VAE mid-block attention (one head, 512 wide): ``functional.attention``
against ``F.scaled_dot_product_attention`` (the kernel PyTorch picks; for
heads wider than 256 its memory-efficient one), side by side.

    python -m bench.attention [--tokens 4096 16384 65536] [--dim 512] [--rounds 3]

Rows: name, baseline ("torch sdpa"), baseline_ms, ours_ms, speedup,
``tflops`` (ours, counting the 4*N*M*D of the two GEMMs) and ``rel_err`` of
each against float64 (``sdpa_rel_err``) on a 2048-query slice; ``route``
(``functional.attention_route``) and, where it is "fused", the cuBLAS + row softmax
route timed in the same rounds (``blocked_ms``, ``blocked_rel_err``).
"""

import argparse

import torch
import torch.nn.functional as F

from conv_patch import functional

from .common import interleaved_ms, print_table, side_by_side_setup, write_results

# Tokens of the FLUX/SD VAE mid-block at 512^2, 1024^2 and 2048^2 images.
TOKENS = [4096, 16384, 65536]


def _err(out, q, k, v, rows):
    ref = F.scaled_dot_product_attention(q[..., :rows, :].double(), k.double(), v.double())
    return ((out[..., :rows, :].double() - ref).norm() / ref.norm()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--dim", type=int, default=512)
    args, device, dtype = side_by_side_setup(ap, argv)
    rows = []
    for n in args.tokens:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, 1, n, args.dim, device=device, generator=g).to(dtype) for _ in range(3))
        check = min(n, 2048)
        route = functional.attention_route(q, k, v)
        fns = [lambda: functional.attention(q, k, v), lambda: F.scaled_dot_product_attention(q, k, v)]
        if route == "fused":
            fns.append(lambda: functional.attention(q, k, v, route="blocked"))
        times = interleaved_ms(fns, rounds=args.rounds)
        ours, theirs = times[0], times[1]
        row = {
            "name": f"attention N={n} D={args.dim}", "baseline": "torch sdpa", "baseline_ms": theirs,
            "ours_ms": ours, "speedup": theirs / ours, "tflops": 4.0 * n * n * args.dim / ours / 1e9,
            "rel_err": _err(functional.attention(q, k, v), q, k, v, check),
            "sdpa_rel_err": _err(F.scaled_dot_product_attention(q, k, v), q, k, v, check),
            "route": route, "dtype": str(dtype).replace("torch.", ""),
        }
        if route == "fused":
            row["blocked_ms"] = times[2]
            row["blocked_rel_err"] = _err(functional.attention(q, k, v, route="blocked"), q, k, v, check)
        rows.append(row)
        write_results("attention", rows, {}, args.out)
    path = write_results("attention", rows, {}, args.out)
    print_table(rows, ["name", "route", "baseline_ms", "ours_ms", "speedup", "tflops", "rel_err", "sdpa_rel_err",
                       "blocked_ms"])
    print("wrote", path)


if __name__ == "__main__":
    main()
