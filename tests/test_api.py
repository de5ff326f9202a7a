"""A patched model gives PyTorch's answer where PyTorch's API has rules of
its own: autocast's cast policy, parametrizations registered after
``apply``, the conv output's memory format, and calls from several
threads."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conv_patch
from conv_patch.runtime import dispatch
from conv_patch.runtime.state import state_of
from conv_patch.runtime import planner
from _util import TOL, rel_err


# A table of the user's own: every call takes the kernels (on a GPU the
# packaged table's cost check would leave these tiny convs to PyTorch).
KERNELS = conv_patch.PatchConfig(table={"conv2d": {"any": {"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16}}})


def _pair(*convs, recipes=False):
    torch.manual_seed(0)
    net = nn.Sequential(*convs)
    twin = copy.deepcopy(net)
    conv_patch.apply(net, recipes=recipes, config=KERNELS)
    return net, twin


def _ref64(module, x, dtype):
    """The module's convolution in float64 from the inputs cast to ``dtype``."""
    w = module.weight.detach().to(dtype).double()
    b = module.bias.detach().to(dtype).double()
    xd = x.to(dtype).double()
    if isinstance(module, nn.ConvTranspose2d):
        return F.conv_transpose2d(xd, w, b, module.stride, module.padding, module.output_padding)
    return F.conv2d(xd, w, b, module.stride, module.padding)


