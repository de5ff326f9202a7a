"""The TMA kernel's boxed epilogue (residual in and output out as TMA boxes)
against its pointer epilogue, side by side: per FLUX-decoder conv and, with
``--decode``, the whole FLUX.1 decode.

    python -m bench.tma_epilogue [--res 1024 2048] [--decode 1024 2048] [--rounds 3]

Per conv: the table's config for the shape (shapes the table does not send
to the TMA kernel are skipped) with ``"tma_io"`` true and false; rows name,
baseline ("pointer epilogue"), baseline_ms, ours_ms, speedup, ``bit_equal``
(the two epilogues must agree bit for bit) and the config. Per decode: two
patched copies of the VAE, the second with a table whose TMA configs carry
``"tma_io": false``, timed in alternation (medians of ``--runs``).
"""

import argparse
import copy
import json

import torch
from torch import nn

from conv_patch import functional
from conv_patch.routing.registry import BY_ROUTE, Route

from .common import interleaved_ms, print_table, side_by_side_setup, write_results

TMA = BY_ROUTE[Route.CONV2D_TMA].table  # the TMA route's name in a table


def shapes(res):
    """(C_in, C_out, H, k, residual) of the FLUX decoder's convs whose
    outputs take the TMA route at an image of ``res``^2: the last block's
    (128 channels at full size), the one before it (256 at half size)."""
    return [(128, 128, res, 3, True), (128, 128, res, 3, False), (256, 128, res, 3, False),
            (256, 128, res, 1, True), (256, 256, res // 2, 3, True), (256, 256, res // 2, 3, False)]


def _nhwc(t):
    return t.contiguous(memory_format=torch.channels_last)


def _table_config(x, w, b, r):
    from conv_patch.routing.decide import decide
    from conv_patch.specs import CallDesc, ConvSpec
    from conv_patch.target import target_for
    co, ci, k = w.shape[0], w.shape[1], w.shape[-1]
    spec = ConvSpec.from_module(nn.Conv2d(ci, co, k, padding=k // 2, bias=b is not None, device="meta"))
    d = decide(spec, CallDesc.of_call(x, w, b, r), target_for(x.device), None, as_called=False)
    return dict(d.config) if d.config else None


def layer_rows(args, device):
    rows = []
    for res in args.res:
        for ci, co, h, k, res_on in shapes(res)[:args.limit]:
            g = torch.Generator().manual_seed(h + k)
            x = _nhwc(torch.randn(1, ci, h, h, generator=g).to(device, torch.bfloat16))
            w = _nhwc((torch.randn(co, ci, k, k, generator=g) / (ci * k * k) ** 0.5).to(device, torch.bfloat16))
            b = torch.randn(co, generator=g).to(device, torch.bfloat16)
            r = _nhwc(torch.randn(1, co, h, h, generator=g).to(device, torch.bfloat16)) if res_on else None
            cfg = args.config or _table_config(x, w, b, r)
            if not cfg or cfg.get("route") != TMA:
                print(f"skip {ci}->{co} {k}x{k} @{h}: {cfg and cfg.get('route')} route")
                continue
            out = {io: _nhwc(torch.empty(1, co, h, h, device=device, dtype=torch.bfloat16)) for io in (True, False)}
            fns = [lambda io=io: functional.conv2d(x, w, b, 1, k // 2, residual=r, out=out[io], config={**cfg, "tma_io": io})
                   for io in (True, False)]
            for f in fns:
                f()
            ours, theirs = interleaved_ms(fns, rounds=args.rounds)
            rows.append({"name": f"conv {ci}->{co} {k}x{k} @{h}^2{' +residual' if res_on else ''}",
                         "baseline": "pointer epilogue", "baseline_ms": theirs, "ours_ms": ours,
                         "speedup": theirs / ours, "bit_equal": bool(torch.equal(out[True], out[False])),
                         "config": cfg})
    return rows


def pointer_table(arch):
    """The packaged table of ``arch`` with every TMA config's epilogue set
    to the pointer one."""
    from conv_patch.routing import tables as config_tables
    data = copy.deepcopy(config_tables.packaged_table(arch).data)
    for sec in data.values():
        if not isinstance(sec, dict):
            continue
        cfgs = list((sec.get("exact") or {}).values()) + [b["config"] for b in sec.get("buckets") or []]
        for cfg in cfgs + ([sec["any"]] if "any" in sec else []):
            if cfg.get("route") == TMA:
                cfg["tma_io"] = False
    return data


def decode_rows(args, device):
    import conv_patch
    from conv_patch.target import target_for

    from .vae import bench_variants, flux_vae
    decode, _, vae, lat = flux_vae(torch.bfloat16)
    other = copy.deepcopy(vae)
    conv_patch.apply(vae)
    conv_patch.apply(other, config=conv_patch.PatchConfig(table=pointer_table(target_for(device).arch)))
    rows = []
    for res in args.decode:
        g = torch.Generator().manual_seed(res)
        zs = [torch.randn(1, lat, res // 8, res // 8, generator=g).to(device, torch.bfloat16) for _ in range(2)]
        with torch.inference_mode():
            same = torch.equal(decode(vae, zs[0]), decode(other, zs[0]))
        times, _ = bench_variants({"boxed": (lambda z: decode(vae, z), zs, None),
                                   "pointer": (lambda z: decode(other, z), zs, None)}, args.runs)
        rows.append({"name": f"flux decode {res}x{res}", "baseline": "pointer epilogue",
                     "baseline_ms": times["pointer"], "ours_ms": times["boxed"],
                     "speedup": times["pointer"] / times["boxed"], "bit_equal": bool(same), "runs": args.runs})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--res", type=int, nargs="*", default=[1024, 2048], help="image sizes of the per-conv rows")
    ap.add_argument("--limit", type=int, default=None, help="at most this many convs per size")
    ap.add_argument("--config", type=json.loads, default=None,
                    help="a TMA config (JSON) for every conv instead of the table's (the tests' tiny shapes)")
    ap.add_argument("--decode", type=int, nargs="*", default=[], help="image sizes of whole FLUX.1 decodes")
    ap.add_argument("--runs", type=int, default=10)
    args, device, _ = side_by_side_setup(ap, argv)
    rows = layer_rows(args, device)
    if args.decode:
        write_results("tma_epilogue", rows, {}, args.out)
        rows += decode_rows(args, device)
    path = write_results("tma_epilogue", rows, {}, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "bit_equal"])
    print("wrote", path)


if __name__ == "__main__":
    main()
