"""The example scripts run with their no-download defaults (small sizes)."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytest.importorskip("diffusers")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vae_decode_example(capsys, exact_fp32):
    err = _load("diffusers_vae_decode").main(["--size", "16", "--dtype", "fp32"])
    assert err <= 1e-5 and "patched" in capsys.readouterr().out


def test_pipeline_example(tmp_path, capsys, exact_fp32):
    png = tmp_path / "out.png"
    err = _load("diffusers_pipeline").main(["--steps", "1", "--dtype", "fp32", "--out", str(png)])
    out = capsys.readouterr().out
    assert err <= 1e-4 and "unet." in out and png.is_file()


@pytest.mark.parametrize("name", ["diffusers_vae_decode", "diffusers_pipeline"])
def test_examples_have_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        _load(name).main(["--help"])
    assert e.value.code == 0 and "--model-dir" in capsys.readouterr().out


def _plain_cpu(monkeypatch):
    """A user's CPU machine: no CUDA, no Triton interpreter."""
    import torch

    from conv_patch import target
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(target, "interpreter_enabled", lambda: False)


@pytest.mark.parametrize("name,argv", [
    ("diffusers_vae_decode", ["--size", "16", "--dtype", "fp32"]),
    ("diffusers_pipeline", ["--steps", "1", "--dtype", "fp32"]),
])
def test_examples_say_plainly_what_runs_without_a_gpu(name, argv, monkeypatch, capsys, exact_fp32):
    """Without a GPU the report still lists routes: the example says once that
    the original PyTorch code ran, and claims no kernel compilation."""
    _plain_cpu(monkeypatch)
    err = _load(name).main(argv)
    out = capsys.readouterr().out
    assert err == 0  # the same PyTorch code ran both times
    assert out.count("runs its original PyTorch code") == 1 and "convpatch verify" in out
    assert "compiles the kernels" not in out
