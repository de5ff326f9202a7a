"""conv_patch.runtime.passthrough: the components that do no work of conv-patch's
own at a call signature run as their own classes from its third call on,
and get their patched classes back when the call returns or raises.

On the CPU under the interpreter the kernels take float32 calls and refuse
float64 ones (PyTorch's route), which makes a busy and an idle branch."""

import copy
import pickle

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.runtime import passthrough
from conv_patch.runtime.wrappers import PatchedConvMixin
from conv_patch.recipes.catalog import is_fused
from conv_patch.runtime.state import state_of

# The busy branch is the interpreter's routing of CPU tensors; on a GPU
# machine the CPU has no kernels (bench.zoo's passed_through is the GPU check).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="routing under the interpreter (CPU)")


class Probe(nn.Module):
    """Notes the classes of its parent's parts while the parent runs."""

    def __init__(self, names):
        super().__init__()
        self.names, self.seen, self.parent = names, [], None

    def forward(self, x):
        mods = self.parent.__dict__["_modules"]
        self.seen.append({n: type(mods[n]) for n in self.names})
        return x


class Net(nn.Module):
    """``fast``: convs the kernels take (float32); ``slow``: a fused
    Sequential chain and a bare conv in float64, PyTorch's route."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.fast = nn.Conv2d(3, 5, 3, padding=1)
        self.slow = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 1)).double()
        self.tail = nn.Conv2d(5, 5, 3, padding=1).double()
        self.probe = Probe(("fast", "slow", "tail"))
        self.probe.__dict__["parent"] = self
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x, mix: bool = True):
        self.calls += 1
        if self.calls == self.fail_at:
            self.probe(x)
            raise RuntimeError("planned failure")
        y = self.tail(self.slow(x.double()))
        if mix:
            y = y + self.fast(x).double()
        return self.probe(y)


def _classes(net):
    return {n: type(net._modules[n]) for n in ("fast", "slow", "tail")}


@pytest.fixture
def nets():
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    report = conv_patch.apply(net)
    assert report.passthrough == [""] and "passthrough <root>" in str(report)
    return net, ref


def test_idle_parts_run_as_their_own_classes_from_the_third_call(nets):
    net, ref = nets
    patched = _classes(net)
    assert issubclass(patched["tail"], PatchedConvMixin) and is_fused(net.slow)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(2, 3, 7, 9)
            y, want = net(x), ref(x)
            # The float64 side is PyTorch's either way: bit for bit.
            assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)
            assert _classes(net) == patched  # back after every call
    seen = net.probe.seen
    assert seen[0] == patched and seen[1] == patched  # built, then watched
    for s in seen[2:]:
        assert s["slow"] is nn.Sequential and s["tail"] is nn.Conv2d
        assert s["fast"] is patched["fast"]  # it ran a kernel: stays patched
    # The chain's convs were passed through with it (its own forward calls them).
    assert [n for _, n in passthrough.learned(net)] == [4]


def test_a_new_signature_learns_again(nets):
    net, ref = nets
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(1, 3, 8, 8))
        for _ in range(3):
            net(torch.randn(1, 3, 8, 8), mix=False)  # a flag by value: another signature
        x = torch.randn(1, 3, 8, 8)
        assert torch.allclose(net(x, mix=False), ref(x, mix=False))
    # Without the mix the kernel conv is not called: idle too.
    assert sorted(n for _, n in passthrough.learned(net)) == [4, 5]
    assert net.probe.seen[4]["slow"] is type(net.slow)  # second signature's watched call
    assert net.probe.seen[5]["slow"] is nn.Sequential and net.probe.seen[5]["fast"] is nn.Conv2d


def test_a_call_whose_parts_all_run_kernels_swaps_nothing():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    outer = nn.ModuleDict({"a": net, "b": nn.Conv2d(4, 4, 1)})

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = outer

        def forward(self, x):
            return self.parts["b"](self.parts["a"](x))

    model = Outer()
    conv_patch.apply(model)
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(1, 3, 9, 9))
    assert [n for _, n in passthrough.learned(model)] == [0]


def test_autograd_is_part_of_the_signature(nets):
    net, ref = nets
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(1, 3, 6, 6))
    x = torch.randn(1, 3, 6, 6)
    y = net(x)  # grad enabled: a new signature, run as patched
    assert y.requires_grad
    assert net.probe.seen[-1] == _classes(net)
    y.sum().backward()
    assert net.tail.weight.grad is not None


def test_a_call_that_raises_gives_the_classes_back():
    torch.manual_seed(0)
    net = Net(fail_at=4)
    conv_patch.apply(net)
    patched = _classes(net)
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(1, 3, 5, 5))
        with pytest.raises(RuntimeError, match="planned failure"):
            net(torch.randn(1, 3, 5, 5))
        assert net.probe.seen[-1]["slow"] is nn.Sequential  # it was swapped when it raised
        assert _classes(net) == patched
        net(torch.randn(1, 3, 5, 5))
        assert net.probe.seen[-1]["slow"] is nn.Sequential
    assert _classes(net) == patched


def test_a_watched_call_that_raises_teaches_nothing_and_leaves_no_hooks():
    torch.manual_seed(0)
    net = Net(fail_at=2)
    conv_patch.apply(net)
    with torch.no_grad():
        net(torch.randn(1, 3, 5, 5))
        with pytest.raises(RuntimeError):
            net(torch.randn(1, 3, 5, 5))
        assert passthrough.learned(net) == []
        for m in (net.fast, net.slow, net.tail):
            assert not m._forward_hooks and not m._forward_pre_hooks
        net(torch.randn(1, 3, 5, 5))  # watched now
        net(torch.randn(1, 3, 5, 5))
    assert net.probe.seen[-1]["slow"] is nn.Sequential


def test_off_by_config_with_graphs_and_after_remove():
    net = Net()
    report = conv_patch.apply(net, config=conv_patch.PatchConfig(passthrough=False, compile_ahead=False))
    assert report.passthrough == [] and not net._forward_pre_hooks
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(1, 3, 5, 5))
    assert all(s["slow"] is type(net.slow) for s in net.probe.seen)
    with pytest.raises(TypeError, match="passthrough"):
        conv_patch.apply(Net(), config=conv_patch.PatchConfig(passthrough=1))

    net = Net()
    conv_patch.apply(net)
    assert net._forward_pre_hooks and net._forward_hooks
    conv_patch.remove(net)
    assert not net._forward_pre_hooks and not net._forward_hooks and state_of(net).passthrough is None


def test_a_fused_block_as_the_model_keeps_its_class_and_passes_through_what_it_calls():
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), Inner(), nn.Conv2d(4, 3, 1))
    ref = copy.deepcopy(stack)
    report = conv_patch.apply(stack)
    assert report.passthrough == [""] and is_fused(stack)
    fused = type(stack)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 3, 5, 6)
            assert torch.allclose(stack(x), ref(x), rtol=1e-4, atol=1e-5)
            assert type(stack) is fused
    assert stack[2].seen[2:] == [nn.Sequential] * 2


def test_copies_forget_what_was_learned(nets):
    net, _ = nets
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(1, 3, 5, 5))
    assert passthrough.learned(net)
    net.probe.seen.clear()  # (classes made by the recipes do not pickle by name)
    for other in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert passthrough.learned(other) == [] and other._forward_pre_hooks
        with torch.no_grad():
            for _ in range(3):
                other(torch.randn(1, 3, 5, 5))
        assert [n for _, n in passthrough.learned(other)] == [4]
        assert other.probe.seen[-1]["slow"] is nn.Sequential


def test_a_patched_context_keeps_an_enclosing_apply_hooked():
    net = Net()
    conv_patch.apply(net, filter_fn=lambda m, fqn: fqn != "tail")
    with conv_patch.patched(net):
        assert conv_patch.is_patched(net.tail)
    assert not conv_patch.is_patched(net.tail) and conv_patch.is_patched(net.fast)
    assert net._forward_pre_hooks  # the enclosing apply's wrappers remain, hooked


class Inner(nn.Module):
    """A float64 chain (PyTorch's route) called as a module from a
    float32 chain the kernels take."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.ReLU()).double()
        self.seen = []

    def forward(self, x):
        self.seen.append(type(self.__dict__["_modules"]["seq"]))
        return self.seq(x.double()).float()


def test_an_idle_block_called_inside_a_busy_one_is_passed_through():
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), Inner(), nn.Conv2d(4, 4, 3, padding=1),
                          nn.ReLU(), nn.Conv2d(4, 3, 1))
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = stack

        def forward(self, x):
            return self.stack(x)

    root = Root()
    ref = copy.deepcopy(root)
    conv_patch.apply(root)
    inner = stack[2]
    assert is_fused(stack) and is_fused(inner.seq)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 3, 6, 7)
            assert torch.allclose(root(x), ref(x), rtol=1e-4, atol=1e-5)
            assert is_fused(stack) and is_fused(inner.seq)
    assert inner.seen[:2] == [type(inner.seq)] * 2
    assert inner.seen[2:] == [nn.Sequential] * 2  # idle inside the busy stack
    assert [n for _, n in passthrough.learned(root)] == [3]  # the chain and its two convs


