"""Timing and result files shared by the benchmarks."""

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

RESULTS = Path(__file__).resolve().parent / "results"


# bf16 dense matmul measured on the H200 (torch.matmul, 8192^3): the rate
# against which the benchmarks state a share of the peak or an arithmetic floor.
PEAK_TFLOPS = 764.0


def resident_bytes(model) -> int:
    """Bytes a model keeps on the GPU between calls: parameters, buffers,
    conv-patch's weight packs and its CUDA graphs' pools and static inputs
    (``PatchConfig.cuda_graphs``: memory a call's high-water mark does not
    show, the graph's activations being allocated at its capture)."""
    from conv_patch.runtime.state import peek
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_cuda and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for m in model.modules():
        st = peek(m)
        entry = None if st is None else st.pack
        if entry is not None:
            total += entry.buf.numel() * entry.buf.element_size()
        if st is not None and st.graphs is not None:
            total += st.graphs.held_bytes()
    return total


def pass_records(model) -> list:
    """What compiling ahead did before the first calls of ``model`` and
    the modules below it (``conv_patch.last_pass``), one line each: where it
    ran, or why not (a first call that compiled as it went says why here)."""
    import conv_patch
    return [f"{name or 'model'}: {rec}" for name, m in model.named_modules()
            for rec in [conv_patch.last_pass(m)] if rec is not None]


def peak_gib(call, model, input_bytes: int = 0):
    """Peak GiB of a process holding only ``model`` and its inputs while
    ``call()`` runs it: the call's high-water mark above what was allocated
    before it (other models in the process included), plus the model's own
    resident bytes and ``input_bytes``; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before + resident_bytes(model) + input_bytes) / 2**30


def env_info():
    import triton
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def sync():
    """Wait for the GPU's queued work (nothing on the CPU): a timed call ends
    when its output is finished."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_device():
    """The GPU when there is one; else the CPU, where the kernels only run
    under the Triton interpreter and times mean nothing (how the tests drive
    the benchmarks' logic on tiny shapes)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kernel_device(bench: str):
    """``bench_device()`` where conv-patch's kernels can run there (a GPU, or
    the CPU under TRITON_INTERPRET=1); else a one-line exit: on a plain CPU
    every route is PyTorch's and the kernel rows have nothing to time."""
    dev = bench_device()
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(f"{bench}: no GPU here; its kernel rows run on the CPU only under TRITON_INTERPRET=1")
    return dev


