"""conv_patch.warmup: the first calls of a signature made ahead (plans built,
kernels compiled), so that the user's next call at that signature builds
nothing; another signature is built on its own call."""

import contextlib

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
    if device.type == "cpu":  # why not, in the report and as the model's record
        assert report.compile_ahead_skipped == "no CUDA tensor in the call"
        assert "no compiling pass (no CUDA tensor in the call)" in str(report)
        assert conv_patch.last_pass(net).skipped == report.compile_ahead_skipped
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
    rec = conv_patch.last_pass(net)
    assert rec.skipped is None and rec.seconds == report.compile_ahead_s and "compiled ahead in" in str(rec)
    assert report.plans_built[0] >= 3 and report.plans_built[1] == 0
    assert not kernel_launch.compiling_ahead()
    with torch.no_grad():
        assert rel_err(net(x), ref) <= 1e-5
    # A bound method is followed to its module; compile_workers=0 turns the pass off.
    n = len(compiled)
    assert conv_patch.warmup(net.forward, x, calls=1, compile_workers=0).compile_ahead_s is None and len(compiled) == n
    assert "compile_workers=0" in conv_patch.last_pass(net).skipped


def test_compile_ahead_pass_compiles_each_launch_signature_once(device, exact_fp32, monkeypatch):
    """A pass asks Triton for each launch signature once: a model launching
    one kernel many times with the same signature (an ESRGAN net's RRDBs)
    would otherwise pay a hash of the kernel's source per launch. Another
    shape is another signature, compiled too."""
    compiled, _ = _forced_pass(monkeypatch, device)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Conv2d(8, 8, 3, padding=1) for _ in range(4)]).to(device).eval()
    x = torch.randn(1, 8, 7, 9, device=device)
    conv_patch.apply(net, config=conv_patch.PatchConfig(compile_ahead=False))
    conv_patch.warmup(net, x, calls=1)
    if not compiled:
        pytest.skip("no kernel takes these convs here")
    # Four convs, two calls of the pass: one signature, compiled once.
    assert len(compiled) == 1, compiled
    conv_patch.warmup(net, torch.randn(1, 8, 11, 9, device=device), calls=1)
    assert len(compiled) == 2 and compiled[0] is compiled[1]


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
    boom = Boom()
    with pytest.warns(RuntimeWarning, match="compiling ahead failed"), pytest.raises(RuntimeError, match="boom"):
        conv_patch.warmup(boom, x)
    assert calls == [True, False] and not kernel_launch.compiling_ahead()
    assert conv_patch.last_pass(boom).skipped == "it failed: RuntimeError: boom"
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


# -- compiling ahead at a patched model's first call (PatchConfig.compile_ahead) --
class _Noise(nn.Module):
    def forward(self, x):
        return x + torch.randn_like(x)


class _ArgsNet(nn.Module):
    """Two convs and the arguments a pass must not be seen through: a
    cache list the call appends to, a generator it draws from, a dict it
    pops from."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 5, 3, padding=1)

    def forward(self, x, cache=None, generator=None, opts=None):
        y = self.c2(torch.nn.functional.silu(self.c1(x)))
        if cache is not None:
            cache.append(y)
        if generator is not None:
            y = y + torch.randn(y.shape, generator=generator, device=y.device)
        if opts is not None:
            y = y * opts.pop("scale", 1.0)
        return y


def test_first_call_compiles_ahead_once_and_leaves_the_random_numbers(device, exact_fp32, monkeypatch):
    """``apply`` hooks the model to compile its first call's kernels ahead:
    the pass runs once, at that call, and the call draws the random numbers
    the unpatched one would (the pass's draws are put back)."""
    from conv_patch.api.warmup import first_pass_pending
    compiled, _ = _forced_pass(monkeypatch, device)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), _Noise(), nn.Conv2d(6, 5, 3, padding=1)).to(device).eval()
    x = torch.randn(2, 3, 9, 7, device=device)
    with torch.no_grad():
        torch.manual_seed(1)
        ref = net(x)
        report = conv_patch.apply(net)
        assert report.compile_ahead == [""] and first_pass_pending(net)
        torch.manual_seed(1)
        y = net(x)
        if not compiled:
            pytest.skip("no kernel takes these convs here")
        n = len(compiled)
        assert rel_err(y, ref) <= 1e-5
        assert not first_pass_pending(net)
        torch.manual_seed(1)
        assert rel_err(net(x), ref) <= 1e-5 and len(compiled) == n


