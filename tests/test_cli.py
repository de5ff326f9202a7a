"""The convpatch command: main job, exit codes, report formats."""

import json

import pytest

from conv_patch.tools import cli
from conv_patch.ops import conv2d as conv2d_op


def test_verify_embedded_default_passes(tmp_path, capsys, device):
    out = tmp_path / "report.json"
    assert cli.main(["verify", "--device", str(device), "--size", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and "conv2d_" in text
    assert ("Triton interpreter" in text) == (device.type == "cpu")
    # On the CPU it says plainly that nothing is faster there, and the pass
    # line gives the bound it was held to (the floor, where the unpatched
    # fp32 model is exact).
    assert ("runs PyTorch's own code on this machine, no faster than unpatched" in text) == (device.type == "cpu")
    assert "(pass: patched <= 1.5 x unpatched + the" in text
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["reports"]) == 1
    report = report["reports"][0]
    assert report["passed"] and len(report["layers"]) == 41
    # The interpreter's table is all portable; a GPU's may name the TMA
    # route or cuDNN per shape.
    allowed = {"conv2d_igemm"} if device.type == "cpu" else {"conv2d_igemm", "conv2d_tma", "conv2d_taps",
                                                                  "conv2d_flat", "cudnn"}
    assert all(r["route"].split()[0] in allowed for r in report["layers"])  # "cudnn (why)"
    assert report["end_to_end"][0]["passed"]


def test_verify_detects_wrong_kernels(monkeypatch, capsys, device):
    """A kernel that computes the wrong thing must fail verification (exit 1)."""
    real = conv2d_op.run_kernel

    def off_by_a_bit(*args, **kwargs):
        return real(*args, **kwargs) * 1.05

    from conv_patch.ops import conv2d as conv
    monkeypatch.setattr(conv2d_op, "run_kernel", off_by_a_bit)  # the functional API's (per-layer checks)
    monkeypatch.setattr(conv, "run_kernel", off_by_a_bit)  # the dispatch core's (the patched model)
    assert cli.main(["verify", "--device", str(device), "--size", "16"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out


def test_verify_reports_a_kernel_that_raises(monkeypatch, capsys, device):
    """A kernel that raises (a broken Triton, an interpreter that fails on
    this machine's numpy) is a failed check naming what it raised, exit 1:
    every other check still runs, and no traceback ends the run."""
    def broken(*args, **kwargs):
        raise RuntimeError("boom: the kernel broke\nsecond line")

    from conv_patch.ops import conv2d as conv
    monkeypatch.setattr(conv2d_op, "run_kernel", broken)
    monkeypatch.setattr(conv, "run_kernel", broken)
    assert cli.main(["verify", "--device", str(device), "--size", "16"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert "the patched model raised RuntimeError: boom: the kernel broke  FAIL" in out
    assert out.count("raised RuntimeError: boom: the kernel broke") == 42  # the decode and its 41 layers
    assert "second line" not in out


@pytest.mark.parametrize("argv,needle", [
    (["verify", "--size", "12"], "multiple of 8"),
    (["verify", "--size", "-8"], "must be positive"),
    (["verify", "--device", "tpu:0"], "--device tpu:0"),
    (["verify", "--size", "16", "--json", "/nonexistent-dir/r.json"], "cannot write"),
])
def test_usage_errors_exit_2(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_bad_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", "--dtype", "fp8"])
    assert e.value.code == 2


def test_info(capsys, device):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "architecture key" in out and "conv_transpose2d_igemm" in out and "fallback" in out
    assert "torch " in out and "triton " in out and "config table:" in out
    if device.type == "cpu":  # the tests run the kernels through the interpreter
        assert "Triton interpreter: on" in out and "architecture key: interpreter" in out
        assert "configs/interpreter.json" in out


def test_info_says_what_runs_without_a_gpu(monkeypatch, capsys):
    """On a CPU machine info says plainly that patched models run PyTorch's
    code and that verify checks the kernels under the interpreter."""
    import torch

    from conv_patch import target
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(target, "interpreter_enabled", lambda: False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU: a patched model runs its original PyTorch code" in out
    assert "convpatch verify runs the kernels" in out.replace("`", "")
    assert "Triton interpreter: off (convpatch verify turns it on" in out


def test_reconstruction_psnr_says_what_is_good():
    from conv_patch.tools.verify import EndToEnd, VerifyReport
    e = EndToEnd("encode->decode photo.png", [1, 3, 64, 64], 1e-3, 1e-3, 1e-3, 70.0, True,
                 image_psnr_unpatched_db=31.18, image_psnr_patched_db=31.19)
    line = next(ln for ln in cli.summary_lines(VerifyReport("m", "cpu", "float32", True, end_to_end=[e]))
                if "reconstruction PSNR" in ln)
    assert "31.19 dB" in line and "~25-35 dB" in line and "within ~0.1 dB of unpatched" in line
    # At the CPU's 64x64 the shared TAEF2 pair reaches 21.9 dB on the astronaut: that is what to expect there.
    assert "at 64x64 a trained autoencoder reaches ~18-24 dB" in line


def test_verify_help_lists_every_format_the_readme_lists(capsys):
    from pathlib import Path

    from conv_patch.tools.formats import KNOWN
    with pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # (argparse wraps after hyphens)
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    for known in KNOWN:
        assert known in text and known in readme, known


def test_dtype_help_names_the_real_default(capsys):
    """A checkpoint verifies in its own half type on a GPU (verify._file_dtype),
    the embedded default in bf16, everything in fp32 on the CPU."""
    with pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # (argparse wraps after hyphens)
    assert "the checkpoint's own half type, bf16 for an fp32 file and for the embedded default; fp32 on the CPU" \
        in text


def test_verify_without_triton_says_no_kernel_ran(monkeypatch, capsys, device):
    """Where Triton is missing (Windows, macOS) verify must not claim the
    kernels ran under the interpreter: its checks compared PyTorch with itself."""
    from conv_patch import target
    monkeypatch.setattr(target, "triton_available", lambda: False)
    assert cli.main(["verify", "--device", str(device), "--size", "16"]) == 0
    out = capsys.readouterr().out
    assert "no kernel ran: Triton is not installed" in out and "compared PyTorch with itself" in out
    assert "ran under the Triton interpreter" not in out


def test_info_into_a_closed_pipe_is_quiet():
    """``convpatch info | head -1``: the reader goes away; no traceback."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", "conv_patch.tools.cli", "info"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # before anything is read
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
