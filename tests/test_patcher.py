"""apply / remove / patched and the wrappers' module behaviour."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch import PatchConfig
from conv_patch.routing.registry import Route
from conv_patch.runtime.wrappers import PatchedConv2d, PatchedConvTranspose2d
from conv_patch.runtime.state import state_of
from _util import TOL, rel_err


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(3, 12, 3, padding=1)
        self.body = nn.Sequential(nn.SiLU(), nn.Conv2d(12, 12, 3, stride=2, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(12, 6, 4, stride=2, padding=1)
        self.grouped = nn.Conv2d(6, 6, 3, padding=1, groups=3)
        self.conv_out = nn.Conv2d(6, 3, 1)


def make_net(device, seed=0):
    torch.manual_seed(seed)
    return Net().to(device)


def forward(net, x):
    h = net.body(net.conv_in(x))
    return net.conv_out(net.grouped(net.up(h)))


Net.forward = forward


def test_apply_reports_and_matches(device, exact_fp32):
    net = make_net(device)
    x = torch.randn(2, 3, 11, 9, device=device)
    with torch.no_grad():
        ref = net(x)
        report = conv_patch.apply(net)
        out = net(x)
    assert set(report.patched) == {"conv_in", "body.1", "up", "conv_out"}
    assert report.skipped == {"grouped": "groups=3"}
    assert report.patched["up"].startswith("conv_transpose2d_igemm")
    assert isinstance(net.conv_in, nn.Conv2d) and isinstance(net.conv_in, PatchedConv2d)
    assert isinstance(net.up, nn.ConvTranspose2d) and isinstance(net.up, PatchedConvTranspose2d)
    assert type(net.grouped) is nn.Conv2d
    assert rel_err(out, ref) <= TOL[torch.float32]
    assert state_of(net.conv_in).last.route is Route.CONV2D_IGEMM  # the kernel ran
    assert state_of(net.up).last.route is Route.CONV_TRANSPOSE2D_IGEMM
    with torch.no_grad():
        assert net.conv_in.route(x).route is Route.CONV2D_IGEMM
    assert "patched  conv_in: conv2d_igemm" in str(report)


def test_state_dict_same_keys_same_parameters(device):
    net = make_net(device)
    before = net.state_dict(keep_vars=True)
    params = dict(net.named_parameters())
    conv_patch.apply(net)
    after = net.state_dict(keep_vars=True)
    assert list(before) == list(after)
    assert all(before[k] is after[k] for k in before)
    assert all(params[k] is p for k, p in net.named_parameters())


def test_remove_restores_exact_objects_with_current_weights(device):
    net = make_net(device)
    originals = {n: m for n, m in net.named_modules()}
    conv_patch.apply(net)
    with torch.no_grad():
        net.conv_in.weight.mul_(2)
    net.eval()
    restored = conv_patch.remove(net)
    assert set(restored) == {"conv_in", "body.1", "up", "conv_out"}
    for n, m in net.named_modules():
        assert m is originals[n], n
    assert type(net.conv_in) is nn.Conv2d and not net.conv_in.training
    assert net.conv_in.weight is originals["conv_in"].weight
    assert not any("_cp_" in k for k in net.conv_in.__dict__)


def test_apply_is_idempotent(device):
    net = make_net(device)
    first = conv_patch.apply(net)
    wrapper = net.conv_in
    second = conv_patch.apply(net)
    assert second.patched == {} and sorted(second.already_patched) == sorted(first.patched)
    assert net.conv_in is wrapper and type(state_of(net.conv_in).original) is nn.Conv2d


def test_filter_fn_and_context_manager(device):
    net = make_net(device)
    with conv_patch.patched(net, filter_fn=lambda m, fqn: fqn.startswith("conv")) as report:
        assert set(report.patched) == {"conv_in", "conv_out"}
        assert report.skipped["body.1"] == "excluded by filter_fn"
        assert conv_patch.is_patched(net.conv_in) and not conv_patch.is_patched(net.body[1])
    assert not any(conv_patch.is_patched(m) for m in net.modules())


def test_context_manager_leaves_earlier_patches(device):
    net = make_net(device)
    conv_patch.apply(net, filter_fn=lambda m, fqn: fqn == "conv_in")
    with conv_patch.patched(net):
        assert conv_patch.is_patched(net.up)
    assert conv_patch.is_patched(net.conv_in) and not conv_patch.is_patched(net.up)


def test_validation_before_mutation(device):
    net = make_net(device)

    def boom(m, fqn):
        if fqn == "up":
            raise RuntimeError("filter failed")
        return True

    with pytest.raises(RuntimeError, match="filter failed"):
        conv_patch.apply(net, filter_fn=boom)
    assert not any(conv_patch.is_patched(m) for m in net.modules())
    with pytest.raises(TypeError, match="nn.Module"):
        conv_patch.apply("not a model")
    with pytest.raises(TypeError, match="filter_fn"):
        conv_patch.apply(net, filter_fn=3)
    with pytest.raises(TypeError, match="PatchConfig"):
        conv_patch.apply(net, config={"table": None})
    with pytest.raises(ValueError, match="BLOCK_M"):
        conv_patch.apply(net, config=PatchConfig(table={"conv2d": {"any": {"BLOCK_M": 3}}}))
    assert not any(conv_patch.is_patched(m) for m in net.modules())


def test_user_table_is_used(device):
    net = make_net(device)
    table = {"conv2d": {"any": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}}}
    conv_patch.apply(net, config=PatchConfig(table=table))
    d = net.conv_in.route(torch.randn(1, 3, 8, 8, device=device))
    if d.is_kernel:
        assert d.table == "user" and d.config["BLOCK_M"] == 16


def test_shared_module_is_one_wrapper(device):
    conv = nn.Conv2d(4, 4, 3, padding=1).to(device)
    net = nn.Sequential(conv, nn.ReLU(), conv)
    report = conv_patch.apply(net)
    assert set(report.patched) == {"0", "2"} and net[0] is net[2]
    # The Sequential's recipe comes off first, then the shared conv at both paths.
    assert conv_patch.remove(net) == ["", "0", "2"] and net[0] is conv and net[2] is conv


class OverridingConv(nn.Conv2d):
    def forward(self, x):
        return super().forward(x) * 2


class PlainSubclass(nn.Conv2d):
    pass


def test_eligibility_reasons(device):
    net = nn.Sequential(
        OverridingConv(3, 3, 1), PlainSubclass(3, 3, 1), nn.Conv1d(3, 3, 1),
        nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 3, 1)),
        nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular"), nn.LazyConv2d(3, 1),
    ).to(device)
    hooked = nn.Conv2d(3, 3, 1)
    hooked.forward = lambda x: x
    net.append(hooked)
    report = conv_patch.apply(net)
    assert "overrides forward" in report.skipped["0"]
    assert "1" in report.patched and isinstance(net[1], PatchedConv2d)
    assert "only 2-D" in report.skipped["2"]
    assert report.skipped["3"] == "parametrized weight"
    assert report.skipped["4"] == "padding_mode='circular'"
    assert "lazy" in report.skipped["5"]
    assert "instance" in report.skipped["6"]


def test_root_conv_not_replaced():
    conv = nn.Conv2d(3, 3, 1)
    report = conv_patch.apply(conv)
    assert "model itself is a convolution" in report.skipped[""]
    assert type(conv) is nn.Conv2d


def test_repr_shows_route(device):
    net = make_net(device)
    conv_patch.apply(net)
    assert "route=conv2d_igemm" in repr(net.conv_in)
    assert "route=conv_transpose2d_igemm" in repr(net.up)
    net.conv_in(torch.randn(1, 3, 8, 8, device=device))  # grad enabled: falls back
    assert "route=fallback (autograd needed" in repr(net.conv_in)


def test_to_half_eval_load_state_dict(device, exact_fp32):
    net = make_net(device)
    other = make_net(device, seed=1)
    conv_patch.apply(net)
    net.load_state_dict(other.state_dict())
    x = torch.randn(1, 3, 10, 10, device=device)
    with torch.no_grad():
        assert rel_err(net(x), other(x)) <= TOL[torch.float32]
        net.half().eval()
        other.half()
        assert net.conv_in.weight.dtype == torch.float16 and not net.training
        assert rel_err(net(x.half()), other(x.half())) <= 5e-3
        net.to(torch.bfloat16)
        assert net.conv_in.route(x.bfloat16()).is_kernel == net.conv_in.route(x.half().bfloat16()).is_kernel


def test_fallback_same_result_and_exceptions(device):
    net = make_net(device)
    twin = copy.deepcopy(net)
    conv_patch.apply(net)
    x = torch.randn(1, 3, 8, 8, device=device)
    # Autograd: falls back, gradients identical.
    net(x).sum().backward()
    twin(x).sum().backward()
    for (n, p), (_, q) in zip(net.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    # float64: not a kernel dtype, computed by PyTorch.
    with torch.no_grad():
        xd = x.double()
        assert torch.equal(net.double()(xd), twin.double()(xd))
    # Errors: PyTorch's own.
    for bad in (torch.randn(1, 5, 8, 8, device=device, dtype=torch.float64),
                torch.randn(3, 8, 8, device=device)):
        with pytest.raises(RuntimeError) as theirs:
            twin.conv_in(bad[:, :5] if bad.dim() == 4 else bad[:1])
        with pytest.raises(RuntimeError) as ours:
            net.conv_in(bad[:, :5] if bad.dim() == 4 else bad[:1])
        assert str(ours.value) == str(theirs.value)


def test_unbatched_input_and_output_size(device, exact_fp32):
    net = make_net(device)
    twin = copy.deepcopy(net)
    conv_patch.apply(net)
    x = torch.randn(3, 9, 7, device=device)
    with torch.no_grad():
        assert rel_err(net.conv_in(x), twin.conv_in(x)) <= TOL[torch.float32]
        h = torch.randn(1, 12, 5, 4, device=device)
        a = net.up(h, output_size=[11, 9])
        assert a.shape[-2:] == (11, 9)
        assert rel_err(a, twin.up(h, output_size=[11, 9])) <= TOL[torch.float32]
        assert state_of(net.up).last.is_kernel


@pytest.mark.parametrize("act", ["none", "relu", "silu", "gelu", "gelu_tanh"])
def test_extended_call_kernel_and_fallback_agree(act, device, exact_fp32):
    net = make_net(device)
    conv_patch.apply(net)
    x = torch.randn(2, 3, 9, 9, device=device)
    res = torch.randn(2, 12, 9, 9, device=device).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        fused = net.conv_in(x, residual=res, beta=0.5, activation=act, out_scale=0.25)
        ref = conv_patch.functional.eager_epilogue(nn.Conv2d.forward(net.conv_in, x), res, 0.5, act, 0.25)
    assert rel_err(fused, ref) <= TOL[torch.float32]
    twin = copy.deepcopy(net.conv_in).double()  # float64: the fallback path
    with torch.no_grad():
        eager = twin(x.double(), residual=res.double(), beta=0.5, activation=act, out_scale=0.25)
    assert state_of(twin).last.reason == "dtype float64 unsupported"
    assert rel_err(eager, ref) <= TOL[torch.float32]
    with pytest.raises(ValueError, match="residual has shape"):
        net.conv_in(x, residual=res[:, :, :8])
    with pytest.raises(ValueError, match="activation 'swish'"):
        net.conv_in(x, activation="swish")


def test_pickle_and_deepcopy(device):
    net = make_net(device)
    conv_patch.apply(net)
    with torch.no_grad():
        net(torch.randn(1, 3, 8, 8, device=device))  # creates packs
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded.conv_in, PatchedConv2d) and state_of(loaded.conv_in).pack is None
    clone = copy.deepcopy(net)
    assert clone.conv_in.weight is not net.conv_in.weight
    assert clone.conv_in._parameters is state_of(clone.conv_in).original._parameters
    assert pickle.loads(pickle.dumps(clone)).conv_in.weight.shape == net.conv_in.weight.shape


def test_hooks_survive_patching(device):
    net = make_net(device)
    seen = []
    net.conv_in.register_forward_hook(lambda m, i, o: seen.append("before"))
    conv_patch.apply(net)
    net.conv_in.register_forward_hook(lambda m, i, o: seen.append("after"))
    with torch.no_grad():
        net(torch.randn(1, 3, 8, 8, device=device))
    assert seen == ["before", "after"]
    conv_patch.remove(net)
    seen.clear()
    with torch.no_grad():
        net(torch.randn(1, 3, 8, 8, device=device))
    assert seen == ["before", "after"]


def test_wrapper_constructed_directly(device, exact_fp32):
    """PEFT builds LoRA convs as type(base_layer)(...): that must work too."""
    m = PatchedConv2d(4, 6, 3, padding=1).to(device)
    net = nn.Sequential(m)
    x = torch.randn(1, 4, 7, 7, device=device)
    with torch.no_grad():
        out = net(x)
    assert state_of(m).last.is_kernel
    assert rel_err(out, nn.Conv2d.forward(m, x)) <= TOL[torch.float32]
    assert conv_patch.remove(net) == ["0"]
    assert type(net[0]) is nn.Conv2d and net[0].weight is m.weight


def test_kernel_launch_failure_falls_back_with_warning(device, exact_fp32, monkeypatch):
    """A kernel that cannot run here (out of shared memory on a small GPU)
    must not crash the user's model: that call runs on PyTorch, and says so."""
    from triton.runtime.errors import OutOfResources
    from conv_patch.runtime.plans import KernelFailureWarning

    def no_room(*a, **k):
        raise OutOfResources(262144, 232448, "shared memory")

    net = make_net(device)
    twin = copy.deepcopy(net)
    conv_patch.apply(net)
    from conv_patch.kernels import conv2d as kernel_module
    monkeypatch.setattr(kernel_module, "launch_conv2d", no_room)
    x = torch.randn(1, 3, 8, 8, device=device)
    with torch.no_grad(), pytest.warns(KernelFailureWarning, match="OutOfResources"):
        out = net.conv_in(x, activation="relu")
    assert "kernel failed here: OutOfResources" in state_of(net.conv_in).last.reason
    assert rel_err(out, torch.relu(twin.conv_in(x))) <= TOL[torch.float32]


def test_attribute_change_after_patching_is_honoured(device, exact_fp32):
    net = make_net(device)
    conv_patch.apply(net)
    twin = copy.deepcopy(net)
    conv_patch.remove(twin)
    net.conv_in.padding = (2, 0)
    twin.conv_in.padding = (2, 0)
    x = torch.randn(1, 3, 9, 8, device=device)
    with torch.no_grad():
        out = net.conv_in(x)
    assert state_of(net.conv_in).last.is_kernel and out.shape == (1, 12, 11, 6)
    assert rel_err(out, twin.conv_in(x)) <= TOL[torch.float32]
