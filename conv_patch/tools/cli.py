"""``convpatch`` command line.

    convpatch verify [PATH ...] [--image IMG] [--device D] [--dtype fp16|bf16|fp32] [--size N]
                     [--json PATH] [--allow-pickle]
    convpatch info
    convpatch tune [--family F ...] [--res R ...] [--batch N ...] [--layout L ...] [--part P ...]
                   [--dtype bf16|fp16] [--out TABLE.json] [--report PATH] [--device D]
    convpatch comfyui-install DIR [--force]

Exit codes: 0 all checks pass, 1 a mismatch beyond tolerance, 2 bad input or
usage (one line naming the problem, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


class UsageError(Exception):
    """A problem with what the user asked for: one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="convpatch", description="conv-patch: fast convolutions for diffusion VAEs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check conv-patch against PyTorch on a checkpoint (default: an embedded model)")
    from conv_patch.tools.formats import KNOWN
    v.add_argument("paths", nargs="*", metavar="PATH",
                   help="safetensors checkpoint(s) (a .ckpt/.pt/.pth/.bin with --allow-pickle): a VAE, "
                        "recognised by tensor names and shapes (" + "; ".join(KNOWN) + "), or any file "
                        "with conv weights (per-layer checks only); none: the embedded default")
    v.add_argument("--image", metavar="IMG", default=None,
                   help="encode->decode this image and report the reconstruction PSNR, patched and unpatched")
    v.add_argument("--allow-pickle", action="store_true",
                   help="load .ckpt/.pt/.pth/.bin pickles (with torch.load(weights_only=True) only)")
    v.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    v.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="compute dtype (default: on a GPU the checkpoint's own half type, bf16 for an fp32 "
                        "file and for the embedded default; fp32 on the CPU)")
    v.add_argument("--size", type=int, default=None,
                   help="image size in pixels (default: 512 on a GPU; small on the CPU, chosen per model)")
    v.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    sub.add_parser("info", help="GPU, architecture table, versions and kernel routes")
    from conv_patch.tools.model_shapes import FAMILIES, PARTS
    t = sub.add_parser("tune", help="time every candidate kernel config on this GPU over a model family's "
                                    "convolutions and write a config table",
                       description="Sweep the candidate configs of every kernel route over the convolutions "
                                   "of the chosen VAE families (each candidate's output is checked against "
                                   "PyTorch), time them against cuDNN and write a table for this GPU. "
                                   "Families: " + "; ".join(f"{k}: {v[0]}" for k, v in FAMILIES.items()))
    t.add_argument("--family", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    t.add_argument("--res", type=int, nargs="+", default=[512, 1024], help="image sizes in pixels")
    t.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    t.add_argument("--layout", nargs="+", choices=["nhwc", "nchw"], default=["nhwc", "nchw"])
    t.add_argument("--part", nargs="+", choices=list(PARTS), default=list(PARTS))
    t.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    t.add_argument("--out", metavar="TABLE", default=None,
                   help="table to write (default: ./<arch>.json); use it with PatchConfig(table=...) "
                        "or copy it into configs/")
    t.add_argument("--report", metavar="PATH", default=None,
                   help="also write every measurement as JSON lines, one per shape as it is measured")
    t.add_argument("--base", metavar="TABLE", default=None,
                   help="an earlier table of this GPU to extend: its entries stay unless re-measured now")
    t.add_argument("--exact-only", action="store_true",
                   help="with --base: refresh only the exact entries of the shapes measured now; the base's "
                        "buckets and 'any' stay as they are")
    t.add_argument("--max-out-channels", type=int, default=None, metavar="C",
                   help="only the convolutions with at most C output channels (with --base --exact-only: "
                        "re-tune a model's conv_out layers alone)")
    t.add_argument("--max-in-channels", type=int, default=None, metavar="C",
                   help="only the convolutions with at most C input channels (an encoder's conv_in)")
    t.add_argument("--stride", type=int, default=None, metavar="S",
                   help="only the convolutions of stride S (with --base --exact-only: re-tune a model's "
                        "downsampling convs alone)")
    t.add_argument("--kernel", type=int, default=None, metavar="K",
                   help="only the KxK convolutions (--kernel 2: the 2x2 convs an upsampling conv is folded "
                        "into)")
    t.add_argument("--missing", action="store_true",
                   help="with --base: measure only the shapes whose keys the base table lacks")
    t.add_argument("--from-report", nargs="+", metavar="REPORT", default=None,
                   help="measure nothing: with --base, derive the buckets and 'any' anew from these --report "
                        "files (a key's last line wins; only keys of the chosen families, sizes, batches and "
                        "layouts count); the base's exact entries stay. Needs no GPU")
    t.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays of every candidate and of cuDNN: GPU time alone, without the "
                        "host's (what a model run under CUDA graphs pays; small convs are host-bound otherwise)")
    t.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="stop starting new shapes after S seconds and write the table from what was measured")
    t.add_argument("--device", default=None, help="cuda or cuda:N (cpu only under TRITON_INTERPRET=1)")
    c = sub.add_parser("comfyui-install", help="put the Conv Patch VAE node into ComfyUI (a shim package in "
                                               "custom_nodes that imports it from this installation)")
    c.add_argument("dir", metavar="DIR", help="ComfyUI's custom_nodes folder (or ComfyUI's root, which holds it)")
    c.add_argument("--force", action="store_true",
                   help="replace a custom_nodes/conv_patch_node that convpatch did not write")
    return ap