def test_pass_key_names_the_model_the_call_and_the_code(monkeypatch):
    """A pass's mark is keyed on what decides the call's kernels: the same
    for the same model built again (a later process's) and the same call,
    another for another shape, dtype, stride, argument value, module class
    or ``CONV_PATCH_*`` setting; none for an argument it cannot describe."""
    from conv_patch.api import pass_marks
    x = torch.randn(2, 3, 9, 7)

    def key(net=None, *args, **kwargs):
        return pass_marks.pass_key(net or _net(torch.device("cpu")), "forward", args or (x,), kwargs)
    k = key()
    assert k is not None and key() == k and len(k) == 64
    rebuilt = nn.Sequential(*_net(torch.device("cpu"))[:3], nn.ConvTranspose2d(5, 4, 4, 2, 1))
    assert key(rebuilt) == k  # (other weights, the same classes and shapes)
    others = [key(None, torch.randn(2, 3, 9, 8)), key(None, x.half()), key(None, x.transpose(2, 3)),
              key(None, x, scale=0.5), key(_net(torch.device("cpu")).half()),
              key(nn.Sequential(*_net(torch.device("cpu"))[:3], nn.ConvTranspose2d(5, 4, 3, 2, 1)))]
    assert len({k, *others}) == len(others) + 1
    monkeypatch.setenv("CONV_PATCH_SHARED", "/elsewhere")
    assert key() != k
    assert key(None, x, cb=object()) is None and not pass_marks.marked(None)


