"""The dispatch core (conv_patch/runtime/dispatch.py, planner.py, plans.py):
one plan per call signature, replayed launches, invalidation, the work a
planned call does, and the cost model's decisions (routing/costs.py, as
routing/decide.py weighs a call)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conv_patch
from conv_patch.routing import tables as config_tables, costs
from conv_patch.runtime import dispatch, planner
from conv_patch.kernels import launch as _launch
from conv_patch.routing.registry import Route
from conv_patch.routing.decide import RouteDecision, decide
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import Target
from conv_patch.runtime.state import state_of
from conv_patch.runtime.plans import KernelFailureWarning
from conv_patch.routing.decide import LEAN
from conv_patch.runtime.plans import KERNEL
from _util import TOL, rel_err


def _net(device, k=3):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(6, 10, k, padding=k // 2)).to(device)
    twin = copy.deepcopy(net)
    # The wrapper's own dispatch at every call (passed through, an idle conv
    # would run as nn.Conv2d from the third call on: test_passthrough.py).
    conv_patch.apply(net, recipes=False, config=conv_patch.PatchConfig(passthrough=False))
    return net, twin


def _plans(m):
    return state_of(m).plans or {}


def test_a_slow_first_call_says_what_is_compiling(device, exact_fp32, monkeypatch, capsys):
    """A plan build still running after ``COMPILE_NOTICE_S`` (its kernels
    compiling) prints one line naming the conv and its input on stderr; a
    quick one (a float64 call PyTorch takes) prints nothing, and the answer
    is the unpatched one either way."""
    import time
    from conv_patch.runtime import plans
    net, twin = _net(device)
    real = planner._build
    monkeypatch.setattr(plans, "COMPILE_NOTICE_S", 0.5)
    with torch.no_grad():
        x = torch.randn(2, 6, 7, 9, device=device, dtype=torch.float64)
        assert rel_err(net.double()(x), twin.double()(x)) <= TOL[torch.float32]
        assert capsys.readouterr().err == ""
        net.float(), twin.float()
        monkeypatch.setattr(planner, "_build", lambda *a, **k: time.sleep(1.5) or real(*a, **k))
        x = torch.randn(1, 6, 5, 11, device=device)
        assert rel_err(net(x), twin(x)) <= TOL[torch.float32]
    err = capsys.readouterr().err
    if device.type == "cpu" and not plans.interpreter_enabled():
        assert err == ""  # nothing compiles there
    else:
        assert err.count("\n") == 1 and "compiling kernels for PatchedConv2d 6->10 k3x3" in err
        assert "(1, 6, 5, 11)" in err


def test_build_notices_start_no_thread_per_build(device, monkeypatch, capsys):
    """Every build's notice is watched by one thread for the process, not a
    thread per build (a first call builds hundreds of plans): many quick
    builds start at most that one thread and print nothing; a slow one
    after them still prints its line once, and a build nested in it none."""
    import threading
    import time
    from conv_patch.runtime import plans
    if device.type == "cpu" and not plans.interpreter_enabled():
        pytest.skip("no notice where nothing compiles")
    monkeypatch.setattr(plans, "COMPILE_NOTICE_S", 0.3)
    starts = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: starts.append(self.name) or real_start(self))
    x = torch.zeros(1, device=device)
    for _ in range(50):
        with plans.building(x, lambda: "quick"):
            pass
    with plans.building(x, lambda: "slow"):
        with plans.building(x, lambda: "nested"):
            time.sleep(0.8)
    time.sleep(0.1)
    assert len(starts) <= 1, starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compiling kernels for slow" in err


def test_one_plan_per_signature_and_replayed_launches(device, exact_fp32, monkeypatch):
    net, twin = _net(device)
    conv = net[0]
    builds = []
    real_build = planner.build
    monkeypatch.setattr(planner, "build", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    launches = []
    real_launch = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: launches.append(1) or real_launch(*a, **k))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 6, 7, 9, device=device)
            assert rel_err(net(x), twin(x)) <= TOL[torch.float32]
    assert len(builds) == 1 and len(_plans(conv)) == 1
    plan = next(iter(_plans(conv).values()))
    assert plan.kind == KERNEL and plan.program is not None
    # The launchers ran once, while the plan was built; later calls replay.
    assert len(plan.program.launches) == 1
    assert len(launches) <= 1


@pytest.mark.parametrize("change", ["shape", "dtype", "layout", "epilogue", "grad"])
def test_plan_cache_follows_the_signature(change, device, exact_fp32):
    net, twin = _net(device)
    conv = net[0]
    x = torch.randn(1, 6, 8, 8, device=device)
    with torch.no_grad():
        conv(x)
    kw = {}
    if change == "shape":
        x = torch.randn(1, 6, 5, 11, device=device)
    elif change == "dtype":
        net.double()
        twin.double()
        x = x.double()
    elif change == "layout":
        x = x.contiguous(memory_format=torch.channels_last)
    elif change == "epilogue":
        kw = {"activation": "silu"}
    if change == "grad":
        y = conv(x)
        assert y.requires_grad and "autograd" in state_of(conv).last.reason
        ref = twin(x)
    else:
        with torch.no_grad():
            y = conv(x, **kw)
            ref = twin(x)
            if kw:
                ref = F.silu(ref)
    # .double() drops the plans (a moved or re-typed weight); then one new one.
    assert len(_plans(conv)) == (1 if change == "dtype" else 2)
    assert rel_err(y, ref) <= TOL[y.dtype if y.dtype != torch.float64 else torch.float32]


def test_to_and_attribute_changes_drop_plans(device, exact_fp32):
    net, twin = _net(device)
    conv = net[0]
    x = torch.randn(1, 6, 8, 8, device=device)
    with torch.no_grad():
        conv(x)
        assert _plans(conv)
        net.to(device)
        assert not _plans(conv)
        conv(x)
        conv.padding = (0, 2)
        twin[0].padding = (0, 2)
        assert not _plans(conv)
        assert rel_err(conv(x), twin(x)) <= TOL[torch.float32]


@pytest.mark.parametrize("k", [5, 1])
def test_weight_replaced_by_another_shape_computes_like_pytorch(k, device, exact_fp32):
    """PyTorch computes from the weight it finds; the wrapper must not take
    channels or kernel size from the module's attributes and read past the
    end of a smaller weight."""
    net, twin = _net(device)
    x = torch.randn(1, 6, 9, 9, device=device)
    with torch.no_grad():
        net(x)  # a plan exists for the old weight
        w = torch.randn(10, 6, k, k, device=device)
        net[0].weight = nn.Parameter(w.clone())
        twin[0].weight = nn.Parameter(w.clone())
        out, ref = net(x), twin(x)
    assert out.shape == ref.shape and rel_err(out, ref) <= TOL[torch.float32]
    assert "does not match" in state_of(net[0]).last.reason
    # Fewer input channels than the input has: PyTorch's own error.
    net[0].weight = nn.Parameter(torch.randn(10, 4, 3, 3, device=device))
    twin[0].weight = nn.Parameter(net[0].weight.detach().clone())
    with torch.no_grad(), pytest.raises(RuntimeError) as ours:
        net(x)
    with torch.no_grad(), pytest.raises(RuntimeError) as theirs:
        twin(x)
    assert type(ours.value) is type(theirs.value)


def test_in_place_edit_seen_by_replayed_plan(device, exact_fp32):
    net, twin = _net(device)
    x = torch.randn(1, 6, 8, 8, device=device)
    with torch.no_grad():
        for edit in (lambda p: p.data.mul_(-2.0), lambda p: p.data.copy_(torch.randn_like(p))):
            net(x)
            edit(net[0].weight)
            twin[0].weight.data.copy_(net[0].weight.data)
            assert rel_err(net(x), twin(x)) <= TOL[torch.float32]
    assert len(_plans(net[0])) == 1


def test_residual_aliasing_is_part_of_the_signature(device, exact_fp32):
    """A plan recorded with ``out is residual`` must not be replayed for a
    call whose out is another tensor (its result would land in the residual)."""
    torch.manual_seed(1)
    conv = nn.Conv2d(6, 6, 3, padding=1).to(device)
    twin = copy.deepcopy(conv)
    net = nn.Sequential(conv)
    conv_patch.apply(net, recipes=False)
    w = net[0]
    x = torch.randn(1, 6, 8, 8, device=device)
    with torch.no_grad():
        r = torch.randn(1, 6, 8, 8, device=device)
        r0 = r.clone()
        w(x, residual=r, out=r)
        assert rel_err(r, twin(x) + r0) <= TOL[torch.float32]
        r2, out = torch.randn(1, 6, 8, 8, device=device), torch.empty(1, 6, 8, 8, device=device)
        r2c = r2.clone()
        w(x, residual=r2, out=out)
        assert torch.equal(r2, r2c) and rel_err(out, twin(x) + r2) <= TOL[torch.float32]


def test_kernel_failure_falls_back_once_for_every_caller(device, exact_fp32, monkeypatch):
    """The recipes' fused steps reach the kernels through the same entry:
    a launch failure falls back there too."""
    from triton.runtime.errors import OutOfResources

    def no_room(*a, **k):
        raise OutOfResources(262144, 232448, "shared memory")

    from conv_patch.kernels import conv2d as kernel_module
    monkeypatch.setattr(kernel_module, "launch_conv2d", no_room)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(8, 4, 3, padding=1)).to(device)
    twin = copy.deepcopy(net)
    conv_patch.apply(net)  # the Sequential chain recipe calls the convs with fused ReLUs
    x = torch.randn(1, 3, 8, 8, device=device)
    with torch.no_grad(), pytest.warns(KernelFailureWarning):
        out = net(x)
    assert rel_err(out, twin(x)) <= TOL[torch.float32]
    assert "kernel failed here" in state_of(net[0]).last.reason


def _pytorch_route_counting_keys(device, monkeypatch):
    """``_net``'s pair with every call planned on PyTorch's route, and the
    list that grows by one at each ``conv_key`` (each full signature built)."""
    real_decide = planner.decide_call

    def pytorch_route(*a, **k):
        decision, spec = real_decide(*a, **k)
        return RouteDecision(Route.FALLBACK, "test: PyTorch's route"), spec

    monkeypatch.setattr(planner, "decide_call", pytorch_route)
    keys = []
    real_key = dispatch.conv_key
    monkeypatch.setattr(dispatch, "conv_key", lambda *a, **k: keys.append(1) or real_key(*a, **k))
    net, twin = _net(device)
    return net, twin, keys


def test_bare_plan_fast_path_is_the_module_whatever_changes(device, exact_fp32, monkeypatch):
    """A plain call whose plan is one F.conv2d is found by ``bare_slot``
    without ``conv_key``; it still computes what the module computes after
    in-place and ``.data`` edits, a parametrization registered later, an
    attribute change and under autograd."""
    net, twin, keys = _pytorch_route_counting_keys(device, monkeypatch)
    conv = net[0]
    x = torch.randn(2, 6, 7, 9, device=device)
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(net(x), twin(x)) <= TOL[torch.float32]
        assert len(keys) == 1 and state_of(conv).last.reason == "test: PyTorch's route"
        for _ in range(2):  # an activation after it: a plan of its own, then the fast path
            assert rel_err(conv(x, activation="silu"), F.silu(twin(x))) <= TOL[torch.float32]
        assert len(keys) == 2
        keys.clear()
        keys.append(1)
        conv.weight.data.mul_(-3.0)
        twin[0].weight.data.mul_(-3.0)
        assert rel_err(net(x), twin(x)) <= TOL[torch.float32]
        w = torch.randn_like(conv.weight)
        conv.weight.data = w.clone()
        twin[0].weight.data = w.clone()
        assert rel_err(net(x), twin(x)) <= TOL[torch.float32]
        assert len(keys) == 1
        # Another input geometry: a plan of its own, then the fast path.
        x2 = torch.randn(1, 6, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
        for _ in range(2):
            assert rel_err(net(x2), twin(x2)) <= TOL[torch.float32]
        assert len(keys) == 2
        conv.stride = (2, 1)
        twin[0].stride = (2, 1)
        assert rel_err(net(x), twin(x)) <= TOL[torch.float32]
        assert len(keys) == 3
    y = net(x.requires_grad_())
    y.sum().backward()
    ref = twin(x.detach().requires_grad_())
    ref.sum().backward()
    assert y.grad_fn is not None and rel_err(conv.weight.grad, twin[0].weight.grad) <= TOL[torch.float32]
    torch.nn.utils.parametrizations.weight_norm(conv)
    torch.nn.utils.parametrizations.weight_norm(twin[0])
    with torch.no_grad():
        assert rel_err(net(x), twin(x)) <= TOL[torch.float32]


def _python_calls(fn) -> list:
    """The Python functions one call of ``fn`` enters (sys.setprofile)."""
    import sys
    names = []

    def prof(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


def test_bare_fast_path_costs_no_more_python_than_the_module(device, exact_fp32, monkeypatch):
    """Host cost counted, not timed: a planned call of PyTorch's route
    enters no more Python functions than the unpatched module's own call
    and none of ``nn.Module.__getattr__``'s lookups; with an
    epilogue (a UNet resnet's conv2: shortcut and 1/output_scale_factor)
    no more than the module followed by the same eager ops."""
    net, twin, keys = _pytorch_route_counting_keys(device, monkeypatch)
    conv, ref = net[0], twin[0]
    x = torch.randn(2, 6, 7, 9, device=device)
    res = torch.randn(2, ref.out_channels, 7, 9, device=device)
    with torch.no_grad():
        for _ in range(2):
            conv(x)
            conv(x, residual=res, out_scale=0.5)
        assert len(keys) == 2
        ours, theirs = _python_calls(lambda: conv(x)), _python_calls(lambda: ref(x))
        assert "__getattr__" not in ours and len(ours) <= len(theirs), (ours, theirs)
        ours = _python_calls(lambda: conv(x, residual=res, out_scale=0.5))
        theirs = _python_calls(lambda: (ref(x) + res) * 0.5)
        assert len(ours) <= len(theirs) + 3, (ours, theirs)
        assert len(keys) == 2


def test_recorded_kernel_plans_are_found_on_the_bare_path(device, exact_fp32, monkeypatch):
    """A plain call of a recorded kernel plan replays from its bare slot,
    without ``conv_key``, the ``Call`` or the full path's frames; what the
    slot does not hold is checked: a replaced weight, autograd, autocast and
    a residual of another shape (same strides) each take the full path, and
    every answer is the unpatched one."""
    net, twin = _net(device)
    conv, ref = net[0], twin[0]
    keys = []
    real_key = dispatch.conv_key
    monkeypatch.setattr(dispatch, "conv_key", lambda *a, **k: keys.append(1) or real_key(*a, **k))
    x = torch.randn(2, 6, 7, 9, device=device)
    res = torch.randn(2, 10, 7, 9, device=device)
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(conv(x), ref(x)) <= TOL[torch.float32]
            assert rel_err(conv(x, residual=res, activation="silu"), F.silu(ref(x) + res)) <= TOL[torch.float32]
        assert len(keys) == 2 and all(p.kind == KERNEL for p in _plans(conv).values())
        names = _python_calls(lambda: conv(x))
        assert "conv_key" not in names and "cp_call" not in names and "replay" in names, names
        # An in-place edit is read by the replay (the pack is refreshed).
        conv.weight.mul_(-2.0)
        ref.weight.mul_(-2.0)
        assert rel_err(conv(x), ref(x)) <= TOL[torch.float32] and len(keys) == 2
        # A replaced parameter: the full path, a plan of its own.
        w = torch.randn_like(conv.weight) * 0.3
        conv.weight = nn.Parameter(w.clone())
        ref.weight = nn.Parameter(w.clone())
        assert rel_err(conv(x), ref(x)) <= TOL[torch.float32] and len(keys) == 3
        # A residual whose strides equal the slot's but whose shape does not.
        thin = torch.randn(1, 10, 7, 9, device=device)
        assert thin.stride() == res.stride()
        n = len(keys)
        try:
            y = conv(x, residual=thin, activation="silu")
        except ValueError:
            pass
        else:
            assert rel_err(y, F.silu(ref(x) + thin)) <= TOL[torch.float32]
        assert len(keys) == n + 1
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y, want = conv(x), ref(x)
        assert y.dtype == want.dtype and rel_err(y, want) <= TOL[torch.bfloat16] and len(keys) == n + 2
    # Autograd: the full path, with a graph to differentiate.
    y = conv(x)
    assert y.grad_fn is not None and len(keys) == n + 3 and rel_err(y, ref(x)) <= TOL[torch.float32]


def test_bare_fast_path_stays_off_conv_patchs_graph_path(device, exact_fp32, monkeypatch):
    """On conv-patch's own graph path (warm-up and capture, where a launch
    costs GPU time only) a call is never found on the bare path, and on a
    GPU (where the graph path is costed by GPU time) a plan made there is
    not remembered for eager calls."""
    from conv_patch.runtime import pack
    net, twin, keys = _pytorch_route_counting_keys(device, monkeypatch)
    conv = net[0]
    x = torch.randn(2, 6, 7, 9, device=device)
    with torch.no_grad():
        with pack.graph_path():
            for _ in range(2):
                assert rel_err(conv(x), twin[0](x)) <= TOL[torch.float32]
        assert len(keys) == 2 and bool(state_of(conv).bare) == (not x.is_cuda)
        for _ in range(3):
            assert rel_err(conv(x), twin[0](x)) <= TOL[torch.float32]
        assert len(keys) == 2 + x.is_cuda and len(state_of(conv).bare) == 1
        with pack.graph_path():
            conv(x)
        assert len(keys) == 3 + x.is_cuda


def test_a_plan_built_inside_someone_elses_capture_is_weighed_for_it_and_not_kept(device, exact_fp32,
                                                                                   monkeypatch):
    """A plan's signature holds conv-patch's own graph path, not a CUDA
    query per call: a call made while another party captures a CUDA graph
    (``pack.foreign_capture``, asked only when a plan is built) is weighed
    as on the graph path and its plan is not kept, so the eager calls
    after it build their own."""
    from conv_patch.runtime import pack
    net, twin = _net(device)
    conv = net[0]
    graphs = []
    real_decide = planner.decide_call
    monkeypatch.setattr(planner, "decide_call", lambda *a: graphs.append(a[-1]) or real_decide(*a))
    monkeypatch.setattr(pack, "foreign_capture", lambda t: True)
    x = torch.randn(2, 6, 7, 9, device=device)
    with torch.no_grad():
        for _ in range(2):
            assert rel_err(conv(x), twin(x)) <= TOL[torch.float32]
        assert graphs == [True, True] and not _plans(conv) and not state_of(conv).bare
        monkeypatch.setattr(pack, "foreign_capture", lambda t: False)
        for _ in range(2):
            assert rel_err(conv(x), twin(x)) <= TOL[torch.float32]
        assert graphs == [True, True, False] and len(_plans(conv)) == 1


@pytest.mark.gpu
def test_eager_plans_replay_inside_a_users_cuda_graph():
    """A user's own ``torch.cuda.graph`` capture of a patched model (its
    plans built eagerly before) records the plans' launches, and the
    replays compute what the unpatched model computes on new data; a
    shape first seen inside the capture is built there and not kept."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, 32, 1), nn.Conv2d(32, 8, 3))
    net = net.cuda().half().eval()
    twin = copy.deepcopy(net)
    conv_patch.apply(net)
    x = torch.randn(2, 16, 96, 80, device="cuda", dtype=torch.half)
    with torch.no_grad():
        for _ in range(3):
            net(x)
        torch.cuda.synchronize()
        kept = [len(_plans(m)) for m in net if conv_patch.is_patched(m)]
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g):
                y = net(x)
                z = net[0](x[:, :, :40])  # a shape first seen inside the capture
        torch.cuda.current_stream().wait_stream(s)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            g.replay()
            torch.cuda.synchronize()
            assert rel_err(y, twin(x)) <= TOL[torch.float16]
            assert rel_err(z, twin[0](x[:, :, :40])) <= TOL[torch.float16]
        assert [len(_plans(m)) for m in net if conv_patch.is_patched(m)] == kept