def side_by_side_setup(ap, argv):
    """The options the side-by-side op benchmarks share (``--rounds``,
    ``--out``), parsed; plus the device and the dtype they time in: bf16 on
    a GPU, fp32 on the CPU (the interpreter, where only the logic is
    tested)."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    device = bench_device()
    return args, device, torch.bfloat16 if device.type == "cuda" else torch.float32


def time_ms(fn, warmup=25, rep=100):
    """Median of CUDA-event timings after warm-up, with the L2 flushed before
    each run (triton.testing.do_bench); one wall-clock run on the CPU."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def launched_call(fn, device):
    """(output, wall ms, peak GiB above what was allocated before) of one
    call of ``fn()`` as a user makes it: launched eagerly, timed from the
    host up to the device's completion (peak None off CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    t = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - t) * 1e3
    return out, ms, ((torch.cuda.max_memory_allocated(device) - base) / 2 ** 30) if cuda else None


def rotated(n: int, round_index: int) -> list:
    """The order of ``n`` variants in round ``round_index``: A B C, then
    B C A, C A B, ... so no variant always runs right after the same other
    one (whose caches, clocks and allocations it would inherit)."""
    return [(round_index + j) % n for j in range(n)]


def interleaved_ms(fns, rounds=3, **kw):
    """Time several variants A, B, ... in alternation (``rotated`` order)
    and keep each one's median over the rounds, so drift of the card hits
    all of them alike."""
    samples = [[] for _ in fns]
    for r in range(rounds):
        for i in rotated(len(fns), r):
            samples[i].append(time_ms(fns[i], **kw))
    return [statistics.median(s) for s in samples]


def cached_kernels(cache_dir: Optional[str] = None) -> set:
    """The entries of Triton's on-disk cache (``cache_dir``, default
    TRITON_CACHE_DIR or Triton's own default) that hold a compiled kernel (its
    metadata JSON; a launcher's entry holds a library only): one more after a
    call is a kernel that call compiled, not loaded."""
    root = Path(cache_dir or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    if not root.is_dir():
        return set()
    return {d.name for d in root.iterdir()
            if d.is_dir() and any(f.suffix == ".json" and not f.name.startswith("__grp__") for f in d.iterdir())}


def write_results(name, rows, extra=None, out_dir=None):
    doc = {**env_info(), **(extra or {}), "rows": rows}
    out_dir = Path(out_dir or os.environ.get("BENCH_OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{doc['date'][:10]}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def child_rows(module: str, argv: list, env: Optional[dict] = None, timeout: Optional[float] = None):
    """``python -m module *argv --row-out FILE`` in a fresh process (the
    benchmark's own rows for one case, written by its child mode), with
    ``env`` added to this process's environment: (rows, None), or (None,
    why) where the child died, wrote nothing or passed ``timeout``."""
    import signal
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory(prefix="bench-child-", ignore_cleanup_errors=True) as tmp:
        out = Path(tmp) / "rows.json"
        # Its own process group: a child that times out is killed with the
        # compile workers it started (Inductor's pool), which would otherwise
        # go on writing into the caches the caller is about to delete.
        proc = subprocess.Popen([sys.executable, "-m", module, *argv, "--row-out", str(out)],
                                env={**os.environ, **(env or {})}, cwd=Path(__file__).resolve().parents[1],
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except BaseException as e:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            return None, f"child process timed out after {timeout} s"
        if out.is_file():
            return json.loads(out.read_text()), None
        return None, f"child process exited with {proc.returncode} and no row"


def profile_top(fn, device, top: int = 25) -> list:
    """One call of ``fn`` under ``torch.profiler``: its GPU kernels grouped
    by name, the ``top`` largest by total device time, as rows
    ``{"kernel", "calls", "ms", "share"}`` (``share`` of the call's kernel
    time). On the CPU: the CPU ops instead (the logic's test)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and e.cpu_parent is not None:
            continue  # top-level CPU ops only: a child's time is inside its parent's
        us = e.device_time if cuda else e.cpu_time
        calls, t = totals.get(e.name, (0, 0.0))
        totals[e.name] = (calls + 1, t + us)
    whole = sum(t for _, t in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": k[:120], "calls": c, "ms": t / 1e3, "share": t / whole} for k, (c, t) in rows]


def host_top(fn, calls: int = 5, top: int = 25) -> list:
    """``calls`` calls of ``fn`` (each followed by a sync) under cProfile:
    the ``top`` Python functions by their own time per call, as rows
    ``{"function", "calls", "ms"}`` (calls and ms per call of ``fn``):
    where a host-bound call's time goes."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
        sync()
    pr.disable()
    st = pstats.Stats(pr).stats
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})"[:120], "calls": nc / calls, "ms": tt / calls * 1e3}
            for (path, line, name), (_, nc, tt, _, _) in rows]


def print_table(rows, cols):
    widths = [max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


# The software-power-cap bit of nvidia-smi's clocks_event_reasons.active.
POWER_CAP_BIT = 0x4
SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


class ClockSampler:
    """SM clock, power and throttle reasons sampled every ``period_ms`` by
    ``nvidia-smi`` in the background while a benchmark runs. Why: under
    back-to-back FLUX decodes an H200 sits at its 700 W cap and its SM clock
    falls from 1980 to ~1650 MHz (bench/README.md), so the same code measures
    86-99 ms depending on what ran before it; a row says which it was.
    ``samples`` is empty where there is no nvidia-smi (a CPU run)."""

    def __init__(self, period_ms: int = 50):
        import shutil
        import subprocess
        import tempfile
        self.samples = []
        self._file = tempfile.TemporaryFile(mode="w+")
        exe = shutil.which("nvidia-smi") if torch.cuda.is_available() else None
        self._proc = None if exe is None else subprocess.Popen(
            [exe, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", f"-lms={period_ms}",
             f"--id={torch.cuda.current_device()}"], stdout=self._file, stderr=subprocess.DEVNULL)

    def stop(self):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        self._file.seek(0)
        self.samples = parse_smi(self._file.read())
        self._file.close()
        return self.samples


def parse_smi(text: str) -> list:
    """(unix time, SM MHz, watts, reasons) per line of nvidia-smi's CSV;
    lines that do not parse (a header, a cut-off last line) are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            stamp, frac = parts[0].split(".") if "." in parts[0] else (parts[0], "0")
            # nvidia-smi prints local time; mktime reads it as local time,
            # which makes it comparable with the runs' time.time() stamps.
            t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
            out.append((t, float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except ValueError:
            continue
    return out


def clock_stats(samples: list, intervals: list):
    """Median SM clock and power, and the fraction of samples at the power
    cap, over the samples inside ``intervals`` ([(t0, t1)] of time.time());
    None without samples there."""
    sel = [s for s in samples if any(a <= s[0] <= b for a, b in intervals)]
    if not sel:
        return None
    return {"sm_clock_mhz": statistics.median(s[1] for s in sel),
            "power_w": statistics.median(s[2] for s in sel),
            "power_capped": sum(bool(s[3] & POWER_CAP_BIT) for s in sel) / len(sel),
            "samples": len(sel)}