def test_another_threads_call_waits_for_the_first_pass(device, monkeypatch):
    """While one thread's first call compiles ahead, another thread's call
    of the model waits for that pass to end (the pass's plans, launches
    compiled and none run, are the modules' until it forgets them), and
    makes no pass of its own; the pass's own calls pass the hook by."""
    import threading
    import time
    from conv_patch.api import warmup as warmup_mod
    # (A model without convs: two threads' interpreted kernels at once
    # would trip the Triton interpreter, which is not thread-safe.)
    net = nn.Sequential(nn.Linear(11, 5)).to(device).eval()
    assert warmup_mod.install_first_pass(net) and warmup_mod.first_pass_pending(net)
    events = []

    def slow_pass(fn, args, kwargs, workers, what=None, key=None):
        events.append(("pass start", threading.current_thread().name))
        fn(*args, **kwargs)  # (a pass's own call: through the hook, no second pass)
        time.sleep(0.5)
        events.append(("pass end", threading.current_thread().name))

    # (On the CPU too: the pass made to run, compiling nothing.)
    monkeypatch.setattr(warmup_mod, "first_pass_problem", lambda *a: None)
    monkeypatch.setattr(warmup_mod, "compile_ahead", slow_pass)
    x = torch.randn(1, 3, 9, 11, device=device)

    def first():
        with torch.no_grad():
            net(x)

    def second():
        while not events:  # (after the first call's hook)
            time.sleep(0.01)
        with torch.no_grad():
            events.append(("second call", threading.current_thread().name))
            net(x)
            events.append(("second done", threading.current_thread().name))

    threads = [threading.Thread(target=first, name="a"), threading.Thread(target=second, name="b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    order = [e for e, _ in events]
    assert order.count("pass start") == 1 and events[0] == ("pass start", "a"), events
    assert order.index("second done") > order.index("pass end"), events
    assert not warmup_mod.first_pass_pending(net)


def test_first_call_skips_a_pass_marked_before(device, exact_fp32, monkeypatch):
    """A pass that compiled and loaded every kernel marks its call in the
    kernel cache's folder; a later first call of the same model and input
    (another process's: here a model built again) makes no pass and
    computes as before. A pass where a kernel failed leaves no mark."""
    from conv_patch.api import pass_marks
    from conv_patch.kernels import launch as kernel_launch
    compiled, _ = _forced_pass(monkeypatch, device)
    x = torch.randn(2, 3, 9, 7, device=device)
    net, ref = _net(device), None
    with torch.no_grad():
        ref = net(x)
        conv_patch.apply(net)
        key = pass_marks.pass_key(net, "forward", (x,), {})
        assert not pass_marks.marked(key)
        net(x)
        if not compiled:
            pytest.skip("no kernel takes these convs here")
        assert pass_marks.marked(key) and (pass_marks.cache_dir() / pass_marks.MARKS_DIR / key).is_file()
        n = len(compiled)
        again = _net(device)
        conv_patch.apply(again)
        assert rel_err(again(x), ref) <= 1e-5 and len(compiled) == n  # no pass
        assert "earlier pass" in conv_patch.last_pass(again).skipped
        # A kernel that failed to compile or load: no mark, the next first call passes again.
        class Failing(kernel_launch.AheadProgress):
            def __init__(self, pending):
                super().__init__(pending)
                self.failed = 1
        monkeypatch.setattr(kernel_launch, "AheadProgress", Failing)
        y = torch.randn(1, 3, 5, 6, device=device)
        third = _net(device)
        conv_patch.apply(third)
        third(y)
        assert len(compiled) > n and not pass_marks.marked(pass_marks.pass_key(third, "forward", (y,), {}))


@pytest.mark.parametrize("case", ["hook", "list", "generator", "grad", "train"])
def test_first_call_not_compiled_ahead_where_the_pass_could_be_seen(case, device, exact_fp32, monkeypatch):
    """No pass where someone would see the model called twice: a forward
    hook, a list the call appends to, a generator it draws from, autograd,
    a module in training mode. The hook is gone all the same."""
    from conv_patch.api.warmup import first_pass_pending
    compiled, _ = _forced_pass(monkeypatch, device)
    torch.manual_seed(0)
    net = _ArgsNet().to(device).eval()
    conv_patch.apply(net)
    x = torch.randn(1, 3, 8, 7, device=device)
    seen, kw = [], {}
    if case == "hook":
        net.c1.register_forward_hook(lambda m, i, o: seen.append(o))
    elif case == "list":
        kw["cache"] = seen
    elif case == "generator":
        kw["generator"] = torch.Generator(device).manual_seed(0)
    elif case == "train":
        net.c2.train()
    with torch.set_grad_enabled(case == "grad"):
        net(x, **kw)
        assert compiled == [] and not first_pass_pending(net)
    # The model's record says why its first call compiled as it went.
    why = {"hook": "forward hooks on c1", "list": "list", "generator": "Generator", "grad": "autograd",
           "train": "c2 in training mode"}[case]
    assert why in conv_patch.last_pass(net).skipped, conv_patch.last_pass(net)
    if case in ("hook", "list"):
        assert len(seen) == 1


def test_first_call_pass_gets_its_own_dicts(device, exact_fp32, monkeypatch):
    """A dict argument the call changes is copied for the pass: the call
    sees it as the user passed it."""
    compiled, _ = _forced_pass(monkeypatch, device)
    torch.manual_seed(0)
    net = _ArgsNet().to(device).eval()
    x = torch.randn(1, 3, 8, 7, device=device)
    with torch.no_grad():
        ref = net(x, opts={"scale": 3.0})
        conv_patch.apply(net)
        opts = {"scale": 3.0}
        y = net(x, opts=opts)
    if not compiled:
        pytest.skip("no kernel takes these convs here")
    assert opts == {} and rel_err(y, ref) <= 1e-5


def test_first_call_hooks_what_compiles_ahead_and_only_that():
    """Hooked: the patched model and the VAE parts its decode and encode
    call; not a model with Conv3d layers whose family has no pass of its own
    (a Wan VAE's methods are: test_wan_vae_pass_takes_the_clip_cut_short),
    not with compile_ahead=False, and remove() takes the hooks off."""
    from conv_patch.api.warmup import first_pass_pending
    net = _net(torch.device("cpu"))
    assert conv_patch.apply(net, config=conv_patch.PatchConfig(compile_ahead=False)).compile_ahead == []
    assert not first_pass_pending(net)
    conv_patch.remove(net)
    assert conv_patch.apply(net).compile_ahead == [""] and first_pass_pending(net)
    conv_patch.remove(net)
    assert not first_pass_pending(net)
    video = nn.Sequential(nn.Conv3d(3, 4, 3, padding=1))
    assert conv_patch.apply(video).compile_ahead == [] and not first_pass_pending(video)
    with pytest.raises(TypeError, match="compile_ahead"):
        conv_patch.apply(_net(torch.device("cpu")), config=conv_patch.PatchConfig(compile_ahead="yes"))


def test_first_decode_compiles_the_decoder_ahead(device, exact_fp32, monkeypatch):
    """``vae.decode(z)`` reaches the decoder, not the VAE's forward: the
    decoder's hook compiles ahead at the first decode, the encoder keeps its
    own for its first call, and the decode is the unpatched one's."""
    pytest.importorskip("diffusers")
    from bench import zoo
    from conv_patch.api.warmup import first_pass_pending
    compiled, _ = _forced_pass(monkeypatch, device)
    torch.manual_seed(0)
    vae = zoo.kl_vae(4, True).to(device).eval()
    z = torch.randn(1, 4, 6, 5, device=device)
    with torch.no_grad():
        ref = vae.decode(z).sample
        conv_patch.apply(vae)
        assert first_pass_pending(vae) and first_pass_pending(vae.decoder) and first_pass_pending(vae.encoder)
        y = vae.decode(z).sample
    if not compiled:
        pytest.skip("no kernel takes these convs here")
    assert not first_pass_pending(vae.decoder) and first_pass_pending(vae.encoder) and first_pass_pending(vae)
    assert rel_err(y, ref) <= 1e-5


def test_progress_line_of_a_long_pass(monkeypatch, capsys):
    """A pass still compiling after COMPILE_NOTICE_S says what and how far,
    and at its end how long it took; a short one says nothing."""
    from conv_patch.api import warmup as warmup_mod

    class Progress:
        loading = False

        def counts(self):
            return 1, 3
    monkeypatch.setattr(warmup_mod, "COMPILE_NOTICE_S", 0.0)
    line = warmup_mod._ProgressLine(Progress(), "Decoder on (1, 4, 8, 8)", 4)
    import time
    deadline = time.time() + 5
    while not line.shown and time.time() < deadline:
        time.sleep(0.01)
    line.close()
    err = capsys.readouterr().err
    assert "compiling kernels for Decoder on (1, 4, 8, 8) ahead of its first call: 1/3 (4 threads" in err
    assert "3 kernels for Decoder on (1, 4, 8, 8) compiled ahead in" in err
    monkeypatch.setattr(warmup_mod, "COMPILE_NOTICE_S", 60.0)
    warmup_mod._ProgressLine(Progress(), "X", 1).close()
    assert capsys.readouterr().err == ""


@pytest.mark.gpu
def test_first_call_compiles_ahead_on_the_gpu(monkeypatch):
    """On a GPU the hook's pass compiles for real (Triton's async compiles):
    it runs once, at the first call, whose answer is the unpatched one's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from conv_patch.api import warmup as warmup_mod
    passes, real = [], warmup_mod.compile_ahead
    monkeypatch.setattr(warmup_mod, "compile_ahead", lambda *a, **k: passes.append(real(*a, **k)) or passes[-1])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, 32, 3, padding=1))
    net = net.to("cuda", torch.float16).eval()
    x = torch.randn(1, 64, 96, 80, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        ref = net.float()(x.float())
        net.half()
        conv_patch.apply(net)
        y = net(x)
        assert len(passes) == 1 and passes[0] is not None
        assert rel_err(y, ref) <= 1e-2 and rel_err(net(x), ref) <= 1e-2 and len(passes) == 1


def test_compile_ahead_pass_covers_the_second_call(device, exact_fp32, monkeypatch):
    """A fused block's second call at a signature refreshes its convs'
    weight packs in one grouped launch that the first call does not make:
    the pass calls the model twice, so that kernel is compiled too."""
    pytest.importorskip("diffusers")
    from bench import zoo
    compiled, _ = _forced_pass(monkeypatch, device)
    fields, net, inputs = zoo.load_case("sd-vae-decode", 16, 1, "fp32", True, device, n_inputs=1)
    (args, kw), = inputs
    with torch.no_grad():
        ref = net(*args, **kw)
    conv_patch.apply(net)
    conv_patch.warmup(net, *args, calls=1, **kw)
    if not compiled:
        pytest.skip("no kernel takes these convs here")
    names = {getattr(getattr(k, "fn", k), "__name__", str(k)) for k in compiled}
    assert "grouped_weight_pack_kernel" in names, names
    with torch.no_grad():
        for _ in range(2):
            assert rel_err(net(*args, **kw), ref) <= 1e-5


def test_no_graph_is_captured_or_noted_in_a_pass():
    """A call inside a pass compiling ahead is neither captured nor counted
    as seen by a block's CUDA graphs: the user's second call captures, as
    without the pass."""
    from conv_patch.kernels import launch as kernel_launch
    from conv_patch.runtime.graphs import GraphCache
    cache = GraphCache()  # (keyed here by plain arguments: a CPU tensor has no graph)
    cache.note((3,), {})
    assert cache.takes((3,), {})
    eager = cache.stats["eager"]
    kernel_launch._AHEAD.pending = []
    try:
        assert not cache.takes((3,), {})
        cache.note((5,), {})
        assert cache(nn.Identity(), lambda v: v + 1, (5,), {}) == 6 and cache.stats["eager"] == eager
    finally:
        kernel_launch._AHEAD.pending = None
    assert cache.takes((3,), {}) and not cache.takes((5,), {})
    assert cache(nn.Identity(), lambda v: v + 1, (5,), {}) == 6 and cache.stats["eager"] == eager + 1


def test_one_pass_for_a_vae_forward_or_a_warmup(device, exact_fp32, monkeypatch):
    """``vae(x)`` (encode, then decode) compiles ahead once, at the VAE's
    hook, which takes the decoder's and encoder's off too; ``warmup``'s
    pass reaches the model's hook inside it, which comes off without a
    pass of its own."""
    pytest.importorskip("diffusers")
    from bench import zoo
    from conv_patch.api import warmup as warmup_mod
    compiled, _ = _forced_pass(monkeypatch, device)
    passes, real = [], warmup_mod.run_pass
    monkeypatch.setattr(warmup_mod, "run_pass", lambda m, *a, **k: passes.append(type(m).__name__) or real(m, *a, **k))
    torch.manual_seed(0)
    vae = zoo.kl_vae(4, True).to(device).eval()
    x = torch.randn(1, 3, 16, 12, device=device)
    with torch.no_grad():
        ref = vae(x).sample
        conv_patch.apply(vae)
        y = vae(x).sample
    assert passes == ["AutoencoderKL"]
    assert not any(warmup_mod.first_pass_pending(m) for m in (vae, vae.decoder, vae.encoder))
    if compiled:
        assert rel_err(y, ref) <= 1e-5
    # warmup's own pass reaches the hook inside it: one pass, not two.
    net, x, _ = _patched_net(device, (1, 3, 8, 8))
    passes.clear()
    conv_patch.warmup(net, x, calls=1)
    assert len(passes) == 1 and not warmup_mod.first_pass_pending(net)


def test_kernels_load_in_background_once(monkeypatch):
    """``apply`` on a GPU machine starts one daemon thread that imports the
    kernels and computes Triton's cache key, which a first call's first
    kernel would otherwise wait for; not on a machine without CUDA. The
    pass waits for it (``wait_for_background``) rather than hash beside it."""
    from conv_patch.ops import loader
    from triton.runtime.cache import triton_key
    monkeypatch.setattr(loader, "_BACKGROUND", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    conv_patch.apply(_net(torch.device("cpu")))
    assert loader._BACKGROUND == []
    triton_key.cache_clear()
    loader.load_in_background()
    loader.load_in_background()
    assert len(loader._BACKGROUND) == 1
    loader.wait_for_background()  # (what the compiling pass does before its first ask)
    assert not loader._BACKGROUND[0].is_alive()
    assert triton_key.cache_info().currsize == 1 and loader._KERNELS


def _launch_key(kernel, args, meta):
    """A launch as Triton specialises it (stricter: every integer by its
    class): kernel, constexprs, argument classes."""
    spec = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append((a.dtype, a.data_ptr() % 16 == 0))
        elif type(a) is int:
            spec.append(1 if a == 1 else a % 16 == 0)
        elif type(a).__name__ == "TensorDescriptor":
            spec.append(tuple(a.block_shape))
        else:
            spec.append(type(a))
    return getattr(kernel, "fn", kernel), tuple(sorted(meta.items())), tuple(spec)


def test_compile_ahead_pass_covers_the_swapped_call(device, exact_fp32, monkeypatch):
    """The third call at a signature is the first with passthrough's idle
    parts on their own classes, whose outputs reach the busy parts in the
    unpatched modules' layouts: other strides, other kernel
    specialisations (on a GPU a Wan 2.1 decode's third call compiled for
    4 s on a cold cache). The pass calls the model as often, so every
    launch of the calls after it was compiled in it. Here a tiny Wan VAE
    with its 2-D convs on PyTorch's route, as a GPU's tables send them,
    hooked by ``apply`` at its ``decode``: the first decode's pass runs on
    the clip cut to its first three latent frames (of five), whose shapes
    every later frame repeats (with two frames it misses 7 launches), and
    the decodes compute the unpatched VAE's answer. (The cut keeps the
    clip's length modulo 2 here, not 16: at these sizes the integers of
    the convs over the whole clip then agree in their divisibility by 16.)"""
    pytest.importorskip("diffusers")
    from triton.runtime.interpreter import InterpretedFunction
    from bench import video
    from conv_patch.api.warmup import FirstMethodCall
    from conv_patch.recipes import catalog, video_pass, wan
    from conv_patch.routing.decide import fallback
    from conv_patch.runtime import planner
    _, kernel_launch = _forced_pass(monkeypatch, device)
    ahead, launched, cut = set(), set(), []
    monkeypatch.setattr(kernel_launch, "compile_only",
                        lambda kernel, grid, args, meta: ahead.add(_launch_key(kernel, args, meta)))
    run = InterpretedFunction.run

    def interpreted(self, *args, grid, warmup, **kw):
        launched.add(_launch_key(self, args, kw))
        return run(self, *args, grid=grid, warmup=warmup, **kw)
    monkeypatch.setattr(InterpretedFunction, "run", interpreted)
    decide = planner.decide_call

    def decide_2d_on_pytorch(m, call, weight, bias, graph):
        d, spec = decide(m, call, weight, bias, graph)
        return (fallback("PyTorch's route, as on a GPU") if len(spec.kernel) == 2 else d), spec
    monkeypatch.setattr(planner, "decide_call", decide_2d_on_pytorch)
    pass_inputs = catalog.pass_inputs

    def cutting(*a):
        out = pass_inputs(*a)
        cut.append(tuple(out[0][0].shape))
        return out
    monkeypatch.setattr(catalog, "pass_inputs", cutting)
    monkeypatch.setattr(video_pass, "PASS_FRAMES_MODULUS", 2)
    vae = video.build_vae("wan2.1", True, device, torch.float32)
    z = video.latents(vae, 9, 16, 16, device, torch.float32)
    with torch.no_grad():
        ref = vae.decode(z).sample
    assert conv_patch.apply(vae).compile_ahead == [""]
    assert isinstance(vae.__dict__.get("decode"), FirstMethodCall)
    with torch.no_grad():
        y = vae.decode(z).sample
        assert cut == [(*z.shape[:2], wan.PASS_LATENT_FRAMES, *z.shape[3:])] and z.shape[2] == 5 and ahead
        assert "decode" not in vae.__dict__ and isinstance(vae.__dict__.get("encode"), FirstMethodCall)
        assert rel_err(y, ref) <= 1e-5
        for _ in range(2):
            vae.decode(z)
    assert launched and launched <= ahead, len(launched - ahead)


def test_wan_vae_pass_takes_the_clip_cut_short():
    """A Wan VAE's decode and encode compile ahead on the clip's first
    frames (``recipes.wan.pass_inputs``): three latent frames and as many
    more as keep the length modulo 16 (Triton's divisibility
    specialisation), stored as the caller's clip; a short clip whole; any
    other model's call as it is. ``remove`` takes the methods' hooks off."""
    pytest.importorskip("diffusers")
    from bench import video
    from conv_patch.api.warmup import FirstMethodCall, first_pass_pending
    from conv_patch.recipes import catalog, wan
    assert [wan.pass_latent_frames(t) for t in (1, 3, 4, 18, 19, 20, 21, 40)] == [1, 3, 4, 18, 3, 4, 5, 8]
    vae = video.build_vae("wan2.1", True, torch.device("cpu"), torch.float32)
    assert catalog.pass_methods(vae) == ("decode", "encode")
    z = torch.randn(1, 4, 21, 2, 3)
    (cut,), kw = catalog.pass_inputs(vae, "decode", (z,), {"return_dict": False})
    assert cut.shape == (1, 4, 5, 2, 3) and cut.is_contiguous() and torch.equal(cut, z[:, :, :5]) and kw == {
        "return_dict": False}
    args, kw = catalog.pass_inputs(vae, "decode", (), {"z": z})
    assert args == () and kw["z"].shape[2] == 5
    x = torch.randn(1, 3, 81, 4, 4).contiguous(memory_format=torch.channels_last_3d)
    (cut,), _ = catalog.pass_inputs(vae, "encode", (x,), {})
    assert cut.shape[2] == 17 and cut.is_contiguous(memory_format=torch.channels_last_3d)
    short = torch.randn(1, 4, 3, 2, 3)
    assert catalog.pass_inputs(vae, "decode", (short,), {})[0][0] is short
    net = _net(torch.device("cpu"))
    assert catalog.pass_methods(net) == () and catalog.pass_inputs(net, "decode", (z,), {})[0][0] is z
    conv_patch.apply(vae)
    assert all(isinstance(vae.__dict__.get(n), FirstMethodCall) for n in ("decode", "encode"))
    assert vae.decode.__self__ is vae and vae.decode.__name__ == "decode" and first_pass_pending(vae)
    conv_patch.remove(vae)
    assert "decode" not in vae.__dict__ and "encode" not in vae.__dict__ and not first_pass_pending(vae)


# (model, method, frames (latent ones to decode), the VAE's settings, the
# frames the pass keeps, whether as a view)
VIDEO_PASSES = [
    ("cogvideox", "decode", 11, {}, 7, True),  # frame batches of 2, the remainder in the first
    ("cogvideox", "decode", 10, {"use_tiling": True, "tile_latent_min_height": 2, "tile_latent_min_width": 2,
                                 "tile_overlap_factor_height": 0.5, "tile_overlap_factor_width": 0.5}, 6, True),
    ("mochi", "decode", 11, {"use_framewise_decoding": True}, 7, True),  # batches of 2, the remainder last
    ("mochi", "decode", 20, {}, 4, False),  # the whole clip (the modulus 2 here, as below)
    ("hunyuan-video", "decode", 14, {}, 11, True),  # temporal tiles of 5 latent frames, 3 apart
    ("hunyuan-video", "decode", 20, {"use_framewise_decoding": False}, 4, False),
    ("ltx-video", "decode", 20, {}, 4, False),
    ("ltx-video", "decode", 8, {"use_framewise_decoding": True}, 5, True),  # tiles of 3, 1 apart
    ("cogvideox", "encode", 41, {}, 25, True),  # batches of 8 frames, the remainder in the first
    ("mochi", "encode", 37, {}, 13, False),  # whole: 1 + 2 * 6 frames, the length modulo 2 * 6
    ("hunyuan-video", "encode", 29, {"tile_sample_min_num_frames": 8, "tile_sample_stride_num_frames": 4}, 17, True),
    ("hunyuan-video", "encode", 21, {"use_framewise_encoding": False}, 13, False),  # 1 + 2 * 4, modulo 8
    ("ltx-video", "encode", 41, {}, 25, False),  # 1 + 2 * 8, modulo 16
    # (Its encode tiles in time by the decoding flag.)
    ("ltx-video", "encode", 41, {"use_framewise_decoding": True, "tile_sample_min_num_frames": 8,
                                 "tile_sample_stride_num_frames": 8}, 25, True),
]


@pytest.mark.parametrize("model, method, t, settings, keep, view", VIDEO_PASSES,
                         ids=[f"{m}-{k}-{t}-{'-'.join(s)[:24] or 'default'}" for m, k, t, s, _, _ in VIDEO_PASSES])
def test_video_vae_pass_covers_the_call(model, method, t, settings, keep, view, device, exact_fp32, monkeypatch):
    """A CogVideoX, Mochi, HunyuanVideo or LTX-Video VAE is hooked at its
    ``decode`` and ``encode``, whose first calls compile ahead on the clip
    cut short (``recipes.video_pass``): every launch of the calls after it
    was compiled in the pass. A batched or tiled call's pass takes a view of
    the clip's first frames (its slices are the full clip's, strides and
    all); a whole-clip call's a copy of as many frames as keep the length
    modulo 16 (2 here, as in the Wan test above) at every temporal stage. The
    kernels are not run: the launches' arguments are what is compared (the
    decodes' answers are the family tests')."""
    pytest.importorskip("diffusers")
    from triton.runtime.interpreter import InterpretedFunction
    from bench import video
    from conv_patch.api.warmup import FirstMethodCall
    from conv_patch.recipes import catalog, video_pass
    _, kernel_launch = _forced_pass(monkeypatch, device)
    ahead, launched, cut = set(), set(), []
    monkeypatch.setattr(kernel_launch, "compile_only",
                        lambda kernel, grid, args, meta: ahead.add(_launch_key(kernel, args, meta)))
    monkeypatch.setattr(InterpretedFunction, "run",
                        lambda self, *args, grid, warmup, **kw: launched.add(_launch_key(self, args, kw)))
    pass_inputs = catalog.pass_inputs

    def cutting(*a):
        out = pass_inputs(*a)
        cut.append(out[0][0])
        return out
    monkeypatch.setattr(catalog, "pass_inputs", cutting)
    monkeypatch.setattr(video_pass, "PASS_FRAMES_MODULUS", 2)
    vae = video.build_vae(model, True, device, torch.float32)
    for k, v in settings.items():
        setattr(vae, k, v)
    if method == "decode":
        clip = torch.randn(1, vae.config.latent_channels, t, 4, 4, device=device)
    else:
        # Frames that encode to 2x4 latent pixels: the last stage's sizes
        # are then divisible by 16 as its frame count is by 2, the modulus.
        with torch.no_grad():
            size = vae.decode(torch.zeros(1, vae.config.latent_channels, 1, 2, 4)).sample.shape[-2:]
        clip = torch.randn(1, 3, t, *size, device=device)
    assert catalog.pass_methods(vae) == ("decode", "encode")
    conv_patch.apply(vae)
    assert isinstance(vae.__dict__.get(method), FirstMethodCall)
    call = getattr(vae, method)
    with torch.no_grad():
        call(clip)
        assert len(cut) == 1 and cut[0].shape[2] == keep < t, [c.shape for c in cut]
        # A batched call's cut is a view of the clip (its strides), a whole clip's a dense copy.
        assert (cut[0].stride() == clip.stride()) == view and (cut[0].data_ptr() == clip.data_ptr()) == view
        assert method not in vae.__dict__ and ahead
        for _ in range(2):
            getattr(vae, method)(clip)
    assert launched and launched <= ahead, len(launched - ahead)


def test_compile_ahead_pass_runs_a_graphed_block_down_the_capture_path(device, exact_fp32, monkeypatch):
    """A block that CUDA graphs would capture at the user's second call
    compiles the capture's kernels in the pass: once per call key, the
    pass's call of the block runs down the capture's own path too
    (``pack.graph_path``, as the capture's warm-up), not at every pass
    call; a cache given up takes no such call. (On a cold cache TAEF2's
    second call compiled for 3.4-5 s on an H200 without it.)"""
    from conv_patch.runtime import graphs, pack
    _forced_pass(monkeypatch, device)
    monkeypatch.setattr(graphs, "call_key", lambda args, kwargs: tuple(tuple(t.shape) for t in args))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(6, 5, 3, padding=1)).to(device).eval()
    conv_patch.apply(net, config=conv_patch.PatchConfig(compile_ahead=False))
    graphs.install(net, 4, auto=True)
    calls, graph_calls = [], []
    graph_path = pack.graph_path

    @contextlib.contextmanager
    def counted():
        graph_calls.append(len(calls))
        with graph_path():
            yield
    monkeypatch.setattr(pack, "graph_path", counted)
    model = lambda x: calls.append(x) or net(x)  # noqa: E731
    model.__self__ = net
    x = torch.randn(1, 3, 9, 7, device=device)
    from conv_patch.api.warmup import PASS_CALLS, compile_ahead
    compile_ahead(model, (x,), {}, 2)
    assert len(calls) == PASS_CALLS and graph_calls == [1] and not pack.GRAPH_PATH
    calls.clear(), graph_calls.clear()
    graphs.cache_of(net).disabled = "given up"
    compile_ahead(model, (x,), {}, 2)
    assert len(calls) == PASS_CALLS and graph_calls == []