def test_bare_fast_path_takes_the_epilogue_eagerly(device, exact_fp32, monkeypatch):
    """A call with a residual, scale and activation whose plan is PyTorch's
    route is found again without ``conv_key`` (a UNet resnet's conv1 adds
    the time embedding, conv2 the shortcut): the same result as the module
    and eager ops, a residual of another layout or dtype gets a plan of its
    own, and a residual of the wrong shape is still refused."""
    net, twin, keys = _pytorch_route_counting_keys(device, monkeypatch)
    conv = net[0]
    torch.manual_seed(3)
    x = torch.randn(2, 6, 7, 9, device=device)
    ref_y = twin(x)
    res = torch.randn_like(ref_y)
    shift = torch.randn(2, ref_y.shape[1], 1, 1, device=device).expand_as(ref_y)
    with torch.no_grad():
        for _ in range(3):
            got = conv(x, residual=res, beta=0.5, activation="silu", out_scale=0.25)
            assert rel_err(got, 0.25 * F.silu(twin(x) + 0.5 * res)) <= TOL[torch.float32]
        assert len(keys) == 1
        for _ in range(2):  # a zero-stride residual: its own slot, then the fast path
            assert rel_err(conv(x, residual=shift), twin(x) + shift) <= TOL[torch.float32]
        assert len(keys) == 2
        res_nhwc = res.contiguous(memory_format=torch.channels_last)
        assert rel_err(conv(x, residual=res_nhwc, beta=0.5, activation="silu", out_scale=0.25),
                       0.25 * F.silu(twin(x) + 0.5 * res)) <= TOL[torch.float32]
        assert len(keys) == 3
        # Another beta is another call: planned again.
        assert rel_err(conv(x, residual=res, beta=2.0), twin(x) + 2.0 * res) <= TOL[torch.float32]
        assert len(keys) == 4
        with pytest.raises(ValueError):
            conv(x, residual=res[:, :, :-1], beta=0.5, activation="silu", out_scale=0.25)


