"""A pass's compiles in worker processes (kernels/compile_workers.py).

The children run without ``TRITON_INTERPRET`` (the interpreter compiles
nothing) and compile for an sm90 target with the ptxas Triton ships, so no
GPU is needed: a worker compiles a real kernel into a fresh Triton cache,
and the thread's compile after it must be a cache hit.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conv_patch.kernels import compile_workers

_CHILD = textwrap.dedent("""
    import json, os, sys, time
    from triton import knobs
    from bench.compile_pass import closures
    from conv_patch.kernels import compile_workers

    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])

    def closure():
        # The form of Triton's own async compile (JITFunction._do_compile):
        # one specialisation of the NCHW-to-NHWC copy, for sm90.
        return closures(1, True)[0]

    mode = sys.argv[1]
    out = {}
    if mode == "workers":
        w = compile_workers.Workers(2)
        t0 = time.monotonic()
        while w.ready() < 2 and time.monotonic() - t0 < 300 and not w.failed():
            time.sleep(0.05)
        out["ready"] = w.ready()
        kernel = w.compile(closure())
        w.close()
    elif mode == "dead":
        w = compile_workers.Workers(2)
        w.proc.kill()
        w.proc.wait()
        kernel = w.compile(closure())
    else:
        kernel = closure()()
    out["cubin"] = "cubin" in kernel.asm
    out["hits"] = hits
    out["stats"] = compile_workers.stats()
    print(json.dumps(out))
""")


def _child(mode: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / f"cache-{mode}")
    r = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tritons_async_compile_closes_over_what_a_job_sends():
    # Another form of Triton's closure would send nothing (every compile on
    # the threads): this fails first where Triton changes it.
    from triton.runtime.jit import JITFunction
    codes = [c for c in JITFunction._do_compile.__code__.co_consts
             if getattr(c, "co_name", None) == "async_compile"]
    assert len(codes) == 1
    assert set(codes[0].co_freevars) == set(compile_workers.CLOSURE)


def test_a_workers_compile_leaves_the_thread_a_cache_hit(tmp_path):
    out = _child("workers", tmp_path)
    assert out["ready"] == 2
    assert out["cubin"]
    # The worker compiled (no listener there); the thread's compile found it.
    assert out["hits"] == [True], out
    assert out["stats"]["workers"] == 1 and out["stats"]["keys_differed"] == 0
    assert out["stats"]["threads"] == 0 and out["stats"]["failed"] == 0


def test_without_workers_the_thread_compiles(tmp_path):
    # The control: the same compile on an empty cache is a miss.
    out = _child("threads", tmp_path)
    assert out["cubin"] and out["hits"] == [False]


def test_a_dead_server_leaves_the_compile_to_the_thread(tmp_path):
    out = _child("dead", tmp_path)
    assert out["cubin"] and out["hits"] == [False]
    assert out["stats"]["threads"] == 1 and out["stats"]["workers"] == 0


def test_a_closure_of_another_form_is_no_job():
    def other():
        return 1
    assert compile_workers.job_of(other) is None
    x = 1

    def closes_over_x():
        return x
    assert compile_workers.job_of(closes_over_x) is None


def test_off_by_default_on_by_the_setting(monkeypatch):
    from conv_patch.kernels import common
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # (a many-core host too)
    monkeypatch.delenv(compile_workers.ENV, raising=False)
    assert not compile_workers.enabled()
    monkeypatch.setenv(compile_workers.ENV, "1")
    assert compile_workers.enabled()
    monkeypatch.setenv(compile_workers.ENV, "0")
    assert not compile_workers.enabled()
    monkeypatch.setattr(common, "INTERPRET", True)
    monkeypatch.setenv(compile_workers.ENV, "1")
    assert not compile_workers.enabled()


def test_a_pass_starts_workers_and_ends_them_with_its_compiles(monkeypatch):
    from conv_patch.kernels import launch
    pytest.importorskip("triton.runtime._async_compile")
    seen = []

    class FakeWorkers:
        def __init__(self, n):
            seen.append(("start", n))

        def compile(self, fn):
            seen.append("compile")
            return fn()

        def close(self):
            seen.append("close")

    monkeypatch.setattr(compile_workers, "enabled", lambda: True)
    monkeypatch.setattr(compile_workers, "Workers", FakeWorkers)
    from triton.runtime._async_compile import active_mode
    with launch.compile_ahead(3):
        mode = active_mode.get()
        assert isinstance(mode.executor, compile_workers.Executor)
        assert mode.executor.submit(lambda: 7).result() == 7
    assert seen == [("start", 3), "compile", "close"]
    with launch.compile_ahead(1):  # (one thread: no workers)
        assert not isinstance(active_mode.get().executor, compile_workers.Executor)
    assert len(seen) == 3


def test_bench_compile_pass_writes_its_row(tmp_path):
    from bench import compile_pass
    compile_pass.main(["--tiny", "--kernels", "2", "--rounds", "1", "--workers", "2", "--out", str(tmp_path)])
    (f,) = list(tmp_path.glob("compile-pass-cpu-*.json"))
    (row,) = json.loads(f.read_text())["rows"]
    assert "error" not in row, row.get("error")
    assert len(row["threads_s"]) == len(row["workers_s"]) == 1
    assert row["speedup"] == row["baseline_ms"] / row["ours_ms"]
    # Both compiles ran somewhere in the workers' process; the threads' was timed by stage.
    stats = row["compile_processes"]
    assert stats["workers"] + stats["threads"] == 2 and stats["failed"] == 0
    assert row["stages_ms"]["ir_initialization"] > 0


def test_no_workers_where_the_executable_is_not_python(monkeypatch):
    started = []
    monkeypatch.setattr(compile_workers, "enabled", lambda: True)
    monkeypatch.setattr(compile_workers, "Workers", lambda n: started.append(n) or "workers")
    monkeypatch.setattr(sys, "executable", "/opt/app/bin/blender")
    assert compile_workers.start(2) is None
    monkeypatch.setattr(sys, "executable", "")
    assert compile_workers.start(2) is None
    assert started == []
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3.12")  # (the control)
    assert compile_workers.start(2) == "workers" and started == [2]
    monkeypatch.setattr(compile_workers, "enabled", lambda: False)
    assert compile_workers.start(2) is None and started == [2]


def test_a_server_that_cannot_start_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_workers, "enabled", lambda: True)
    monkeypatch.setattr(compile_workers.tempfile, "tempdir", str(tmp_path))

    def no_popen(*a, **k):
        raise OSError("no such executable")
    monkeypatch.setattr(compile_workers.subprocess, "Popen", no_popen)
    assert compile_workers.start(2) is None
    assert list(tmp_path.iterdir()) == []
