"""Recorded programs call Triton's C launcher directly (kernels/direct_launch.py):
what the C launcher receives must be what Triton's own wrapper would have
passed it, call after call, with the descriptors' maps encoded for each
call's addresses. A fake launcher of Triton 3.6's shape stands in for the
GPU's (the GPU test in test_launch.py runs the real one)."""

from types import SimpleNamespace

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from conv_patch.kernels import direct_launch, launch as _launch

# Triton 3.6's wrapper, in the shape direct_launch recognises: a closure over
# launcher, tensordesc_indices and tensordesc_meta, in a module whose globals
# hold make_tensordesc_arg and _BASE_ARGS_FORMAT_LEN.
_WRAPPER = '''
_BASE_ARGS_FORMAT_LEN = 13

def make_tensordesc_arg(arg, metadata):
    EXPANDED.append(arg.base.data_ptr())
    return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), metadata["swizzle"]),
            *arg.shape, *arg.strides]

def wrap(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        k = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[k]))
                k += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner
'''


class CudaLauncher:
    def __init__(self, inner, scratch=0):
        self.launch, self.global_scratch_size, self.profile_scratch_size = inner, scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, False

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


def _fake_compiled(received, indices=frozenset({0}), meta=({"swizzle": 128},), scratch=0):
    ns = {"EXPANDED": []}
    exec(_WRAPPER, ns)
    inner = ns["wrap"](lambda *final: received.append(list(final)), set(indices), list(meta))
    return SimpleNamespace(run=CudaLauncher(inner, scratch), function=1234, packed_metadata=("packed",)), ns


@pytest.fixture
def fake_driver(monkeypatch):
    knobs, _, td = _launch._triton()
    driver = SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda device: 77))
    monkeypatch.setitem(_launch._FAST_STATE, "triton", (knobs, driver, td))
    direct_launch._LAUNCHERS.clear()
    yield
    direct_launch._LAUNCHERS.clear()


def _program(compiled, x, out):
    rec = _launch.Recorder()
    desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [4, 8])
    # Arguments: a descriptor over the input, the output, an int, a float; one constexpr.
    rec.launches.append((None, (5, 2), (desc, out, 7, 0.5), {}, compiled, (64,), "dev"))
    return _launch.Program(rec, (x, out), out)


def test_direct_launch_passes_what_tritons_wrapper_passes(fake_driver, monkeypatch):
    received = []
    compiled, ns = _fake_compiled(received)
    x0, out0 = torch.zeros(16, 24), torch.zeros(10)
    prog = _program(compiled, x0, out0)
    assert prog.launches[0][-1] is not None, "the fake launcher was not recognised"
    ns["EXPANDED"].clear()
    xs = [torch.randn(16, 24), torch.randn(16, 24)]
    calls = [(xs[0], torch.empty(10)), (xs[0], torch.empty(10)), (xs[1], torch.empty(10)), (xs[0], torch.empty(10))]
    for direct in (True, False):
        monkeypatch.setitem(direct_launch._STATE, "on", direct)
        for x, out in calls:
            assert prog((x, out)) is out
    n = len(calls)
    assert len(received) == 2 * n
    for own, ours in zip(received[n:], received[:n]):
        # The same list, element for element, a tensor as its address.
        assert ours == [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in own]
        assert not any(isinstance(a, torch.Tensor) for a in ours)
    assert received[0][3] == 77 and received[0][:3] == [5, 2, 1]
    # The direct calls encoded one map per new address (two), Triton's one per call.
    expanded = ns["EXPANDED"]
    assert expanded[:2] == [xs[0].data_ptr(), xs[1].data_ptr()] and len(expanded) == 2 + n