def _pick_device(name):
    import torch
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name}: not a device name (cuda, cuda:N or cpu)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cuda", "cpu"):
        raise UsageError(f"--device {name}: only cuda and cpu are supported")
    return dev


def _enable_interpreter_for_cpu(device):
    """On the CPU the kernels can only run under the Triton interpreter; it
    must be chosen before the kernels are imported."""
    if device.type == "cpu" and "conv_patch.kernels.common" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


class _Progress:
    """A rich progress bar on a terminal; nothing when output is piped."""

    def __init__(self, enabled: bool, what: str = "checking"):
        self.bar = None
        self.what = what
        if enabled:
            try:
                from rich.progress import Progress
                self.bar = Progress(transient=True)
            except ImportError:
                self.bar = None
        self.task = None

    def __enter__(self):
        if self.bar:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)

    def __call__(self, done, total, name):
        if not self.bar:
            return
        from rich.markup import escape
        if self.task is None:
            self.task = self.bar.add_task(self.what, total=total)
        # A layer's name comes from the user's file: text, not markup (the
        # bar renders its description in a thread of its own, where a
        # MarkupError is a traceback whenever a refresh meets such a name).
        self.bar.update(self.task, completed=done, description=escape(f"{self.what} {name}"))


def _fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec)


def summary_lines(report) -> list:
    lines = []
    for e in report.end_to_end:
        if e.error is not None:
            lines.append(f"end to end, {e.what}: the patched model {e.error}  FAIL")
            continue
        lines.append(f"end to end, {e.what}: rel err vs the exact reference patched {e.rel_err_patched:.3g}, "
                     f"unpatched {e.rel_err_unpatched:.3g}"
                     + ("" if e.bound is None else f" (pass: patched <= 1.5 x unpatched + the {report.dtype} "
                                                   f"floor = {e.bound:.3g})")
                     + f"; max |patched-unpatched| {e.max_abs_diff:.3g}, "
                     f"PSNR {e.psnr_patched_vs_unpatched_db:.1f} dB  {'pass' if e.passed else 'FAIL'}")
        if e.image_psnr_patched_db is not None:
            # The pass above compares outputs; this is the autoencoder's own
            # loss, which the kernels' rounding should not move (the GPU
            # tests hold a real photo within 0.1 dB).
            lines.append(f"  reconstruction PSNR vs the image: unpatched {e.image_psnr_unpatched_db:.2f} dB, "
                         f"patched {e.image_psnr_patched_db:.2f} dB ({psnr_hint(e)})")
        if e.ms_patched is not None:
            lines.append(f"  time (median): unpatched {e.ms_unpatched:.3f} ms, patched {e.ms_patched:.3f} ms, "
                         f"speedup {e.speedup:.2f}x")
    n_fail = sum(not r.passed for r in report.layers) + sum(not e.passed for e in report.end_to_end)
    lines.append("PASS" if report.passed else f"FAIL: {n_fail} check(s) beyond tolerance")
    return lines