# -- autocast --------------------------------------------------------------------------
def _check_autocast(device_type, dtype):
    device = torch.device(device_type)
    net, twin = _pair(nn.Conv2d(4, 6, 3, padding=1), nn.ConvTranspose2d(6, 5, 3, stride=2, padding=1))
    net, twin = net.to(device), twin.to(device)
    x = torch.randn(2, 4, 6, 7, device=device)
    with torch.no_grad(), torch.autocast(device_type, dtype=dtype):
        for _ in range(2):  # the plan's build, then its replay
            for layer, ref_layer in ((net[0], twin[0]), (net[1], twin[1])):
                y, ref = layer(x if layer is net[0] else h), ref_layer(x if layer is net[0] else h)
                assert y.dtype == ref.dtype == dtype
                assert state_of(layer).last.is_kernel, state_of(layer).last
                assert rel_err(y, _ref64(layer, x if layer is net[0] else h, dtype)) <= TOL[dtype]
                h = y
    # Outside autocast the same module computes in its own dtype again.
    with torch.no_grad():
        assert net(x).dtype == torch.float32
        assert rel_err(net(x), twin(x)) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_autocast_follows_pytorch(dtype, exact_fp32):
    from conv_patch.target import target_for
    if not target_for(torch.device("cpu")).kernels:
        pytest.skip("kernels run on CPU tensors only under TRITON_INTERPRET=1")
    _check_autocast("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_autocast_follows_pytorch(dtype, exact_fp32):
    _check_autocast("cuda", dtype)


def test_autocast_epilogue_promotes_like_pytorch(device, exact_fp32):
    """A residual of another dtype is added with PyTorch's type promotion
    (the result is float32, as ``conv(x) + residual`` is), a double input
    stays double, and autograd sees autocast's own casts."""
    net, twin = _pair(nn.Conv2d(4, 6, 3, padding=1))
    net, twin = net.to(device), twin.to(device)
    conv, ref = net[0], twin[0]
    kind = device.type
    x = torch.randn(1, 4, 5, 6, device=device)
    r = torch.randn(1, 6, 5, 6, device=device)
    with torch.autocast(kind, dtype=torch.bfloat16):
        with torch.no_grad():
            y = conv(x, residual=r, activation="silu")
            want = F.silu(ref(x) + r)
            assert y.dtype == want.dtype == torch.float32
            assert rel_err(y, want) <= 1e-6
            rb = r.bfloat16()
            y = conv(x, residual=rb)
            assert y.dtype == torch.bfloat16 and state_of(conv).last.is_kernel
            assert rel_err(y, (_ref64(conv, x, torch.bfloat16) + rb.double())) <= TOL[torch.bfloat16]
            # A double input is not cast: PyTorch then refuses the mixed
            # dtypes, and so does the patched module (its own error).
            with pytest.raises(RuntimeError) as theirs:
                ref(x.double())
            with pytest.raises(RuntimeError) as ours:
                conv(x.double())
            assert str(ours.value) == str(theirs.value)
        xg = x.clone().requires_grad_()
        y = conv(xg)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert xg.grad is not None and xg.grad.dtype == torch.float32


def test_autocast_off_keeps_the_plans_key_apart(device, exact_fp32):
    net, _ = _pair(nn.Conv2d(4, 6, 3, padding=1))
    net = net.to(device)
    x = torch.randn(1, 4, 5, 6, device=device)
    with torch.no_grad():
        net(x)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            net(x)
        net(x)
    plans = state_of(net[0]).plans
    assert len(plans) == 2
    assert sorted(type(p).__name__ for p in plans.values()) == ["AutocastPlan", "ConvPlan"]


@pytest.mark.gpu
def test_cuda_autocast_group_norm_is_float32():
    norm = nn.GroupNorm(4, 16).cuda()
    patched = nn.GroupNorm(4, 16).cuda()
    patched.load_state_dict(norm.state_dict())
    x = torch.randn(2, 16, 32, 32, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = F.silu(norm(x))
        y = dispatch.group_norm(patched, x, "silu")
    assert y.dtype == want.dtype == torch.float32
    assert rel_err(y, want) <= 1e-5


# -- parametrizations registered after apply -------------------------------------------
def _same(net, twin, x):
    with torch.no_grad():
        assert rel_err(net(x), twin(x)) <= TOL[torch.float32]
    assert sorted(net.state_dict()) == sorted(twin.state_dict())


def _new_weight_norm(m):
    torch.nn.utils.parametrizations.weight_norm(m)


def _new_remove(m):
    torch.nn.utils.parametrize.remove_parametrizations(m, "weight")


def _old_weight_norm(m):
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(m)


def _old_remove(m):
    torch.nn.utils.remove_weight_norm(m)


@pytest.mark.parametrize("kind", ["parametrizations", "legacy"])
def test_weight_norm_after_apply_then_removed(kind, device, exact_fp32):
    add, drop = (_new_weight_norm, _new_remove) if kind == "parametrizations" else (_old_weight_norm, _old_remove)
    net, twin = _pair(nn.Conv2d(4, 6, 3, padding=1))
    net, twin = net.to(device), twin.to(device)
    x = torch.randn(2, 4, 6, 7, device=device)
    _same(net, twin, x)
    add(net[0]), add(twin[0])
    _same(net, twin, x)
    assert not state_of(net[0]).last.is_kernel  # the module's own forward, through the parametrization
    # Training through the parametrization sees PyTorch's gradients.
    net(x).square().sum().backward()
    twin(x).square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), twin.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-5, name
    drop(net[0]), drop(twin[0])
    assert isinstance(net[0].weight, nn.Parameter) and conv_patch.is_patched(net[0])
    _same(net, twin, x)
    assert state_of(net[0]).last.is_kernel  # a Parameter again: the kernels take it back
    # Parametrized again, then conv-patch removed: the original module keeps
    # the parametrization (its weight), and loses it like any module.
    add(net[0]), add(twin[0])
    _same(net, twin, x)
    conv_patch.remove(net)
    assert not conv_patch.is_patched(net[0]) and isinstance(net[0], nn.Conv2d)
    assert type(net[0]).__name__ == type(twin[0]).__name__
    _same(net, twin, x)
    drop(net[0]), drop(twin[0])
    assert type(net[0]) is type(twin[0])
    assert isinstance(net[0].weight, nn.Parameter)
    _same(net, twin, x)


def test_parametrization_removed_without_grad_leaves_a_buffer_weight(device, exact_fp32):
    """Under no_grad ``remove_parametrizations`` leaves the weight as a buffer:
    PyTorch computes with it, and so does the patched module."""
    net, twin = _pair(nn.Conv2d(4, 6, 3, padding=1))
    net, twin = net.to(device), twin.to(device)
    x = torch.randn(1, 4, 5, 5, device=device)
    for m in (net[0], twin[0]):
        _new_weight_norm(m)
        with torch.no_grad():
            _new_remove(m)
        assert "weight" in m._buffers
    _same(net, twin, x)
    conv_patch.remove(net)
    _same(net, twin, x)


# -- the output's memory format ------------------------------------------------------
def _layout(t, kind, rng):
    """``t`` contiguous, channels_last, or in a random dimension order (a
    stride order PyTorch may call either, where sizes are 1)."""
    if kind == "nchw":
        return t.contiguous()
    if kind == "nhwc":
        return t.contiguous(memory_format=torch.channels_last)
    perm = rng.permutation(4).tolist()
    return t.permute(perm).contiguous().permute([perm.index(i) for i in range(4)])


def _fuzz_strides(device, n, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    seen = set()
    for i in range(n):
        transposed = bool(rng.random() < 0.3)
        c_in, c_out = int(rng.choice([1, 2, 3])), int(rng.choice([1, 2, 4]))
        k = int(rng.choice([1, 3]))
        h, w = int(rng.choice([1, 2, 5])), int(rng.choice([1, 3, 6]))
        n_batch = int(rng.choice([1, 2]))
        cls = nn.ConvTranspose2d if transposed else nn.Conv2d
        conv = cls(c_in, c_out, k, padding=k // 2).to(device)
        with torch.no_grad():
            conv.weight.data = _layout(conv.weight.data, rng.choice(["nchw", "nhwc", "perm"]), rng)
        ref = copy.deepcopy(conv)
        net = nn.Sequential(conv)
        conv_patch.apply(net, recipes=False, config=KERNELS)
        x = _layout(torch.randn(n_batch, c_in, h, w, device=device), rng.choice(["nchw", "nhwc", "perm"]), rng)
        if rng.random() < 0.2:
            x = x[0]  # unbatched
        with torch.no_grad():
            y, want = net(x), ref(x)
        assert state_of(net[0]).last.is_kernel, state_of(net[0]).last
        case = (transposed, tuple(x.shape), x.stride(), tuple(conv.weight.shape), conv.weight.stride())
        assert y.stride() == want.stride(), (case, y.stride(), want.stride())
        assert rel_err(y, want) <= TOL[torch.float32], case
        seen.add((c_in, y.is_contiguous(), y.is_contiguous(memory_format=torch.channels_last)))
    return seen


def test_suggests_channels_last_is_pytorch_rule():
    """The rule against PyTorch's own (CPU conv2d outputs of every stride
    order of small tensors with dimensions of size 1)."""
    import itertools
    from conv_patch.specs import suggests_channels_last
    w = torch.randn(2, 1, 1, 1).contiguous(memory_format=torch.channels_last)  # suggests neither
    for shape in itertools.product([1, 2], [1, 3], [1, 2], [1, 4]):
        for perm in itertools.permutations(range(4)):
            x = torch.randn([shape[p] for p in perm]).permute([perm.index(i) for i in range(4)])
            y = F.conv2d(x, w[:, :1].expand(2, shape[1], 1, 1).contiguous())
            want = y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
            if y.is_contiguous() and y.is_contiguous(memory_format=torch.channels_last):
                continue  # the output's own strides cannot tell
            assert suggests_channels_last(tuple(x.shape), x.stride()) == want, (shape, perm, x.stride())


def test_output_strides_match_pytorch_fuzzed(device, exact_fp32):
    seen = _fuzz_strides(device, 120 if device.type == "cpu" else 400, seed=3)
    # The fuzz reached one-channel inputs whose output PyTorch makes channels_last.
    assert any(c_in == 1 and not contiguous for c_in, contiguous, _ in seen)


@pytest.mark.gpu
def test_output_strides_match_pytorch_fuzzed_cuda(exact_fp32):
    _fuzz_strides(torch.device("cuda"), 400, seed=4)


# -- calls from several threads ----------------------------------------------------------
def test_recording_is_per_thread():
    """A plan built in one thread records its own launches and scratch only,
    while another thread launches (or records) at the same time."""
    import threading
    from conv_patch.kernels import launch as _launch
    recording = threading.Event()
    other_done = threading.Event()
    seen = {}

    def other():
        recording.wait()
        seen["loose"] = _launch.empty((3,), dtype=torch.float32, device="cpu")
        with _launch.recording() as rb:
            seen["mine_b"] = _launch.empty((4,), dtype=torch.float32, device="cpu")
        seen["rb"] = rb
        other_done.set()

    t = threading.Thread(target=other)
    t.start()
    with _launch.recording() as ra:
        recording.set()
        assert other_done.wait(10)
        mine_a = _launch.empty((5,), dtype=torch.float32, device="cpu")
    t.join()
    assert [x is mine_a for x in ra.scratch] == [True]
    assert [x is seen["mine_b"] for x in seen["rb"].scratch] == [True]
    # Both recordings closed: nothing records now, in either thread.
    _launch.empty((1,), dtype=torch.float32, device="cpu")
    assert len(ra.scratch) == 1 and len(seen["rb"].scratch) == 1


def test_concurrent_misses_build_one_plan(monkeypatch):
    """Threads missing one signature at once build it once (dispatch's build
    lock), each getting PyTorch's answer."""
    import threading
    import time
    net, twin = _pair(nn.Conv2d(4, 6, 3, padding=1))
    builds = []
    real = planner._build

    def slow_build(*a, **k):
        builds.append(threading.get_ident())
        time.sleep(0.05)  # a compile: long enough for the others to miss too
        return real(*a, **k)

    monkeypatch.setattr(planner, "_build", slow_build)
    # Autograd on: the plan is PyTorch's own, so no kernel runs concurrently
    # (the Triton interpreter is not thread-safe; the GPU test runs kernels).
    x = torch.randn(1, 4, 6, 6)
    want = twin(x).detach()
    start = threading.Barrier(4)
    results = [None] * 4

    def call(i):
        start.wait()
        results[i] = net(x).detach()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert all(rel_err(y, want) <= TOL[torch.float32] for y in results)


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [True, False], ids=["own-streams", "default-stream"])
def test_threads_share_one_patched_vae_on_the_gpu(streams, exact_fp32):
    """8 threads run one patched VAE (recipes, kernels, GroupNorm, packs) on
    inputs of their own, many times, each on its own CUDA stream or all on
    the default one; every result is the unpatched VAE's."""
    import threading
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
        norm_num_groups=8, sample_size=64).cuda().eval()
    twin = copy.deepcopy(vae)
    conv_patch.apply(vae, config=KERNELS)
    n_threads, iters = 8, 20
    inputs = [torch.randn(1, 3, 64 + 8 * (i % 2), 64, device="cuda") for i in range(n_threads)]
    with torch.no_grad():
        want = [twin(x).sample for x in inputs]
    torch.cuda.synchronize()
    errors, start = [], threading.Barrier(n_threads)

    def worker(i):
        try:
            stream = torch.cuda.Stream() if streams else torch.cuda.default_stream()
            start.wait()
            with torch.no_grad(), torch.cuda.stream(stream):
                for it in range(iters):
                    y = vae(inputs[i]).sample
                    stream.synchronize()
                    err = rel_err(y, want[i])
                    if err > 1e-4:
                        errors.append((i, it, err))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


def test_meta_tensors_give_the_modules_shapes():
    """A patched model traced with meta tensors (shape inference, as
    accelerate's empty-weight loading does) gives the original's shapes
    instead of asking a meta device about autocast."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.SiLU(), nn.Conv2d(5, 7, 3, stride=2)).to("meta")
    ref = net(torch.empty(2, 3, 11, 13, device="meta"))
    conv_patch.apply(net)
    for _ in range(2):  # planned, then replayed
        y = net(torch.empty(2, 3, 11, 13, device="meta"))
        assert y.is_meta and y.shape == ref.shape and y.stride() == ref.stride()
