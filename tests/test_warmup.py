"""conv_patch.warmup: the first calls of a signature made ahead (plans built,
kernels compiled), so that the user's next call at that signature builds
nothing; another signature is built on its own call."""

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.runtime.plans import BuildCount
from _util import rel_err


def _net(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.SiLU(), nn.Conv2d(6, 5, 3, stride=2, padding=1),
                         nn.ConvTranspose2d(5, 4, 4, 2, 1)).to(device).eval()


def test_warmup_builds_ahead_and_later_calls_build_nothing(device, exact_fp32):
    net = _net(device)
    x = torch.randn(2, 3, 9, 7, device=device)
    with torch.no_grad():
        ref = net(x)
    conv_patch.apply(net)
    report = conv_patch.warmup(net, x)
    assert len(report.seconds) == 3 and all(s > 0 for s in report.seconds)
    assert report.plans_built[0] >= 3 and report.plans_built[1:] == [0, 0], report.plans_built
    assert "3 calls" in str(report)
    # On a GPU the pass compiling ahead ran first (and nothing it planned was kept: y below).
    assert (report.compile_ahead_s is not None) == (device.type == "cuda")
    before = BuildCount.total
    with torch.no_grad():  # the user's call, in another mode: served by what warmup built
        y = net(x)
    assert BuildCount.total == before and rel_err(y, ref) <= 1e-5
    # Another signature (size) is another build.
    with torch.no_grad():
        net(torch.randn(1, 3, 5, 6, device=device))
    assert BuildCount.total > before


def test_warmup_takes_any_callable_and_keyword_arguments(device, exact_fp32):
    net = _net(device)
    conv_patch.apply(net)
    seen = []

    def decode(z, *, scale):
        seen.append(scale)
        return net(z * scale)
    report = conv_patch.warmup(decode, torch.randn(1, 3, 6, 6, device=device), scale=0.5, calls=2)
    assert seen == [0.5, 0.5] and len(report.plans_built) == 2 and report.plans_built[0] > 0
    with pytest.raises(ValueError, match="at least one call"):
        conv_patch.warmup(net, torch.randn(1, 3, 6, 6, device=device), calls=0)


class _NoAsync:
    """Stands in for Triton's AsyncCompileMode on the CPU (nothing compiles
    under the interpreter): the pass's logic is what is tested."""

    def __init__(self, executor, ignore_errors=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _forced_pass(monkeypatch, device):
    """The compiling pass forced on the CPU: its launches recorded by name
    instead of compiled (skipped on a GPU, where test_gpu runs it for
    real)."""
    if device.type != "cpu":
        pytest.skip("the pass is forced on the CPU")
    import triton.runtime._async_compile as async_compile
    from conv_patch.api import warmup as warmup_mod
    from conv_patch.kernels import launch as kernel_launch
    compiled = []
    monkeypatch.setattr(async_compile, "AsyncCompileMode", _NoAsync)
    monkeypatch.setattr(kernel_launch, "compile_only", lambda kernel, grid, args, meta: compiled.append(kernel))
    monkeypatch.setattr(warmup_mod, "_on_gpu", lambda *a: True)
    return compiled, kernel_launch


def _patched_net(device, shape):
    """``_net`` patched, an input of ``shape`` and the unpatched answer."""
    net = _net(device)
    x = torch.randn(*shape, device=device)
    with torch.no_grad():
        ref = net(x)
    conv_patch.apply(net)
    return net, x, ref


def test_compile_ahead_pass_keeps_no_plan(device, exact_fp32, monkeypatch):
    """The pass compiling ahead launches nothing, and nothing it planned is
    used after it: the calls after it build their plans afresh and compute
    the unpatched model's answer (a plan kept from the pass would replay no
    launch and return unwritten memory)."""
    compiled, kernel_launch = _forced_pass(monkeypatch, device)
    net, x, ref = _patched_net(device, (2, 3, 9, 7))
    report = conv_patch.warmup(net, x, calls=2)
    if not compiled:
        pytest.skip("no kernel takes these convs here")
    assert report.compile_ahead_s is not None and "compiled ahead" in str(report)
    assert report.plans_built[0] >= 3 and report.plans_built[1] == 0
    assert not kernel_launch.compiling_ahead()
    with torch.no_grad():
        assert rel_err(net(x), ref) <= 1e-5
    # A bound method is followed to its module; compile_workers=0 turns the pass off.
    n = len(compiled)
    assert conv_patch.warmup(net.forward, x, calls=1, compile_workers=0).compile_ahead_s is None and len(compiled) == n


def test_compile_ahead_pass_that_raises_forgets_and_ends(device, monkeypatch):
    compiled, kernel_launch = _forced_pass(monkeypatch, device)
    net, x, ref = _patched_net(device, (1, 3, 6, 6))
    calls = []

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            calls.append(kernel_launch.compiling_ahead())
            self.net(x)
            raise RuntimeError("boom")
    # The pass's failure is a warning (it only saves time); the real call raises.
    with pytest.warns(RuntimeWarning, match="compiling ahead failed"), pytest.raises(RuntimeError, match="boom"):
        conv_patch.warmup(Boom(), x)
    assert calls == [True, False] and not kernel_launch.compiling_ahead()
    with torch.no_grad():  # nothing the failed pass planned is replayed
        assert rel_err(net(x), ref) <= 1e-5


@pytest.mark.parametrize("model", ["flux-vae-decode", "taef2", "dc-ae-decode"])
def test_compile_ahead_pass_on_fused_blocks_keeps_no_plan(model, device, exact_fp32, monkeypatch):
    """The same on the recipes' fused blocks (a VAE decoder, a TAESD stack,
    DC-AE's blocks), whose caches are the block's own (stack plans, pack
    groups, norm sites, folded upsamples): after the pass, the model's
    answer is the unpatched one's, at the shape of the pass and another."""
    pytest.importorskip("diffusers")
    from bench import zoo
    compiled, _ = _forced_pass(monkeypatch, device)
    fields, net, inputs = zoo.load_case(model, 16, 1, "fp32", True, device, n_inputs=1)
    (args, kw), = inputs
    (args2, kw2), = zoo.inputs_for(zoo.MODELS[model][0](True)[1], 24, 1, device, torch.float32, n=1)
    with torch.no_grad():
        refs = [net(*args, **kw), net(*args2, **kw2)]
    report = conv_patch.apply(net)
    assert report.fused, "no fused block: the test would not test the recipes"
    conv_patch.warmup(net, *args, calls=1, **kw)
    if not compiled:
        pytest.skip("no kernel takes these convs here")
    with torch.no_grad():
        for (a, k), ref in zip(((args, kw), (args2, kw2)), refs):
            assert rel_err(net(*a, **k), ref) <= 1e-5