def test_a_changed_component_makes_every_model_learn_again(nets):
    """A weight, attribute or parametrization change drops the wrapper's
    plans (dispatch.clear) and what every model learned: the kernels may
    take a call they refused (test_api's weight_norm round trip)."""
    net, ref = nets
    x = torch.randn(1, 3, 5, 5)
    with torch.no_grad():
        for _ in range(3):
            net(x)
        assert net.probe.seen[-1]["tail"] is nn.Conv2d
        net.tail.weight = nn.Parameter(net.tail.weight.detach() * 2)
        ref.tail.weight = nn.Parameter(ref.tail.weight.detach() * 2)
        assert torch.allclose(net(x), ref(x), rtol=1e-5, atol=1e-6)
        assert net.probe.seen[-1]["tail"] is type(net.tail) and passthrough.learned(net) == []
        net(x), net(x)
        assert net.probe.seen[-1]["tail"] is nn.Conv2d


def _pooled_decoder(dtype):
    """A TAEF2-layout decoder (pooled blocks: a GroupNorm inside each)."""
    from conv_patch.tools import taesd
    torch.manual_seed(0)
    return taesd.decoder(4, channels=4).to(dtype).eval()


@pytest.fixture
def eager_norms(monkeypatch):
    """The stack's GroupNorms judged PyTorch's (below the kernels'
    crossover), as on a GPU at TAEF2's 256^2 and 512^2 decodes."""
    from conv_patch.recipes import common
    monkeypatch.setattr(common, "norm_is_eager", lambda x, numel=None, groups=None: True)


