"""Video VAE decode: a Wan-family VAE (``--model``: ``wan2.1``, diffusers'
default ``AutoencoderKLWan``; ``wan2.2``, the TI2V-5B VAE's config;
``qwen-image``, the default ``AutoencoderKLQwenImage`` on single frames;
``hunyuan-video``, ``ltx-video``, ``cogvideox`` and ``mochi``, diffusers'
default HunyuanVideo, LTX-Video, CogVideoX and Mochi 1 VAEs (the last two at
their pipelines' default clips); random seeded weights, bf16) unpatched vs patched, and the decoder's Conv3d
calls one by one: the Conv3d kernel against what the module runs (the cached
frames concatenated, ``F.pad``, cuDNN's conv3d).

    python -m bench.video [--model wan2.1] [--frames F --height H --width W] [--runs 3]
                          [--layers] [--write-table configs/sm90.json] [--profile N] [--host-top N] [--block-peaks]
                          [--flops] [--compile-ahead | --no-ahead] [--tiling] [--tiny]

Model rows: ``baseline_ms`` (unpatched, launched eagerly), ``ours_ms``
(patched), ``speedup``, ``peak_gib`` / ``baseline_peak_gib``
(``torch.cuda.max_memory_allocated`` above what was allocated before the
call), ``rel_err_vs_unpatched``; medians of ``--runs`` after a warm-up,
the variants interleaved in rotated order. ``--tiling`` decodes both with
diffusers' tiled path (``vae.enable_tiling()``, the class's default tiles;
under ``--tiny``, ``enable_tiling``'s tiles of two latent pixels over a 3x2
latent, tested on LTX-Video's config), the row named ``... tiled``, with
the tile size in pixels (``tile``).

``--layers`` adds one row per distinct Conv3d call of a patched decode (the
module's geometry, its input and cached frames), measured by
``tune.measure_conv3d``: every candidate tile of the kernel (the route
registry's, cache and causal padding read in place, checked against exact
fp32) against the cuDNN route the dispatch core runs where it does not take
the kernel (``conv3d.cudnn_conv3d``), GPU times; ``baseline_ms`` that
route's, ``module_ms`` the module's own forward (cat, F.pad, cuDNN),
``ours_ms`` the best tile's. ``--write-table`` merges them into a
config table as its ``conv3d`` entries, the measurements the dispatch core
needs before it takes the kernel for a shape on a GPU (docs/design.md,
"Conv3d"). ``--host-top N`` adds the host time of an unpatched and a patched decode,
the N Python functions of each taking the most (cProfile): where a
host-bound decode's time goes. ``--block-peaks`` records each decoder block's peak memory (above what was
allocated at its call), unpatched and patched: where a patched decode's
peak grows. ``--tiny`` runs a tiny config on the CPU (the test of this
script's logic; times mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from typing import Optional

import torch

from .common import (PEAK_TFLOPS, bench_device, env_info, host_top, launched_call, print_table, profile_top, rotated,
                     write_results)
from conv_patch.runtime.state import state_of

TINY = dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[True],
            dropout=0.0)
# (diffusers class, config, default clip (frames, height, width)). Wan 2.1
# and Qwen-Image are their classes' defaults; Wan 2.2 is the TI2V-5B VAE
# (48 latent channels, 2x2 patches, 16x spatial compression, residual
# up/down blocks), the architecture keys of Wan-AI/Wan2.2-TI2V-5B-Diffusers'
# vae/config.json (the others are AutoencoderKLWan's defaults there too).
MODELS = {
    "wan2.1": ("AutoencoderKLWan", {}, (81, 480, 832)),
    "wan2.2": ("AutoencoderKLWan", dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4],
                                        num_res_blocks=2, temperal_downsample=[False, True, True],
                                        is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                                        scale_factor_temporal=4, scale_factor_spatial=16), (121, 704, 1280)),
    "qwen-image": ("AutoencoderKLQwenImage", {}, (1, 1024, 1024)),
    # No conv3d table entries of their own: their resnets' recipes and the
    # GroupNorm / RMS-norm kernels, their Conv3d calls on cuDNN.
    "hunyuan-video": ("AutoencoderKLHunyuanVideo", {}, (17, 320, 512)),
    "ltx-video": ("AutoencoderKLLTXVideo", {}, (25, 512, 768)),
    # The pipelines' default clips (CogVideoXPipeline, MochiPipeline).
    "cogvideox": ("AutoencoderKLCogVideoX", {}, (49, 480, 720)),
    "mochi": ("AutoencoderKLMochi", {}, (19, 480, 848)),
}
TINY_CLIPS = {"hunyuan-video": (5, 32, 32, 5), "ltx-video": (9, 32, 32, 9), "cogvideox": (5, 16, 24, 5),
              "mochi": (1, 16, 16, 1)}
# --tiny configs of the classes whose Wan-family TINY does not fit.
TINY_OTHER = {
    "hunyuan-video": dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=4),
    "ltx-video": dict(block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8), latent_channels=4,
                      layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5),
    "cogvideox": dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, norm_num_groups=4, layers_per_block=1),
    "mochi": dict(encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4, latent_channels=4,
                  layers_per_block=(1,) * 5),
}


def new_vae(model: str, tiny: bool):
    """A fresh ``model`` VAE (its tiny config with ``tiny``), built on the
    current default device (the meta device: shapes, no weights)."""
    import diffusers
    cls, cfg, _ = MODELS[model]
    return getattr(diffusers, cls)(**((TINY_OTHER.get(model, TINY)) if tiny else cfg))


def build_vae(model: str, tiny: bool, device, dtype):
    torch.manual_seed(0)
    return new_vae(model, tiny).to(device=device, dtype=dtype).eval()


def decode_flops(model: str, frames: int, height: int, width: int, tiny: bool = False) -> dict:
    """The arithmetic of one decode of the clip, counted on the meta device
    (no GPU, no memory: ``torch.utils.flop_counter``): ``decode_tflop`` in
    all, ``conv_tflop`` in its convolutions, and ``floor_ms``, the time the
    whole decode's arithmetic takes at ``PEAK_TFLOPS``, a bound no decode
    at that rate can beat."""
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device("meta"):
        vae = new_vae(model, tiny).to(torch.bfloat16).eval()
    z = latents(vae, frames, height, width, torch.device("meta"), torch.bfloat16)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.decode(z)
    counts = counter.get_flop_counts()["Global"]
    total = sum(counts.values())
    conv = sum(v for k, v in counts.items() if "convolution" in str(k))
    return {"decode_tflop": total / 1e12, "conv_tflop": conv / 1e12, "peak_tflops": PEAK_TFLOPS,
            "floor_ms": total / (PEAK_TFLOPS * 1e12) * 1e3}


def enable_tiling(vae, tiny: bool) -> Optional[tuple]:
    """``vae.enable_tiling()`` as a user calls it (the class's default
    tiles); ``tiny``: tiles of two latent pixels, a stride of one (in the
    spatial compression the class states). Returns the clip's (height,
    width) ``tiny`` needs for tiles along both axes (None: any)."""
    if not tiny:
        vae.enable_tiling()
        return None
    r = getattr(vae, "spatial_compression_ratio", None) or 8
    vae.enable_tiling(tile_sample_min_height=2 * r, tile_sample_min_width=2 * r, tile_sample_stride_height=r,
                      tile_sample_stride_width=r)
    return 3 * r, 2 * r


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def latents(vae, frames: int, height: int, width: int, device, dtype):
    """The latent of a ``frames``-frame clip (1 + 4k frames: the causal VAE
    keeps the first frame apart)."""
    if "z_dim" in vae.config:  # the Wan family
        t_down = 2 ** sum(vae.config.temperal_downsample)
        s = vae.config.get("scale_factor_spatial") or 2 ** (len(vae.config.dim_mult) - 1)
        ch = vae.config.z_dim
    else:  # HunyuanVideo, LTX-Video, Mochi; CogVideoX keeps its ratios in its config
        cfg = vae.config
        t_down = cfg.get("temporal_compression_ratio") or vae.temporal_compression_ratio
        s = getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(cfg.block_out_channels) - 1)
        ch = cfg.latent_channels
    g = torch.Generator(device="cpu").manual_seed(frames)
    shape = (1, ch, 1 + (frames - 1) // t_down, height // s, width // s)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def model_row(vae, z, runs: int, warmup: int, device, compile_ahead: bool = False, ahead: bool = True) -> dict:
    """The decode row; ``compile_ahead``: the patched model's first call is
    ``conv_patch.warmup(vae.decode, z, calls=1)`` (its kernels compiled
    side by side first, as the first decode of every VAE here does by
    itself), its time ``first_call_s`` and the pass alone
    ``first_call_compile_s``. Without it ``first_call_s`` is the hooked
    first decode's; ``ahead=False`` patches with
    ``PatchConfig(compile_ahead=False)`` (nothing hooked: the first decode
    compiles as its launches reach the kernels)."""
    import conv_patch
    patched = copy.deepcopy(vae)
    report = conv_patch.apply(patched, config=conv_patch.PatchConfig(compile_ahead=ahead))
    variants = {"unpatched": vae, "patched": patched}
    times = {k: [] for k in variants}
    peaks = {}
    outs = {}
    first = {}
    extra = {}
    if compile_ahead:
        _sync(device)
        t0 = time.perf_counter()
        extra["first_call_compile_s"] = conv_patch.warmup(patched.decode, z, calls=1).compile_ahead_s
        _sync(device)
        first["patched"] = time.perf_counter() - t0
    with torch.no_grad():
        for i in range(warmup + runs):
            for j in rotated(len(variants), i):
                name = list(variants)[j]
                y, ms, peaks[name] = launched_call(lambda: variants[name].decode(z).sample, device)
                first.setdefault(name, ms / 1e3)
                if i >= warmup:
                    times[name].append(ms)
                outs[name] = y
                del y
    ref, y = outs["unpatched"].float(), outs["patched"].float()
    base_ms, ours_ms = statistics.median(times["unpatched"]), statistics.median(times["patched"])
    tiled = bool(getattr(vae, "use_tiling", False))
    return {"name": f"{vae.__class__.__name__} decode {tuple(z.shape)} {str(z.dtype).split('.')[-1]}"
                    + (" tiled" if tiled else ""), "tiling": tiled,
            "tile": [getattr(vae, "tile_sample_min_height", None), getattr(vae, "tile_sample_min_width", None)]
            if tiled else None,
            "baseline": "unpatched, launched eagerly", "baseline_ms": base_ms, "ours_ms": ours_ms,
            "speedup": base_ms / ours_ms, "first_call_s": first["patched"], **extra,
            "baseline_first_call_s": first["unpatched"], "peak_gib": peaks.get("patched"),
            "baseline_peak_gib": peaks.get("unpatched"),
            "rel_err_vs_unpatched": ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item(),
            "patched_convs": len(report.patched), "skipped_convs": len(report.skipped),
            "fused_blocks": len(report.fused), "conv_routes": _routes(patched)}


def profile_decode(vae, z, device, top: int) -> list:
    """The ``top`` largest GPU kernels of one patched decode (after one
    unprofiled warm-up), printed as a table and returned."""
    import conv_patch
    patched = copy.deepcopy(vae)
    conv_patch.apply(patched)
    with torch.no_grad():
        patched.decode(z)
        rows = profile_top(lambda: patched.decode(z), device, top)
    print_table(rows, ["kernel", "calls", "ms", "share"])
    return rows


def host_profile(vae, z, top: int, calls: int = 3) -> dict:
    """Where the host time of a decode goes, unpatched and patched: each
    one's ``top`` Python functions by their own time per decode
    (``common.host_top``, ``calls`` decodes after a warm-up), printed and
    returned as ``{"baseline": rows, "ours": rows}``. For a decode bound by
    the host (a tiled one's small calls), where the patched one spends
    what it adds."""
    import conv_patch
    patched = copy.deepcopy(vae)
    conv_patch.apply(patched)
    out = {}
    with torch.no_grad():
        for key, m in (("baseline", vae), ("ours", patched)):
            m.decode(z)
            out[key] = host_top(lambda: m.decode(z), calls=calls, top=top)
            print(f"host time of one decode, {key}:")
            print_table(out[key], ["function", "calls", "ms"])
    return out


def _allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _block_peaks_of(model, z, device, depth: int) -> dict:
    """{decoder block name: (peak GiB above what was allocated at its call,
    GiB it left allocated)} of one decode, for the decoder's modules up to
    ``depth`` dots deep (the first call of each, in call order; on the CPU
    the peaks are zeros). The allocator's peak is reset at every block's
    start and end, so every enclosing block still open takes the peak read
    just before the reset into its own."""
    cuda = device.type == "cuda"
    seen, start, open_peaks, hooks = {}, {}, {}, []

    def fold():
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            for name in open_peaks:
                open_peaks[name] = max(open_peaks[name], peak)
            torch.cuda.reset_peak_memory_stats(device)

    def pre(name):
        def hook(mod, args):
            fold()
            start[name] = open_peaks[name] = _allocated(device)
            seen.setdefault(name, None)  # (call order)
        return hook

    def post(name):
        def hook(mod, args, out):
            fold()
            peak = open_peaks.pop(name, start[name])
            if seen.get(name) is None:
                seen[name] = ((peak - start[name]) / 2 ** 30, (_allocated(device) - start[name]) / 2 ** 30)
        return hook

    for name, mod in model.decoder.named_modules():
        if name and name.count(".") < depth:
            hooks += [mod.register_forward_pre_hook(pre(name)), mod.register_forward_hook(post(name))]
    try:
        with torch.no_grad():
            model.decode(z)
    finally:
        for h in hooks:
            h.remove()
    return {name: v for name, v in seen.items() if v is not None}


def block_peaks(vae, z, device, depth: int = 3) -> list:
    """Where a patched decode's peak memory differs from the unpatched
    one's: per decoder block (``depth`` levels), the peak above what was
    allocated when the block was called, unpatched and patched (each model
    warmed up by one decode first), blocks in call order. A block whose
    ``extra_gib`` is positive holds more at its peak patched."""
    import conv_patch
    patched = copy.deepcopy(vae)
    conv_patch.apply(patched)
    peaks = {}
    for label, model in (("unpatched", vae), ("patched", patched)):
        with torch.no_grad():
            model.decode(z)
        peaks[label] = _block_peaks_of(model, z, device, depth)
    rows = []
    for name, (base_peak, base_held) in peaks["unpatched"].items():
        ours = peaks["patched"].get(name)
        if ours is not None:
            rows.append({"block": name, "baseline_peak_gib": base_peak, "peak_gib": ours[0],
                         "extra_gib": ours[0] - base_peak, "baseline_held_gib": base_held, "held_gib": ours[1]})
    return rows


def _routes(model) -> dict:
    out = {}
    for m in model.modules():
        last = state_of(m).last
        if last is not None:
            out[last.label()] = out.get(last.label(), 0) + 1
    return out


def conv_calls(vae, z) -> list:
    """(module, x, cache, pads) of every distinct Conv3d call of one patched
    decode, by geometry: the dispatch core's Conv3d entry, spied on."""
    import conv_patch
    from conv_patch.runtime import dispatch
    patched = copy.deepcopy(vae)
    conv_patch.apply(patched)
    seen, calls = set(), []
    real = dispatch.conv3d

    def spy(m, call):
        x, cache, pads = call.x, call.cache, call.pads
        key = (m.spec, tuple(x.shape), x.stride(), None if cache is None else tuple(cache.shape), pads)
        if key not in seen:
            seen.add(key)
            calls.append((m, x.clone(), None if cache is None else cache.clone(), pads or m.spec.pads))
        return real(m, call)

    dispatch.conv3d = spy
    try:
        with torch.no_grad():
            patched.decode(z)
    finally:
        dispatch.conv3d = real
    return calls


def layer_measurements(vae, z, device, limit: int = 0, layout: str = "ncdhw", measured=None) -> list:
    """``tune.measure_conv3d`` of the distinct Conv3d calls (``limit`` > 0:
    those with cached frames first, then the others, at most ``limit``):
    each candidate tile of the kernel against the cuDNN route (and the
    module's own forward). ``layout="ndhwc"``: each call's input and cached frames as
    channels_last_3d copies (what a decoder running NDHWC inside would
    pass: the TMA kernel's layout, and cuDNN's without its transposes).
    ``measured(meas)``, when given, is called after each call is timed."""
    from conv_patch.routing import tables as config_tables, registry as routes
    from conv_patch.tools import tune
    from conv_patch.target import target_for
    cands = routes.tuner_candidates(target_for(device), "conv3d")
    calls = conv_calls(vae, z)
    if limit:
        calls = sorted(calls, key=lambda c: c[2] is None)[:limit]
    out, keys = [], set()
    for m, x, cache, pads in calls:
        if layout == "ndhwc":
            x = x.contiguous(memory_format=torch.channels_last_3d)
            cache = None if cache is None else cache.contiguous(memory_format=torch.channels_last_3d)
        spec = dataclasses.replace(m.spec, pads=pads)  # the call's padding: what the dispatch core keys
        key = config_tables.conv3d_call_key(spec, x, cache)
        if key in keys:
            continue  # another module of the same geometry on the same input: one table key
        keys.add(key)
        w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()

        def theirs(m=m, x=x, cache=cache):
            return m.cp_fallback_forward(m, x, cache) if cache is not None else m.cp_fallback_forward(m, x)

        with torch.no_grad():
            meas = tune.measure_conv3d(spec, x, cache, w, b, theirs, cands)
        out.append(meas)
        if measured is not None:
            measured(meas)
        best = meas.times.get(meas.best) if meas.best else None
        print(f"{meas.name}: cuDNN route {meas.cudnn_ms:.3f} ms (module {meas.module_ms:.3f}), best tile {meas.best} "
              f"{'-' if best is None else f'{best:.3f} ms (x{meas.cudnn_ms / best:.2f})'}", flush=True)
    return out


def layer_row(meas) -> dict:
    best = meas.times.get(meas.best) if meas.best else None
    return {"name": meas.name, "key": meas.key,
            "baseline": "the cuDNN route (conv3d.cudnn_conv3d: one cat, cuDNN's padding, the epilogue pass)",
            "baseline_ms": meas.cudnn_ms, "module_ms": meas.module_ms, "ours_ms": best, "best": meas.best,
            "speedup": (meas.cudnn_ms / best) if best else None, "times": meas.times, "rejected": meas.rejected}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="wan2.1")
    ap.add_argument("--frames", type=int, default=None, help="default: the model's usual clip")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", action="store_true", help="also time each distinct Conv3d call")
    ap.add_argument("--layer-frames", type=int, default=5, help="clip length of the --layers decode")
    ap.add_argument("--write-table", default=None, metavar="JSON",
                    help="merge the --layers measurements into this config table as conv3d entries "
                         "(e.g. configs/sm90.json)")
    ap.add_argument("--max-layers", type=int, default=0, help="at most this many --layers rows (0: all)")
    ap.add_argument("--layout", choices=("ncdhw", "ndhwc"), default="ncdhw",
                    help="the --layers inputs' layout (ndhwc: channels_last_3d copies, the TMA kernel's)")
    ap.add_argument("--no-decode", action="store_true", help="--layers alone, without the end-to-end row")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile one patched decode: its N largest GPU kernels by total time")
    ap.add_argument("--host-top", type=int, default=0, metavar="N",
                    help="also profile the host time of one unpatched and one patched decode: the N Python "
                         "functions of each taking the most")
    ap.add_argument("--block-peaks", action="store_true",
                    help="also each decoder block's peak memory, unpatched and patched (where a patched peak grows)")
    ap.add_argument("--flops", action="store_true",
                    help="also count the decode's arithmetic (meta device) and its time at the bf16 peak")
    ap.add_argument("--compile-ahead", action="store_true",
                    help="the patched first call is conv_patch.warmup(vae.decode, z, calls=1)")
    ap.add_argument("--no-ahead", action="store_true",
                    help="patch with PatchConfig(compile_ahead=False): the first decode compiles as it goes")
    ap.add_argument("--tiling", action="store_true",
                    help="decode through diffusers' tiled path (vae.enable_tiling()), unpatched and patched")
    ap.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (the tests)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--name", default=None, help="result file stem (default video-<model>)")
    args = ap.parse_args(argv)
    device = bench_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    frames, height, width = MODELS[args.model][2]
    args.frames, args.height, args.width = args.frames or frames, args.height or height, args.width or width
    if args.tiny:
        # Latents of a few pixels (LTX-Video compresses 32x in space and 8x
        # in time; HunyuanVideo's GroupNorms over a 1-pixel latent amplify
        # rounding without bound).
        args.frames, args.height, args.width, args.layer_frames = TINY_CLIPS.get(args.model, (3, 8, 8, 3))
        args.max_layers = args.max_layers or 6
    # (--flops --no-decode alone needs no model of its own: it counts on the meta device.)
    timed = (not args.no_decode or args.profile or args.host_top or args.layers or args.write_table
             or args.block_peaks)
    vae = build_vae(args.model, args.tiny, device, dtype) if timed else None
    if vae is not None and args.tiling:
        clip = enable_tiling(vae, args.tiny)
        if clip is not None:
            args.height, args.width = clip
    rows = []
    extra = {"model": args.model, "frames": args.frames, "height": args.height, "width": args.width,
             "layers_layout": args.layout}

    if args.flops:
        extra.update(decode_flops(args.model, args.frames, args.height, args.width, args.tiny))
        print(f"{args.model} {args.frames} frames at {args.height}x{args.width}: {extra['decode_tflop']:.1f} TFLOP "
              f"({extra['conv_tflop']:.1f} in convolutions), {extra['floor_ms']:.0f} ms at {PEAK_TFLOPS:.0f} TF/s",
              flush=True)

    def save():
        # Written after each row: an 81-frame decode and its layers take
        # minutes, and a run cut by its time limit keeps what it measured.
        layer = [r["speedup"] for r in rows[0 if args.no_decode else 1:] if r.get("speedup")]
        if layer:
            extra["layer_geomean_speedup"] = statistics.geometric_mean(layer)
        return write_results(args.name or f"video-{args.model}", rows, extra, args.out)

    if not args.no_decode:
        rows.append(model_row(vae, latents(vae, args.frames, args.height, args.width, device, dtype), args.runs,
                              args.warmup, device, compile_ahead=args.compile_ahead, ahead=not args.no_ahead))
        print(f"{rows[0]['name']}: unpatched {rows[0]['baseline_ms']:.1f} ms, patched {rows[0]['ours_ms']:.1f} "
              f"ms (x{rows[0]['speedup']:.2f}), peak {rows[0]['peak_gib']} / {rows[0]['baseline_peak_gib']} GiB",
              flush=True)
        save()
    if args.profile:
        extra["profile"] = profile_decode(vae, latents(vae, args.frames, args.height, args.width, device, dtype),
                                          device, args.profile)
        save()
    if args.host_top:
        extra["host_top"] = host_profile(vae, latents(vae, args.frames, args.height, args.width, device, dtype),
                                         args.host_top)
        save()
    if args.block_peaks:
        extra["block_peaks"] = block_peaks(vae, latents(vae, args.frames, args.height, args.width, device, dtype),
                                           device)
        worst = sorted(extra["block_peaks"], key=lambda r: -r["extra_gib"])[:12]
        print_table(worst, ["block", "baseline_peak_gib", "peak_gib", "extra_gib"])
        save()
    if args.layers or args.write_table:
        z = latents(vae, args.layer_frames, args.height, args.width, device, dtype)

        def layer_done(meas):
            rows.append(layer_row(meas))
            save()

        measured = layer_measurements(vae, z, device, args.max_layers, args.layout, measured=layer_done)
        if args.write_table:
            from conv_patch.tools import tune
            with open(args.write_table) as f:
                table = json.load(f)
            tune.write_table(tune.merge_conv3d(table, measured, f"bench.video --model {args.model} --layers "
                                               f"--layout {args.layout}: {len(measured)} Conv3d calls of a "
                                               f"{args.layer_frames}-frame {args.height}x{args.width} decode, "
                                               f"{str(dtype).split('.')[-1]}, on {env_info()['gpu']}"),
                             args.write_table)
            print("conv3d entries written to", args.write_table)
    path = save()
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