def psnr_hint(e) -> str:
    """What to make of a reconstruction's PSNR at the size it ran: a small
    image (the CPU's 64x64) keeps little detail for an autoencoder to
    rebuild, so its PSNR is lower than at the sizes the model is used at.
    The check is the patched model's distance to the unpatched one."""
    side = e.input_shape[-1]
    typical = ("a trained autoencoder reaches ~25-35 dB from 128x128 up" if side >= 128 else
               f"at {side}x{side} a trained autoencoder reaches ~18-24 dB, ~25-35 dB from 128x128 up")
    return f"round trip: {typical}; patched within ~0.1 dB of unpatched is what matters"


def render_plain(report) -> str:
    lines = [f"model:  {report.model}", f"device: {report.device}  dtype: {report.dtype}"]
    lines += [f"note:   {n}" for n in report.notes]
    lines.append(f"{'layer':<28} {'shape':<26} {'route':<24} {'rel err':>9} {'torch':>9} {'tol':>7}  result")
    for r in report.layers:
        lines.append(f"{r.name:<28} {r.shape:<26} {r.route[:24]:<24} {_fmt(r.rel_err):>9} "
                     f"{_fmt(r.torch_rel_err):>9} {r.tolerance:>7.0e}  {'pass' if r.passed else 'FAIL'}"
                     + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines + summary_lines(report))


def render_rich(report, console) -> None:
    """The report as a rich table. Everything taken from the file (tensor
    and file names, notes) is escaped: a name like ``[/x].weight`` is text,
    not markup."""
    from rich.markup import escape
    from rich.table import Table
    for n in report.notes:
        console.print(f"note: {escape(n)}")
    t = Table(title=escape(f"{report.model} - {report.device}, {report.dtype}"))
    for col in ("layer", "shape", "route", "rel err", "torch err", "tol", "result"):
        t.add_column(col, justify="right" if col in ("rel err", "torch err", "tol") else "left")
    for r in report.layers:
        t.add_row(escape(r.name), escape(r.shape), escape(r.route), _fmt(r.rel_err), _fmt(r.torch_rel_err),
                  f"{r.tolerance:.0e}",
                  ("[green]pass[/]" if r.passed else "[red]FAIL[/]") + (f" ({escape(r.note)})" if r.note else ""))
    console.print(t)
    for line in summary_lines(report):
        style = "bold green" if line == "PASS" else "bold red" if line.startswith("FAIL") else None
        console.print(escape(line), style=style, highlight=False)


def cmd_verify(args) -> int:
    device = _pick_device(args.device)
    _enable_interpreter_for_cpu(device)
    import torch

    from conv_patch.tools import verify
    if args.size is not None and args.size <= 0:
        raise UsageError(f"--size {args.size}: must be positive")
    if args.image and not os.path.isfile(args.image):
        raise UsageError(f"{args.image}: no such image file")
    if args.image:
        try:
            verify.read_image(args.image)  # a bad image is reported now, not after every layer's check
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"{args.json}: cannot write the JSON report (no such folder)")
    if args.json:
        for p in list(args.paths or []) + ([args.image] if args.image else []):
            if os.path.exists(p) and os.path.exists(args.json) and os.path.samefile(p, args.json):
                raise UsageError(f"{args.json}: --json names an input file; the report would overwrite it")
    # None: each checkpoint's own half type on a GPU, fp32 on the CPU.
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    tty = sys.stdout.isatty()
    try:
        with _Progress(tty) as progress:
            if args.paths:
                reports = verify.verify_files(args.paths, device, dtype, args.size, args.image,
                                              args.allow_pickle, progress=progress)
            else:
                if args.image:
                    raise UsageError("--image needs a checkpoint PATH (the embedded default has no encoder)")
                default = torch.bfloat16 if device.type == "cuda" else torch.float32
                reports = [verify.embedded_default(device, dtype or default, args.size, progress=progress)]
    except ValueError as e:  # CheckpointError included: bad input, one line
        raise UsageError(str(e)) from None
    console = None
    if tty:
        try:
            from rich.console import Console
            console = Console()
        except ImportError:
            pass
    for i, report in enumerate(reports):
        if i:
            print()
        if console is not None:
            render_rich(report, console)
        else:
            print(render_plain(report))
    passed = all(r.passed for r in reports)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({"passed": passed, "reports": [r.to_dict() for r in reports]}, f, indent=1,
                          default=str)
        except OSError as e:
            raise UsageError(f"{args.json}: cannot write the JSON report ({e.strerror})") from None
    return 0 if passed else 1