def _watch_block(stack, fail_at=None):
    """Notes the classes of stack[3] (a pooled block) and of its inner
    chain while it runs; raises at the ``fail_at``-th call."""
    seen = []

    def hook(mod, args):
        seen.append((type(stack[3]), type(mod), type(mod[0])))
        if len(seen) == fail_at:
            raise RuntimeError("planned failure")
    stack[3].conv.register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_stack_whose_norms_are_pytorchs_runs_unfused(eager_norms, dtype):
    """Where the stack's GroupNorms run as PyTorch's, it runs as its own
    class with every fused block under it as theirs (what recipes=False
    runs); the convs stay patched and are watched, so the idle ones (float64:
    PyTorch's route) pass through from the third call on; the busy ones
    (float32: the kernels) stay patched."""
    stack = _pooled_decoder(dtype)
    ref = copy.deepcopy(stack)
    conv_patch.apply(stack)
    fused, inner_fused = type(stack[3]), type(stack[3].conv)
    assert is_fused(stack) and is_fused(stack[3]) and is_fused(stack[3].conv)
    seen = _watch_block(stack)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 4, 2, 3, dtype=dtype)
            torch.testing.assert_close(stack(x), ref(x), rtol=1e-4, atol=1e-5)
            assert type(stack[3]) is fused and type(stack[3].conv) is inner_fused
    assert seen[0][:2] == (fused, inner_fused)  # the first call builds the stack's plan: fused
    # (The block as its own class, with ``LeanTinyBlock`` in front: its
    # hooked chain is called as a module, as its own forward does.)
    from conv_patch.recipes import diffusers as rdiff, fuse
    own = fuse.lean_class(type(ref[3]), rdiff.LeanTinyBlock)
    assert all(s[:2] == (own, nn.Sequential) for s in seen[1:])
    n_convs = sum(isinstance(m, PatchedConvMixin) for m in stack.modules())
    if dtype == torch.float64:
        assert [n for _, n in passthrough.learned(stack)] == [n_convs]
        assert seen[1][2] is type(stack[3].conv[0]) and seen[3][2] is nn.Conv2d
    else:
        assert [n for _, n in passthrough.learned(stack)] == [0]
        assert all(s[2] is type(stack[3].conv[0]) for s in seen)


