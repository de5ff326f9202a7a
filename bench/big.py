"""Decode at large sizes: a FLUX-config AutoencoderKL decode (random seeded
weights, bf16) un-banded patched, in bands within ``max_activation_gib``,
eager PyTorch and diffusers' ``enable_tiling()``, each against an un-tiled
reference.

    python -m bench.big [--sizes 2048 4096 8192] [--gib [20 3 ...]] [--runs 3] [--skip eager tiling] [--world N] [--tiny]

Per size and variant one row: ``ours_ms`` (median of ``--runs`` after a
warm-up call), ``baseline_ms`` (eager PyTorch bf16, None where it ran out of
memory: ``eager_oom``), ``speedup``, ``peak_gib``
(``torch.cuda.max_memory_allocated`` during the call, above what was
allocated before it), and the error against the reference (the fp32 eager
decode up to ``--fp32-ref-max`` pixels a side where it fits, else the
un-banded patched decode): ``max_abs``,
``mean_abs``, ``max_rel`` (max abs over the reference's max magnitude),
``mean_rel`` (mean abs over its mean magnitude), ``ref``. An error map (the
channel-mean absolute error, brightest = the variant's max) is saved as a PNG
beside the JSON for each variant with an error.

``--world N`` runs ``conv_patch.parallel.decode`` over N GPUs under torchrun
(started here when not already under it, with ``NCCL_NVLS_ENABLE=0`` unless
set): the patched model and, beside it, the unpatched one
(``parallel-N-kernels-off``), each against rank 0's one-GPU patched decode
(``baseline_ms`` and the error reference; ``one_gpu_peak_gib`` its peak);
rows carry ``gpus``, ``world_size``, ``exchanged_bytes`` (what all ranks
sent each other per decode), ``peak_gib`` (the largest rank's) and
``vs_kernels_off``. Rank 0 writes the JSON. ``--tiny`` runs a tiny config on the CPU
(the test of this script's logic, with nothing patched; times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .common import RESULTS, launched_call, print_table, write_results

FLUX = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
            layers_per_block=2, norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False, use_post_quant_conv=False)
TINY = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
            norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2)


def build_vae(tiny: bool, device, dtype):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    cfg = TINY if tiny else FLUX
    # (tiny: 8-pixel tiles, so enable_tiling() does tile a 16-pixel image)
    return AutoencoderKL(**cfg, sample_size=8 if tiny else 1024).to(device=device, dtype=dtype).eval()


def patch(vae, tiny: bool):
    """``conv_patch.apply`` with no budget that may band the decode; in
    ``--tiny`` runs nothing is swapped (the logic is what is tested, and the
    interpreter takes tens of seconds for a patched tiny decode)."""
    import conv_patch
    cfg = conv_patch.PatchConfig(max_activation_gib=float("inf"))
    if tiny:
        return conv_patch.apply(vae, filter_fn=lambda m, fqn: False, recipes=False, config=cfg)
    return conv_patch.apply(vae, config=cfg)


def scale_of(vae) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


def measure(fn, device, runs: int, warmup: int):
    """(output, median ms, peak GiB above the memory allocated before) of
    ``fn()``, or (None, None, None) where it runs out of memory."""
    try:
        out = None
        for _ in range(warmup):
            out = fn()
            del out
        times, peaks = [], []
        for _ in range(max(1, runs)):
            out = None
            out, ms, peak = launched_call(fn, device)
            times.append(ms)
            peaks.append(peak)
        return out, statistics.median(times), None if peaks[0] is None else max(peaks)
    except torch.cuda.OutOfMemoryError:
        out = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None, None, None


def errors(y, ref) -> dict:
    d = (y.float() - ref.float()).abs()
    r = ref.float().abs()
    return {"max_abs": d.max().item(), "mean_abs": d.mean().item(),
            "max_rel": (d.max() / r.max().clamp_min(1e-30)).item(),
            "mean_rel": (d.mean() / r.mean().clamp_min(1e-30)).item()}


def error_map(y, ref, path: Path, side: int = 1024) -> None:
    """The channel-mean absolute error of the first sample as a grey PNG
    (at most ``side`` pixels a side, max-pooled so no hot spot is lost)."""
    from PIL import Image
    d = (y[:1].float() - ref[:1].float()).abs().mean(dim=1, keepdim=True)
    k = max(1, -(-max(d.shape[-2:]) // side))
    if k > 1:
        d = torch.nn.functional.max_pool2d(d, k, ceil_mode=True)
    d = d[0, 0]
    img = (d / d.max().clamp_min(1e-30) * 255).round().to(torch.uint8).cpu().numpy()
    Image.fromarray(img, mode="L").save(path)


def _row(name, variant, ms, peak, eager_ms, eager_oom, err, ref_name, **extra):
    row = {"name": f"{name} {variant}", "variant": variant, "baseline": "eager PyTorch bf16",
           "baseline_ms": eager_ms, "ours_ms": ms,
           "speedup": (eager_ms / ms) if (eager_ms and ms) else None, "peak_gib": peak,
           "eager_oom": eager_oom, "ref": ref_name, "gpus": 1, "world_size": 1}
    row.update(err or {})
    row.update(extra)
    return row


def band_fields(reports, first_ms) -> dict:
    """A banded row's report fields: the last call's bands and staging, and
    the first call's time and pinning (the host buffers a staged decode
    pins once and reuses)."""
    if not reports:
        return {}
    r = reports[-1]
    return {"bands": r.bands, "staged": r.staged, "staged_layers": r.staged_layers,
            "device_layers": r.device_layers, "peak_estimate_gib": r.peak_estimate_gib,
            "staged_gib": r.staged_gib, "host_peak_gib": r.host_peak_gib,
            "first_call_ms": first_ms[0] if first_ms else None, "first_call_pin_s": reports[0].pin_seconds}


def bench_size(vae, size: int, args, device, dtype, out_dir: Path, progress=None) -> list:
    """Rows of one size on one device. ``progress(rows)``, when given, is
    called after each variant is timed with a row per variant timed so far
    (``partial``: no error yet, computed once all have run), so that a run
    cut by its time limit keeps what it measured."""
    import conv_patch
    from conv_patch import parallel
    s = size // scale_of(vae)
    ch = vae.config.latent_channels
    g = torch.Generator(device="cpu").manual_seed(size)
    z = torch.randn(1, ch, s, s, generator=g).to(device)
    name = f"flux-vae-decode {size}x{size} b1 {'fp32' if dtype == torch.float32 else 'bf16'}"
    runs, warmup = args.runs, args.warmup

    def decode(m, x):
        with torch.no_grad():
            return m.decode(x).sample

    timed_so_far = []

    def timed(label, fn, variant):
        # Each variant says when it starts and how long it took, and is
        # written at once: at 8192^2 one decode takes seconds (eager
        # PyTorch's minutes), and a run cut short by its time limit still
        # shows how far it got.
        t = time.perf_counter()
        print(f"{name}: {label} ...", flush=True)
        res = measure(fn, device, runs, warmup)
        print(f"{name}: {label}: {time.perf_counter() - t:.1f} s, {res[1]} ms per decode", flush=True)
        timed_so_far.append(_row(name, variant, res[1], res[2], None, res[0] is None and variant == "eager",
                                 None, None, partial=True))
        if progress is not None:
            progress(list(timed_so_far))
        return res

    # Unpatched first: the fp32 reference, eager bf16, diffusers' tiling.
    conv_patch.remove(vae)
    ref, ref_name = None, None
    if size <= args.fp32_ref_max:
        # (Above it the fp32 decode's attention alone takes tens of seconds
        # before the activations run out of memory.)
        ref, _, _ = measure(lambda: decode(vae.float(), z.float()), device, 1, 0)
        ref_name = "fp32 eager" if ref is not None else None
    vae.to(dtype)
    zd = z.to(dtype)
    eager, eager_ms, eager_peak = None, None, None
    if "eager" not in args.skip:
        eager, eager_ms, eager_peak = timed("eager PyTorch", lambda: decode(vae, zd), "eager")
    eager_oom = eager is None and "eager" not in args.skip
    tiled = None
    if "tiling" not in args.skip:
        vae.enable_tiling()
        tiled, tiled_ms, tiled_peak = timed("diffusers enable_tiling()", lambda: decode(vae, zd), "diffusers-tiling")
        vae.disable_tiling()
    del eager
    # Patched: un-banded (no budget may band it), then banded within --gib.
    patch(vae, args.tiny)
    whole, whole_ms, whole_peak = timed("patched, un-banded", lambda: decode(vae, zd), "patched")
    if ref is None and whole is not None:
        ref, ref_name = whole, "un-banded patched"
    budgets = list(args.gib)
    if args.tiny and budgets:
        # The largest budget 3/4 of the plain decode's estimate (a few
        # bands), the others in proportion.
        from conv_patch.parallel.budget import GIB, plain_peak
        from conv_patch.parallel.walker import program_of
        plain = plain_peak(program_of(vae.decoder), tuple(zd.shape), zd.element_size()) / GIB
        budgets = [0.75 * plain * g / max(args.gib) for g in args.gib]
    variants = [("patched", whole, whole_ms, whole_peak, {})]
    for gib in budgets:
        # Each budget its own row: a small one (a few GiB at 2048^2) stages
        # the large layers to pinned host memory, and its report says so.
        reports, first_ms = [], []

        def banded():
            t0 = time.perf_counter()
            with torch.no_grad():
                y, report = parallel.decode_in_bands(vae, zd, max_activation_gib=gib, return_report=True)
            reports.append(report)
            if len(first_ms) == 0:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first_ms.append((time.perf_counter() - t0) * 1e3)
            return y

        variant = f"bands-{gib:.3g}gib"
        bands, bands_ms, bands_peak = timed(f"patched, max_activation_gib={gib:.3g}", banded, variant)
        variants.append((variant, bands, bands_ms, bands_peak, band_fields(reports, first_ms)))
    conv_patch.remove(vae)
    rows = []
    if "tiling" not in args.skip:
        variants.append(("diffusers-tiling", tiled, tiled_ms, tiled_peak, {}))
    for variant, y, ms, peak, extra in variants:
        err = None
        if y is not None and ref is not None and y is not ref:
            err = errors(y, ref)
            error_map(y, ref, out_dir / f"big-{size}-{variant}-errmap.png")
        rows.append(_row(name, variant, ms, peak, eager_ms, eager_oom, err, ref_name,
                         eager_peak_gib=eager_peak, oom=y is None, eager_run="eager" not in args.skip, **extra))
        print(f"{rows[-1]['name']}: {ms if ms is None else round(ms, 2)} ms, peak {peak} GiB, "
              f"eager {eager_ms} ms, err {err}", flush=True)
    return rows


def _distributed(args, out_dir: Path) -> list:
    """Rows of ``parallel.decode`` over the torchrun world (every rank runs
    this; rank 0's rows are written): the patched model, and beside it the
    same parallel decode of the unpatched model (PyTorch's convs and
    GroupNorm, what a parallel VAE without conv-patch runs), both against
    rank 0's one-GPU patched decode (the baseline and the reference)."""
    import copy

    import torch.distributed as dist

    from conv_patch import parallel
    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    vae = build_vae(args.tiny, device, dtype)
    plain = copy.deepcopy(vae)
    patch(vae, args.tiny)
    rows = []

    def reduced(v, op):
        t = torch.tensor([float(v or 0.0)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        return t.item()

    for size in args.sizes:
        s = size // scale_of(vae)
        g = torch.Generator(device="cpu").manual_seed(size)
        z = torch.randn(1, vae.config.latent_channels, s, s, generator=g).to(device=device, dtype=dtype)
        runs = {}
        for variant, model in ((f"parallel-{world}", vae), (f"parallel-{world}-kernels-off", plain)):
            report = {}

            def step():
                with torch.no_grad():
                    y, report["r"] = parallel.decode(model, z, gather=0, return_report=True)
                dist.barrier()
                return y

            y, ms, peak = measure(step, device, args.runs, args.warmup)
            sent = reduced(report["r"].sent_bytes if "r" in report else 0, dist.ReduceOp.SUM)
            runs[variant] = (y, ms, reduced(peak, dist.ReduceOp.MAX) if cuda else None, sent)
        if rank == 0:
            # The baseline and the reference: this rank's one-GPU patched
            # decode (the other ranks wait at the barrier).
            ref, one_ms, one_peak = measure(lambda: vae.decode(z).sample, device, args.runs, args.warmup)
            name = f"flux-vae-decode {size}x{size} b1 {'bf16' if cuda else 'fp32'}"
            off_ms = runs[f"parallel-{world}-kernels-off"][1]
            for variant, (y, ms, peak, sent) in runs.items():
                err = None
                if ref is not None and y is not None:
                    err = errors(y, ref)
                    error_map(y, ref, out_dir / f"big-{size}-{variant}-errmap.png")
                row = _row(name, variant, ms, peak, None, None, err, "one-GPU patched" if ref is not None else None,
                           gpus=world if cuda else 0, world_size=world, oom=y is None, exchanged_bytes=sent,
                           one_gpu_peak_gib=one_peak)
                row.update(baseline="one-GPU patched decode", baseline_ms=one_ms,
                           speedup=(one_ms / ms) if (one_ms and ms) else None,
                           vs_kernels_off=(off_ms / ms) if (off_ms and ms) else None)
                rows.append(row)
                print(row, flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return rows if rank == 0 else []


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--gib", type=float, nargs="*", default=[20.0],
                    help="max_activation_gib of the banded variants, a row each (default 20; none: no banded rows)")
    ap.add_argument("--fp32-ref-max", type=int, default=4096,
                    help="largest size whose reference is the fp32 eager decode (above: the un-banded patched one)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--world", type=int, default=1, help="GPUs for conv_patch.parallel.decode (torchrun)")
    ap.add_argument("--skip", nargs="+", choices=("eager", "tiling"), default=[],
                    help="leave out eager PyTorch (its rows' baseline then None) or diffusers' tiling")
    ap.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (the tests)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--name", default="big", help="result file stem")
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [16] if args.tiny else [2048, 4096, 8192]
    out_dir = Path(args.out or os.environ.get("BENCH_OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.world > 1 and not _under_torchrun():
        # Start this same command under torchrun, one process per GPU.
        import subprocess
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
               "-m", "bench.big", *(argv if argv is not None else sys.argv[1:])]
        # NVLink multicast stays off in every rank (the lent machines' rule).
        env = dict(os.environ)
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        return subprocess.run(cmd, check=True, env=env)
    if args.world > 1:
        rows = _distributed(args, out_dir)
        if not rows:
            return rows
        extra = {"world_size": args.world}
    else:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        vae = build_vae(args.tiny, device, dtype)
        rows = []
        for size in args.sizes:
            done = list(rows)
            rows += bench_size(vae, size, args, device, dtype, out_dir, progress=lambda part: write_results(
                args.name, done + part, {"max_activation_gib": args.gib}, out_dir))
            write_results(args.name, rows, {"max_activation_gib": args.gib}, out_dir)
        extra = {"max_activation_gib": args.gib}
    path = write_results(args.name, rows, extra, out_dir)
    print_table(rows, ["name", "baseline_ms", "ours_ms", "speedup", "peak_gib", "max_rel", "mean_rel", "world_size"])
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
    if _under_torchrun():
        # Every rank has written what it had to and destroyed its process
        # group; the interpreter's own teardown after that once aborted a
        # gloo rank on a loaded 2-core CI machine ("terminate called without
        # an active exception", the run's results already written), failing
        # the whole torchrun. Leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