def test_view_arguments_go_as_their_addresses(fake_driver, monkeypatch):
    """A launch argument that is a view of a role (an offset slice, a
    reshaped output) and a descriptor over a view: the direct call passes
    the view's address and the map of the view (its shape and strides),
    as Triton's path does from the views it builds."""
    received = []
    compiled, ns = _fake_compiled(received)
    x0, out0 = torch.zeros(16, 24), torch.zeros(4, 10)
    rec = _launch.Recorder()
    window = x0[2:10, 8:]
    desc = TensorDescriptor(window, list(window.shape), list(window.stride()), [4, 8])
    rec.launches.append((None, (3,), (desc, out0.view(2, 20)[1], 5), {}, compiled, (), "dev"))
    prog = _launch.Program(rec, (x0, out0), out0)
    calls = [(torch.randn(16, 24), torch.empty(4, 10)) for _ in range(3)]
    for direct in (True, False):
        monkeypatch.setitem(direct_launch._STATE, "on", direct)
        for x, out in calls:
            prog((x, out))
    n = len(calls)
    for (x, out), ours, own in zip(calls, received[:n], received[n:]):
        assert ours == [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in own]
        assert ours[13] == ("map", x[2:10, 8:].data_ptr(), (8, 16), (24, 1), 128)
        assert ours[-1] == 5 and ours[-2] == out.data_ptr() + 20 * out.element_size()


def test_maps_are_bounded_and_recomputed_after_eviction(fake_driver, monkeypatch):
    received = []
    compiled, ns = _fake_compiled(received)
    prog = _program(compiled, torch.zeros(16, 24), torch.zeros(10))
    monkeypatch.setitem(direct_launch._STATE, "on", True)
    keep = [torch.randn(16, 24) for _ in range(direct_launch.MAPS_PER_SLOT + 3)]
    for x in keep + keep[:1]:
        prog((x, torch.empty(10)))
        assert received[-1][13][1] == x.data_ptr()  # the map of this call's address
    cache = prog.launches[0][-1].maps[0][1]
    assert len(cache) <= direct_launch.MAPS_PER_SLOT


def test_unknown_launchers_take_tritons_path(fake_driver, monkeypatch):
    """Scratch the wrapper would allocate, a wrapper of another shape, or
    the switch off: Triton's own call."""
    received = []
    with_scratch, _ = _fake_compiled(received, scratch=64)
    assert direct_launch.launcher_of(with_scratch) is None
    other = SimpleNamespace(run=CudaLauncher(lambda *a, extra=None: None), function=1, packed_metadata=())
    assert direct_launch.launcher_of(other) is None
    plain, _ = _fake_compiled(received)
    assert direct_launch.launcher_of(plain) is not None
    monkeypatch.setitem(direct_launch._STATE, "on", False)
    x, out = torch.zeros(16, 24), torch.zeros(10)
    prog = _program(with_scratch, x, out)
    assert prog.launches[0][-1] is None
    prog((x, out))
    assert received and received[-1][7] is None  # through CudaLauncher.__call__


@pytest.mark.gpu
def test_direct_replays_equal_tritons_path_on_the_gpu(monkeypatch):
    """A patched net on the TMA and portable kernels, replayed through the C
    launcher and through Triton's wrapper: equal bit for bit, on inputs at
    new and at reused addresses, NCHW and NHWC; on the Triton this was
    written against, the kernels' launchers are recognised."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import copy

    import triton

    import conv_patch
    from conv_patch import PatchConfig
    from test_tma import TMA_WIDE
    g = torch.Generator().manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.SiLU(),
                              torch.nn.Conv2d(16, 24, 1), torch.nn.Conv2d(24, 8, 3, padding=2, dilation=2),
                              torch.nn.Conv2d(8, 8, 3, stride=2, padding=1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    net = net.cuda().half().eval()
    twin = copy.deepcopy(net)
    table = {"conv2d": {"buckets": [{"max_m": None, "config": dict(TMA_WIDE)}]}}
    conv_patch.apply(net, config=PatchConfig(table=table, passthrough=False))
    xs = [torch.randn(2, 8, 13, 16, generator=g).cuda().half() for _ in range(3)]
    xs += [x.contiguous(memory_format=torch.channels_last) for x in xs[:2]]
    outs = {}
    with torch.no_grad():
        for direct in (False, True):
            monkeypatch.setitem(direct_launch._STATE, "on", direct)
            outs[direct] = [net(x).clone() for x in xs + xs]
        torch.cuda.synchronize()
        for a, b, x in zip(outs[False], outs[True], xs + xs):
            assert torch.equal(a, b)
            ref = twin(x)
            assert (a.float() - ref.float()).norm() <= 2e-2 * ref.float().norm()
    if triton.__version__.startswith("3.6"):
        known = [v[1] for v in direct_launch._LAUNCHERS.values()]
        assert known and all(k is not None for k in known), "Triton 3.6's launcher not recognised"