def test_group_norm_plan_replays(device):
    torch.manual_seed(0)
    # On a GPU the kernels take a GroupNorm only from costs.GROUP_NORM_MIN_ELEMENTS on.
    shape = (2, 12, 5, 7) if device.type == "cpu" else (1, 64, 256, 257)
    norm = nn.GroupNorm(4, shape[1]).to(device)
    net = nn.Sequential(norm)
    conv_patch.apply(net)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(*shape, device=device)
            assert rel_err(net(x), F.group_norm(x.double(), 4, norm.weight.double(), norm.bias.double())) <= 1e-5
    plans = list(_plans(net[0]).values())
    assert len(plans) == 1 and plans[0].kernel and plans[0].program is not None


class _FakeKernel:
    """Records the arguments it is launched with (``kernel[grid](*args)``)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append(args)


def test_program_substitutes_roles_views_and_scratch():
    k = _FakeKernel()
    rec = _launch.Recorder()
    x = torch.zeros(2, 4)
    scratch = torch.empty(3)
    rec.scratch.append(scratch)
    rec.launches.append((k, (1,), (x, x[1:], scratch, 7), {}, None, None, None))
    prog = _launch.Program(rec, (x, None), x[1, 1:])
    y = torch.arange(8.0).view(2, 4)
    out = prog((y, None))
    (a, v, s, n), = k.calls
    assert a is y and torch.equal(v, y[1:]) and s.shape == (3,) and s.data_ptr() != scratch.data_ptr() and n == 7
    assert torch.equal(out, y[1, 1:])


def test_program_rejects_foreign_tensors():
    """A launch argument that is no role, view of one, or scratch makes the
    call unrecordable (the plan then calls the launchers each time)."""
    rec = _launch.Recorder()
    x, foreign = torch.zeros(4), torch.zeros(4)
    rec.launches.append((_FakeKernel(), (1,), (x, foreign, 3), {}, None, None, None))
    with pytest.raises(_launch.Unrecordable):
        _launch.Program(rec, (x,), x)


# -- the cost model -----------------------------------------------------------------
def _problem(n=1, c_in=64, c_out=64, size=64, k=3, layout="nchw"):
    return costs.Problem.of(n, c_in, size, size, c_out, k, k, size, size, 2, layout)


def _fit(cudnn_tflops=500.0, ours_tflops=650.0, c0=0.01, ours_c0=None):
    models = {}
    for side, tf, c in (("theirs", cudnn_tflops, c0), ("ours", ours_tflops, c0 if ours_c0 is None else ours_c0)):
        for one in (False, True):
            models[(side, one, "any")] = (c, 1.0 / tf, 0.0)
    return costs.Fit(models, 10)


CASES = [
    # (problem, fit, exact, launches, graph, expected kernel?)
    ("large, ours faster", _problem(size=512, c_in=256, c_out=256), _fit(), None, 1, False, True),
    ("large, ours slower", _problem(size=512, c_in=256, c_out=256), _fit(ours_tflops=300), None, 1, False, False),
    ("tiny, host-bound, 3 launches", _problem(size=8, c_in=16, c_out=16), _fit(c0=0.002), None, 3, False, False),
    ("tiny, in a graph: GPU time only", _problem(size=8, c_in=16, c_out=16), _fit(c0=0.006, ours_c0=0.002), None,
     1, True, True),
    ("measured: cuDNN faster", _problem(), None, {"ours_ms": 0.5, "cudnn_ms": 0.4}, 1, False, False),
    ("measured: ours faster", _problem(), None, {"ours_ms": 0.3, "cudnn_ms": 0.4}, 1, False, True),
    ("within the margin", _problem(), None, {"ours_ms": 0.38, "cudnn_ms": 0.4}, 1, False, False),
    ("nothing measured", _problem(), None, None, 1, False, False),
]


@pytest.mark.parametrize("name,p,fitted,exact,launches,graph,want", CASES, ids=[c[0] for c in CASES])
def test_cost_model_decisions(name, p, fitted, exact, launches, graph, want):
    # (A weight in the kernels' layout: the refresh is the next test's.)
    assert costs.choose(p, fitted, exact, launches=launches, ops=0, graph=graph, packed=False).kernel is want


def test_a_packed_weight_adds_its_refresh_to_the_kernel_time():
    """The tables time a kernel on a ready pack; a call whose weight is
    packed refreshes it first. A UNet's deepest 3x3 conv (2560->1280 on
    8x8, a 59 MB weight), measured faster than cuDNN NCHW on a ready pack
    (0.135 vs 0.189 ms on the H200), loses once the eager refresh is
    counted, as it did launched (0.216 vs 0.195 ms); a weight already in
    the kernels' layout has nothing to refresh, and in a graph the pack
    kernel refreshes it at the copy bandwidth."""
    p = costs.Problem.of(2, 2560, 8, 8, 1280, 3, 3, 8, 8, 2, "nchw")
    cal = costs.default_calibration()
    assert costs.refresh_ms(p, False, cal) == pytest.approx(
        cal.launch_ms + 2 * 2560 * 1280 * 9 * 2 / (cal.refresh_tbps * 1e9))
    assert costs.refresh_ms(p, True, cal) < costs.refresh_ms(p, False, cal)
    exact = {"ours_ms": 0.1346, "cudnn_ms": 0.1892}
    got = costs.choose(p, None, exact, launches=2, ops=0, graph=False, packed=True, descriptors=3)
    assert not got.kernel and "PyTorch faster" in got.why
    assert costs.choose(p, None, exact, launches=2, ops=0, graph=False, packed=False, descriptors=3).kernel
    assert costs.choose(p, None, exact, launches=2, ops=0, graph=True, packed=True, descriptors=3).kernel


def test_lean_route_only_where_the_host_hides_its_gpu_time():
    fitted = _fit(c0=0.002)
    assert costs.choose_lean(_problem(size=16, c_in=16, c_out=16), fitted, None, ops=0).kernel
    assert not costs.choose_lean(_problem(size=256, c_in=256, c_out=256), fitted, None, ops=0).kernel


def test_lean_route_needs_a_real_host_saving():
    """cuDNN's 1x1 call costs about as much host time as the lean kernel's
    launch, so a 1x1 conv stays on PyTorch however host-bound; a 3x3 conv
    of the same size, whose cuDNN call costs more, takes the lean route."""
    fitted = _fit(c0=0.002)
    one = _problem(size=16, c_in=16, c_out=16, k=1)
    three = _problem(size=16, c_in=16, c_out=16)
    assert (costs.conv_host_ms(three) - costs.host_ms(1)) * 1e3 >= costs.default_calibration().lean_min_saving_us
    assert costs.choose_lean(three, fitted, None, ops=0).kernel
    got = costs.choose_lean(one, fitted, None, ops=0)
    assert not got.kernel and "would save" in got.why
    # Where cuDNN's 1x1 call were dearer, the same rule would take it.
    cal = costs.default_calibration()
    assert costs.choose_lean(one, fitted, None, ops=0, cal=cal.with_host(conv_1x1=cal.host_us["conv"])).kernel
    # A call whose cuDNN GPU time exceeds its host time is not the lean
    # route's, even where its model says the lean kernel is faster still.
    measured = {"cudnn_ms": costs.conv_host_ms(three) * 1.5}
    assert costs.lean_ms(three) < measured["cudnn_ms"]
    got = costs.choose_lean(three, fitted, measured, ops=0)
    assert not got.kernel and "GPU-bound" in got.why


def test_lean_gpu_time_counts_waves_of_tiles():
    """The lean kernel's time is its waves of 128x64 tiles times their K
    steps: a deep conv on a small image (a UNet's 16x16 level: 40 tiles of
    360 steps on 132 SMs) is far slower than its arithmetic at the kernel's
    full rate, and so is a 2560-deep 8x8 one; a wide shallow one is not."""
    deep_small = _problem(c_in=1280, c_out=1280, size=16)
    assert costs.lean_ms(deep_small) > 0.3  # measured 0.35 ms on the H200 (cuDNN 0.10)
    assert costs.lean_ms(_problem(c_in=2560, c_out=1280, size=8)) > 0.8  # measured 0.95
    assert costs.lean_ms(_problem(c_in=16, c_out=16, size=64)) < 0.02  # measured 0.010
    # Twice the SMs, half the waves once the tiles fill them.
    wide = _problem(c_in=64, c_out=64, size=512)
    assert costs.lean_ms(wide, sms=264) < 0.6 * costs.lean_ms(wide, sms=132)
    # Host-bound but slow on the GPU: PyTorch keeps it.
    fitted = _fit(c0=0.002, cudnn_tflops=150)
    assert not costs.choose_lean(deep_small, fitted, {"cudnn_ms": 0.104}, ops=0).kernel


def test_a_config_whose_tiles_leave_sms_idle_is_slowed_by_the_fill_factor():
    """A shape never measured, run with 128x256 tiles on a 16x16 image
    (2 x 5 tiles on 132 SMs), is not as fast as the fit of shapes that fill
    the GPU says: the fill factor keeps PyTorch there; a measured shape is
    judged by its measurement alone."""
    p = _problem(c_in=2560, c_out=1280, size=16)
    cfg = {"route": "tma", "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}
    assert costs.fill_factor(p, cfg, 132) == pytest.approx(132 / 10)
    assert costs.fill_factor(_problem(size=512), cfg, 132) == 1.0
    fitted = _fit(cudnn_tflops=300, ours_tflops=600, c0=0.002)
    assert costs.choose(p, fitted, None, launches=1, ops=0, graph=True, packed=False).kernel
    assert not costs.choose(p, fitted, None, launches=1, ops=0, graph=True, packed=False, config=cfg).kernel
    assert costs.choose(p, None, {"ours_ms": 0.1, "cudnn_ms": 0.2}, launches=1, ops=0, graph=True, packed=False,
                        config=cfg).kernel


def test_fused_epilogue_and_group_norm_thresholds():
    small, big = _problem(size=8), _problem(size=1024, c_out=256)
    assert not costs.fused_epilogue_pays(small, 1, False, False)  # one eager op is cheaper than a launch
    assert costs.fused_epilogue_pays(big, 2, True, False)
    assert not costs.fused_epilogue_pays(big, 0, False, False)
    # Host-bound (its conv's GPU time hides behind the host's): the pass
    # launched through its launcher costs more host time than two eager ops.
    mid = _problem(size=512, c_out=64)
    assert not costs.fused_epilogue_pays(mid, 2, True, False, gpu_conv=0.01)
    # GPU-bound: the two passes over its 32 MB output it saves are what counts.
    assert costs.fused_epilogue_pays(mid, 2, True, False, gpu_conv=0.12)
    assert not costs.group_norm_pays(costs.GROUP_NORM_MIN_ELEMENTS - 1)
    assert costs.group_norm_pays(costs.GROUP_NORM_MIN_ELEMENTS)
    # Few groups of many elements (TAEF2's GroupNorm(4, 256) at a 64^2
    # latent: PyTorch's moments kernel runs one block a row) pay below it;
    # 32 groups of a tensor whose rows are as long (a UNet's, a VAE's) do not.
    taef2 = 1 * 256 * 64 * 64
    assert costs.group_norm_pays(taef2, 1 * 4) and not costs.group_norm_pays(taef2)
    assert not costs.group_norm_pays(taef2, 1 * 32) and not costs.group_norm_pays(taef2 * 2, 1 * 32)
    assert not costs.group_norm_pays(4 * costs.GROUP_NORM_ROW_ELEMENTS - 1, 4)


def test_fit_recovers_the_model_it_was_measured_with():
    """Synthetic exact entries made from a known cost model: the fit must
    give their times back."""
    spec = ConvSpec(False, 64, 64, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (0, 0), 1, "zeros", True)
    exact = {}
    for c, s in [(64, 32), (128, 64), (256, 128), (512, 256), (64, 512), (128, 128)]:
        sp = ConvSpec(False, c, c, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (0, 0), 1, "zeros", True)
        p = _problem(c_in=c, c_out=c, size=s)
        key = config_tables.shape_key(sp, (1, c, s, s), "nchw", torch.bfloat16)
        exact[key] = {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64,
                      "cudnn_ms": 0.01 + p.flops / 400e9, "ours_ms": 0.02 + p.flops / 600e9}
    f = costs.fit({"conv2d": {"exact": exact}})
    assert f is not None and spec is not None
    p = _problem(c_in=320, c_out=320, size=96)
    assert f.cudnn_ms(p) == pytest.approx(0.01 + p.flops / 400e9, rel=1e-3)
    assert f.ours_ms(p) == pytest.approx(0.02 + p.flops / 600e9, rel=1e-3)
    assert costs.fit({"conv2d": {"exact": {}}}) is None


def test_weigh_keeps_pytorch_where_nothing_was_measured():
    """An architecture without a table of its own (the curated default has
    no measurements): every call stays on PyTorch, never a guess."""
    spec = ConvSpec(False, 64, 64, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (0, 0), 1, "zeros", True)
    x, w = torch.zeros(1, 64, 32, 32), torch.zeros(64, 64, 3, 3)
    out = decide(spec, CallDesc.of_call(x, w, torch.zeros(64), packed=True), Target("sm80", True, sms=108))
    assert not out.is_kernel and "no measurement" in out.reason


def test_weigh_takes_the_lean_route_for_host_bound_calls():
    spec = ConvSpec(False, 16, 16, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (0, 0), 1, "zeros", True)
    x, w = torch.zeros(1, 16, 8, 8, dtype=torch.bfloat16), torch.zeros(16, 16, 3, 3, dtype=torch.bfloat16)
    b = torch.zeros(16, dtype=torch.bfloat16)
    sm90 = Target("sm90", True, sms=132)
    out = decide(spec, CallDesc.of_call(x, w, b, packed=True), sm90)
    assert out.route is Route.CONV2D_IGEMM and out.tier == LEAN
    # Inside a CUDA graph host time is free: the table's route stays.
    assert decide(spec, CallDesc.of_call(x, w, b, packed=True, graph=True), sm90).tier != LEAN