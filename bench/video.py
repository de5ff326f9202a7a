"""Video VAE decode: a Wan-2.1-config ``AutoencoderKLWan`` (diffusers'
default config, random seeded weights, bf16) unpatched vs patched, and the
decoder's Conv3d calls one by one: the Conv3d kernel against what the
module runs (the cached frames concatenated, ``F.pad``, cuDNN's conv3d).

    python -m bench.video [--frames 81] [--height 480] [--width 832] [--runs 3] [--layers] [--tiny]

Model rows: ``baseline_ms`` (unpatched, launched eagerly), ``ours_ms``
(patched), ``speedup``, ``peak_gib`` / ``baseline_peak_gib``
(``torch.cuda.max_memory_allocated`` above what was allocated before the
call), ``rel_err_vs_unpatched``; medians of ``--runs`` after a warm-up,
the variants interleaved in rotated order.

``--layers`` adds one row per distinct Conv3d call of a patched decode (the
module's geometry, its input and cached frames): ``baseline_ms`` the
module's own forward, ``ours_ms`` ``ops.conv3d(route="kernel")`` with the
cache and the causal padding read in place, ``rel_err`` between them. These
are the measurements a conv3d table entry needs before the dispatch core
takes the kernel on a GPU (docs/design.md, "Conv3d"). ``--tiny`` runs a tiny
config on the CPU (the test of this script's logic; times mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from .common import bench_device, print_table, rotated, time_ms, write_results

TINY = dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[True],
            dropout=0.0)


def build_vae(tiny: bool, device, dtype):
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**TINY) if tiny else AutoencoderKLWan()
    return vae.to(device=device, dtype=dtype).eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def latents(vae, frames: int, height: int, width: int, device, dtype):
    """The latent of a ``frames``-frame clip (1 + 4k frames: the causal VAE
    keeps the first frame apart)."""
    t_down = 2 ** sum(vae.config.temperal_downsample)
    s = 2 ** (len(vae.config.dim_mult) - 1)
    g = torch.Generator(device="cpu").manual_seed(frames)
    shape = (1, vae.config.z_dim, 1 + (frames - 1) // t_down, height // s, width // s)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def model_row(vae, z, runs: int, warmup: int, device) -> dict:
    import conv_patch
    patched = copy.deepcopy(vae)
    report = conv_patch.apply(patched)
    variants = {"unpatched": vae, "patched": patched}
    times = {k: [] for k in variants}
    peaks = {}
    outs = {}
    with torch.no_grad():
        for i in range(warmup + runs):
            for j in rotated(len(variants), i):
                name = list(variants)[j]
                _sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                t = time.perf_counter()
                y = variants[name].decode(z).sample
                _sync(device)
                ms = (time.perf_counter() - t) * 1e3
                if device.type == "cuda":
                    peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                if i >= warmup:
                    times[name].append(ms)
                outs[name] = y
                del y
    ref, y = outs["unpatched"].float(), outs["patched"].float()
    base_ms, ours_ms = statistics.median(times["unpatched"]), statistics.median(times["patched"])
    return {"name": f"wan2.1-vae-decode {tuple(z.shape)} {str(z.dtype).split('.')[-1]}",
            "baseline": "unpatched, launched eagerly", "baseline_ms": base_ms, "ours_ms": ours_ms,
            "speedup": base_ms / ours_ms, "peak_gib": peaks.get("patched"),
            "baseline_peak_gib": peaks.get("unpatched"),
            "rel_err_vs_unpatched": ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item(),
            "patched_convs": len(report.patched), "skipped_convs": len(report.skipped),
            "conv_routes": _routes(patched)}


def _routes(model) -> dict:
    out = {}
    for m in model.modules():
        last = m.__dict__.get("_cp_last")
        if last is not None:
            out[last.label()] = out.get(last.label(), 0) + 1
    return out


def conv_calls(vae, z) -> list:
    """(module, x, cache, pads) of every distinct Conv3d call of one patched
    decode, by geometry: the dispatch core's Conv3d entry, spied on."""
    import conv_patch
    from conv_patch import dispatch
    patched = copy.deepcopy(vae)
    conv_patch.apply(patched)
    seen, calls = set(), []
    real = dispatch.conv3d

    def spy(m, x, eager_forward, cache=None, pads=None, **kw):
        key = (m.spec, tuple(x.shape), x.stride(), None if cache is None else tuple(cache.shape), pads)
        if key not in seen:
            seen.add(key)
            calls.append((m, x.clone(), None if cache is None else cache.clone(), pads or m.spec.pads))
        return real(m, x, eager_forward, cache=cache, pads=pads, **kw)

    dispatch.conv3d = spy
    try:
        with torch.no_grad():
            patched.decode(z)
    finally:
        dispatch.conv3d = real
    return calls