def test_a_stack_run_unfused_gives_the_classes_back_when_it_raises(eager_norms):
    stack = _pooled_decoder(torch.float64)
    conv_patch.apply(stack)
    fused = type(stack[3])
    seen = _watch_block(stack, fail_at=3)
    x = torch.randn(1, 4, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        stack(x), stack(x)
        with pytest.raises(RuntimeError, match="planned failure"):
            stack(x)
        assert seen[-1][0] is not fused  # it did run unfused
        assert type(stack[3]) is fused and is_fused(stack[3].conv)
        assert all(isinstance(m, PatchedConvMixin) for m in stack.modules() if isinstance(m, nn.Conv2d))
        # ... and keeps learning, then passes through, as before
        stack(x), stack(x)
        assert seen[-1][2] is nn.Conv2d and type(stack[3]) is fused


def test_a_stack_runs_its_recipes_where_its_norms_are_the_kernels_or_on_the_graph_path(monkeypatch):
    from conv_patch.runtime import pack
    stack = _pooled_decoder(torch.float32)
    conv_patch.apply(stack)
    fused = type(stack[3])
    seen = _watch_block(stack)
    x = torch.randn(1, 4, 2, 3)
    with torch.no_grad():
        for _ in range(3):
            stack(x)  # on the CPU the GroupNorms are the kernels'
        assert {s[0] for s in seen} == {fused}
        from conv_patch.recipes import common
        monkeypatch.setattr(common, "norm_is_eager", lambda x, numel=None, groups=None: True)
        with pack.graph_path():
            stack(x)
        assert seen[-1][0] is fused
        stack(x)
        assert seen[-1][0] is not fused


def test_a_stack_run_unfused_copies_and_pickles(eager_norms):
    stack = _pooled_decoder(torch.float64)
    ref = copy.deepcopy(stack)
    conv_patch.apply(stack)
    x = torch.randn(1, 4, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(3):
            stack(x)
        for other in (copy.deepcopy(stack), pickle.loads(pickle.dumps(stack))):
            for _ in range(3):
                torch.testing.assert_close(other(x), ref(x))
            assert is_fused(other[3])


class VAE(nn.Module):
    """Called as a diffusers pipeline calls a VAE: ``vae.decode(z)``, which
    calls its ``decoder`` (not the VAE's forward)."""

    def __init__(self):
        super().__init__()
        self.decoder = Net()

    def decode(self, z):
        return self.decoder(z)

    def forward(self, z):
        return self.decode(z)


def test_a_vae_called_through_decode_passes_through():
    torch.manual_seed(0)
    vae = VAE()
    ref = copy.deepcopy(vae)
    conv_patch.apply(vae)
    patched = _classes(vae.decoder)
    assert passthrough.entries(vae) == [vae.decoder]
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, 7, 9)
            assert torch.allclose(vae.decode(x), ref.decode(x), rtol=1e-5, atol=1e-6)
    seen = vae.decoder.probe.seen
    assert seen[0] == patched and seen[1] == patched
    assert seen[2]["slow"] is nn.Sequential and seen[2]["tail"] is nn.Conv2d
    assert [n for _, n in passthrough.learned(vae.decoder)] == [4] and passthrough.learned(vae) == []
    # Called through its forward, the VAE's own hooks decide; the decoder's
    # do nothing inside that call.
    with torch.no_grad():
        for _ in range(3):
            vae(torch.randn(1, 3, 5, 5))
    assert len(passthrough.learned(vae)) == 1 and len(passthrough.learned(vae.decoder)) == 1
    assert seen[-1]["slow"] is nn.Sequential
    # Its own hooks are not a user's: bands and fused forwards may still run
    # the decoder their way; a user's hook beside them counts.
    assert not passthrough.other_hooks(vae.decoder)
    handle = vae.decoder.register_forward_hook(lambda *a: None)
    assert passthrough.other_hooks(vae.decoder)
    handle.remove()
    handle = vae.decoder.register_forward_pre_hook(lambda *a: None)
    assert passthrough.other_hooks(vae.decoder)
    handle.remove()
    conv_patch.remove(vae)
    assert not vae.decoder._forward_pre_hooks and not vae.decoder._forward_hooks
    # A model without such an entry point: its parts are not hooked.
    net = Net()
    conv_patch.apply(net)
    assert passthrough.entries(net) == [] and not net.slow._forward_pre_hooks