def cmd_info(args) -> int:
    import torch

    from conv_patch import __version__
    from conv_patch.routing import tables
    from conv_patch.routing.registry import ROUTE_INFO
    from conv_patch.target import default_target, interpreter_enabled, triton_available, what_runs

    t = default_target()
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    table = tables.packaged_table(t.arch).name if t.kernels else "-"
    print(f"conv-patch {__version__}; torch {torch.__version__}; triton {triton_v}")
    print(f"GPU: {gpu}; architecture key: {t.arch}")
    print(f"here: {what_runs()}")
    if t.kernels:
        own = tables.has_table(t.arch)
        print(f"config table: configs/{table}.json" + (" (a table of its own)" if own else
                                                       f" (no table for {t.arch}: the curated default)"))
    else:
        print("config table: - (no kernels run here)")
    # verify turns the interpreter on by itself on the CPU; "off" here is
    # this process's setting, not what verify will use.
    interp = "on" if interpreter_enabled() else \
        "off" + ("" if torch.cuda.is_available() else " (convpatch verify turns it on for its CPU run)")
    print(f"Triton interpreter: {interp}; triton available: {triton_available()}")
    print("routes:")
    for route, what in ROUTE_INFO.items():
        print(f"  {route.value}: {what}")
    return 0


def cmd_tune(args) -> int:
    import torch

    from conv_patch.routing import tables
    from conv_patch.tools import tune
    from conv_patch.tools.model_shapes import distinct_calls

    bad = [r for r in args.res if r <= 0 or r % 8]
    if bad or any(n <= 0 for n in args.batch):
        raise UsageError(f"--res must be positive multiples of 8 and --batch positive (got {bad or args.batch})")
    for flag, given in (("--exact-only", args.exact_only), ("--missing", args.missing),
                        ("--from-report", args.from_report)):
        if given and not args.base:
            raise UsageError(f"{flag} works on a --base table; give --base")
    if args.from_report and (args.exact_only or args.missing):
        raise UsageError("--from-report measures nothing: it cannot go with --exact-only or --missing")
    base = None
    if args.base:
        try:
            base = tables.load_user_table(args.base).data
        except tables.TableError as e:
            raise UsageError(str(e)) from None
    if args.from_report:
        device = target = None
        out = args.out or f"{base.get('arch', 'table')}.json"
    else:
        device, target = _tune_target(args.device)
        out = args.out or f"{target.arch}.json"
    for path in filter(None, (out, args.report)):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise UsageError(f"{path}: cannot write there (folder missing or not writable)")
    try:
        # Batch-1 shapes first (the common case), in the order the families
        # were named, so a --time-limit run covers what matters most.
        calls = sorted(distinct_calls(args.family, args.res, args.batch, args.part),
                       key=lambda c: c.shape[0])
        if args.max_out_channels is not None:
            calls = [c for c in calls if c.spec.out_channels <= args.max_out_channels]
        if args.max_in_channels is not None:
            calls = [c for c in calls if c.spec.in_channels <= args.max_in_channels]
        if args.stride is not None:
            calls = [c for c in calls if args.stride in c.spec.stride]
        if args.kernel is not None:
            calls = [c for c in calls if c.spec.kernel == (args.kernel, args.kernel)]
    except ImportError as e:
        raise UsageError(f"--family {' '.join(args.family)}: needs {e.name} "
                         f"(pip install 'conv-patch[diffusers]')") from None
    dtype = getattr(torch, DTYPES[args.dtype])
    if args.from_report:
        return _tune_from_reports(args, base, calls, dtype, out)
    skip = set(base["conv2d"].get("exact") or {}) if args.missing else set()
    n_jobs = len(tune.jobs_of(calls, args.layout, dtype, skip))
    tty = sys.stderr.isatty()
    report = open(args.report, "w") if args.report else None

    def log(m):
        if report:
            report.write(json.dumps(tune.summary_row(m)) + "\n")
            report.flush()
    try:
        with _Progress(tty, "tuning") as progress:
            ms = tune.tune(calls, args.layout, dtype, device, target, progress=progress,
                           time_limit_s=args.time_limit, on_measure=log, skip_keys=skip, graph=args.graph)
    finally:
        if report:
            report.close()
    note = tune.source_note(args.family, args.res, args.batch, args.layout, dtype, len(ms), n_jobs,
                            exact_only=args.exact_only)
    if args.missing:
        note += " Only the shape keys the base table lacked were measured."
    if args.graph:
        note += " Times are CUDA-graph replays (GPU time, no host time)."
    table = tune.build_table(ms, target.arch, dtype, note, base, exact_only=args.exact_only)
    tune.write_table(table, out)
    rows = tune.summary_rows(ms)
    sp = [r["speedup"] for r in rows if r["speedup"]]
    gm = tune.geomean(sp)
    for r in rows:
        print(f"{r['name']:<58} {r['best'] or 'none':<34} "
              f"{_fmt(r['ours_ms'], '.4f')} ms  cudnn {_fmt(r['cudnn_ms'], '.4f')} ms  x{_fmt(r['speedup'])}")
    if gm:
        print(f"geomean speedup over cuDNN: {gm:.3f} ({len(sp)} shapes)")
    _wrote(table, out)
    return 0