def layer_rows(vae, z, rounds: int, device, limit: int = 0) -> list:
    """Rows of the distinct Conv3d calls (``limit`` > 0: those with cached
    frames first, then the others, at most ``limit``)."""
    from conv_patch import ops
    rows = []
    calls = conv_calls(vae, z)
    if limit:
        calls = sorted(calls, key=lambda c: c[2] is None)[:limit]
    for m, x, cache, pads in calls:
        s = m.spec
        w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()

        def theirs():
            return m._cp_fallback_forward(m, x, cache) if cache is not None else m._cp_fallback_forward(m, x)

        def ours():
            return ops.conv3d(x, w, b, s.stride, pads, s.dilation, cache=cache, route="kernel")

        with torch.no_grad():
            y, ref = ours(), theirs()
            samples = {"ours": [], "theirs": []}
            fns = [("ours", ours), ("theirs", theirs)]
            for r in range(rounds):
                for j in rotated(2, r):
                    samples[fns[j][0]].append(time_ms(fns[j][1]))
        o, t = statistics.median(samples["ours"]), statistics.median(samples["theirs"])
        tc = 0 if cache is None else cache.shape[2]
        rows.append({"name": f"conv3d {s.describe()} on {tuple(x.shape)} cache {tc}",
                     "baseline": "the module's forward (cat, F.pad, cuDNN conv3d)", "baseline_ms": t,
                     "ours_ms": o, "speedup": t / o,
                     "rel_err": ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()})
        print(f"{rows[-1]['name']}: cuDNN path {t:.3f} ms, kernel {o:.3f} ms (x{t / o:.2f})", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", action="store_true", help="also time each distinct Conv3d call")
    ap.add_argument("--layer-frames", type=int, default=5, help="clip length of the --layers decode")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per --layers row")
    ap.add_argument("--max-layers", type=int, default=0, help="at most this many --layers rows (0: all)")
    ap.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (the tests)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--name", default="video", help="result file stem")
    args = ap.parse_args(argv)
    device = bench_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.frames, args.height, args.width, args.layer_frames = 3, 8, 8, 3
        args.max_layers = args.max_layers or 6
    vae = build_vae(args.tiny, device, dtype)
    rows = [model_row(vae, latents(vae, args.frames, args.height, args.width, device, dtype), args.runs,
                      args.warmup, device)]
    print(f"{rows[0]['name']}: unpatched {rows[0]['baseline_ms']:.1f} ms, patched {rows[0]['ours_ms']:.1f} ms "
          f"(x{rows[0]['speedup']:.2f}), peak {rows[0]['peak_gib']} / {rows[0]['baseline_peak_gib']} GiB",
          flush=True)
    if args.layers:
        z = latents(vae, args.layer_frames, args.height, args.width, device, dtype)
        rows += layer_rows(vae, z, args.rounds, device, args.max_layers)
    layer = [r["speedup"] for r in rows[1:]]
    extra = {"frames": args.frames, "height": args.height, "width": args.width}
    if layer:
        extra["layer_geomean_speedup"] = statistics.geometric_mean(layer)
    path = write_results(args.name, rows, extra, args.out)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