def _tune_target(name):
    import torch

    from conv_patch.target import target_for

    device = _pick_device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    target = target_for(device)
    if not target.kernels:
        raise UsageError(f"cannot tune here: {target.reason} (tuning needs a CUDA GPU, or "
                         f"TRITON_INTERPRET=1 with --device cpu to exercise the tuner)")
    return device, target


def _tune_from_reports(args, base, calls, dtype, out) -> int:
    """``convpatch tune --from-report``: the base table with its buckets and
    'any' derived anew from measurements already made."""
    from conv_patch.tools import tune

    rows = []
    for path in args.from_report:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{path}: cannot read the report ({getattr(e, 'strerror', None) or e})") from None
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                r = None
            if not isinstance(r, dict) or not isinstance(r.get("key"), str) \
                    or not isinstance(r.get("times"), dict):
                raise UsageError(f"{path}: line {i} is not a line of a convpatch tune --report")
            rows.append(r)
    ms, unknown, bad_labels = tune.measurements_from_reports(rows, calls, args.layout, dtype)
    if not ms:
        raise UsageError(f"{', '.join(args.from_report)}: no line has the key of a shape of --family "
                         f"{' '.join(args.family)} --res {' '.join(map(str, args.res))} --batch "
                         f"{' '.join(map(str, args.batch))} --layout {' '.join(args.layout)}")
    layouts = sorted({m.layout for m in ms})
    note = (f"buckets and 'any' of the {'/'.join(layouts)} layouts derived anew from {len(ms)} shape keys "
            f"of convpatch tune reports ({', '.join(os.path.basename(p) for p in args.from_report)}); "
            f"the exact entries are the base table's.")
    table = tune.build_table(ms, base.get("arch", "unknown"), dtype, note, base, ranges_only=True)
    tune.write_table(table, out)
    print(f"{len(ms)} shape keys read back from {len(rows)} report lines"
          + (f"; {len(unknown)} keys outside the chosen shapes skipped" if unknown else "")
          + (f"; labels no candidate has, skipped: {', '.join(sorted(bad_labels))}" if bad_labels else ""))
    _wrote(table, out)
    return 0


def _wrote(table, out):
    from conv_patch.routing import tables
    from conv_patch.routing.registry import CUDNN_TABLE_ROUTE

    n_cudnn = sum(1 for e in table["conv2d"]["exact"].values() if tables.route_of(e) == CUDNN_TABLE_ROUTE)
    print(f"wrote {out}: {len(table['conv2d']['exact'])} exact entries ({n_cudnn} routed to cuDNN), "
          f"{len(table['conv2d']['buckets'])} buckets")
    tables.load_user_table(out)  # what we wrote must load


def cmd_comfyui_install(args) -> int:
    from conv_patch.integrations import comfyui_install

    try:
        init = comfyui_install.install(args.dir, force=args.force)
    except comfyui_install.InstallError as e:
        raise UsageError(str(e)) from None
    for line in comfyui_install.notes(init):
        print(line)
    return 0


def main(argv=None) -> int:
    from conv_patch import TORCH_MISSING
    if TORCH_MISSING:  # every subcommand (and the parser's choices) needs torch
        print(f"convpatch: error: {TORCH_MISSING}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    try:
        return {"verify": cmd_verify, "info": cmd_info, "tune": cmd_tune,
                "comfyui-install": cmd_comfyui_install}[args.cmd](args)
    except UsageError as e:
        print(f"convpatch: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (``convpatch info | head``): nothing is left to
        # say. Point stdout at nothing so the interpreter's final flush does
        # not raise again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
