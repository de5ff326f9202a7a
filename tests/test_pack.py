"""The weight pack: never stale, one per weight, released when stale.

Every way a weight can change under a patched model is exercised; each edit
must show up in the next output exactly as in an unpatched twin.
"""

import copy
import gc

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.runtime import pack
from conv_patch.runtime.state import state_of
from conv_patch.runtime.wrappers import PatchedConv2d
from _util import TOL, rel_err


# On a GPU the cost model would give these small convs to PyTorch or to the
# lean route (no pack); a user table keeps them on the packed kernels.
KERNELS = conv_patch.PatchConfig(table={"conv2d": {"any": {"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16}}})


def make(device, channels_last=False):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(6, 10, 3, padding=1), nn.ReLU(),
                        nn.ConvTranspose2d(10, 5, 4, stride=2, padding=1), nn.Conv2d(5, 4, 1)).to(device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    twin = copy.deepcopy(net)
    conv_patch.apply(net, config=KERNELS)
    return net, twin


def check_same(net, twin, device, dtype=torch.float32):
    x = torch.randn(2, 6, 7, 9, device=device, dtype=dtype)
    with torch.no_grad():
        out, ref = net(x), twin(x)
    assert state_of(net[0]).last.is_kernel
    assert rel_err(out, ref) <= TOL[dtype]


def _data_copy(p):
    p.data.copy_(torch.randn_like(p))


def _data_mul(p):
    p.data.mul_(-2.0)


def _data_iadd(p):
    p.data += 0.25


def _no_grad_mul(p):
    with torch.no_grad():
        p.mul_(1.5)


def _data_assign(p):
    p.data = p.data * 3.0


EDITS = [_data_copy, _data_mul, _data_iadd, _no_grad_mul, _data_assign]


def test_data_edits_do_not_bump_version():
    """The trap the pack must survive: a version-keyed cache would be stale."""
    p = nn.Parameter(torch.randn(4))
    v = p._version
    p.data.mul_(2)
    p.data += 1
    assert p._version == v


@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__)
def test_every_weight_edit_is_seen(edit, device, exact_fp32):
    net, twin = make(device)
    check_same(net, twin, device)  # packs built
    for i in (0, 2):
        edit(net[i].weight)
        edit(net[i].bias)
    twin.load_state_dict(net.state_dict())
    check_same(net, twin, device)


def test_load_state_dict_is_seen(device, exact_fp32):
    net, twin = make(device)
    check_same(net, twin, device)
    torch.manual_seed(7)
    fresh = nn.Sequential(nn.Conv2d(6, 10, 3, padding=1), nn.ReLU(),
                          nn.ConvTranspose2d(10, 5, 4, stride=2, padding=1), nn.Conv2d(5, 4, 1))
    net.load_state_dict(fresh.state_dict())
    twin.load_state_dict(fresh.state_dict())
    check_same(net, twin, device)


def test_dtype_moves_release_old_pack(device, exact_fp32):
    gc.collect()
    base = pack.stats()["live"]
    net, twin = make(device)
    check_same(net, twin, device)
    # conv 3x3 and the transposed conv need packs; the 1x1 conv is read as is.
    assert pack.stats()["live"] == base + 2
    assert state_of(net[0]).pack.buf.dtype == torch.float32
    net.half()
    twin.half()
    assert state_of(net[0]).pack is None  # released at the move, not at the next call
    check_same(net, twin, device, torch.float16)
    gc.collect()
    assert pack.stats()["live"] == base + 2 and state_of(net[0]).pack.buf.dtype == torch.float16
    conv_patch.remove(net)
    gc.collect()
    assert pack.stats()["live"] == base


def test_channels_last_weights_need_no_pack(device, exact_fp32):
    gc.collect()
    base = pack.stats()["live"]
    net, twin = make(device, channels_last=True)
    check_same(net, twin, device)
    # The transposed conv's [C_in, C_out, k, k] weight still needs one.
    assert pack.stats()["live"] == base + 1 and state_of(net[0]).pack is None


def test_pack_made_in_inference_mode_refreshes_outside(device, exact_fp32):
    net, twin = make(device)
    x = torch.randn(1, 6, 5, 5, device=device)
    with torch.inference_mode():
        net(x)
    _data_mul(net[0].weight)
    twin.load_state_dict(net.state_dict())
    check_same(net, twin, device)


@pytest.mark.parametrize("order", ["patch_then_lora", "lora_then_patch"])
def test_peft_lora_merge_unmerge(order, device, exact_fp32):
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(6, 10, 3, padding=1), nn.SiLU(), nn.Conv2d(10, 4, 3, padding=1)).to(device)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False)
    twin = peft.inject_adapter_in_model(cfg, copy.deepcopy(base))
    if order == "patch_then_lora":
        net = copy.deepcopy(base)
        conv_patch.apply(net)
        net = peft.inject_adapter_in_model(cfg, net)
        assert isinstance(net[0].base_layer, PatchedConv2d)
    else:
        net = peft.inject_adapter_in_model(cfg, copy.deepcopy(base))
        report = conv_patch.apply(net)
        assert "0.base_layer" in report.patched
    assert list(net.state_dict()) == list(twin.state_dict())
    net.load_state_dict(twin.state_dict())
    x = torch.randn(2, 6, 8, 7, device=device)

    def compare():
        with torch.no_grad():
            out, ref = net(x), twin(x)
        assert state_of(net[0].base_layer).last.is_kernel
        assert rel_err(out, ref) <= TOL[torch.float32]
        return out

    plain = compare()
    for m in list(net.modules()) + list(twin.modules()):
        if isinstance(m, LoraLayer):
            m.merge()
    merged = compare()
    assert rel_err(merged, plain) <= 1e-4  # merge changes the base weight, not the function
    for m in list(net.modules()) + list(twin.modules()):
        if isinstance(m, LoraLayer):
            m.unmerge()
    compare()



# -- grouped refreshes (pack.PackGroup) -----------------------------------------
def _counts(fn):
    before = dict(pack.stats())
    fn()
    after = pack.stats()
    return after["refreshes"] - before["refreshes"], after["group_refreshes"] - before["group_refreshes"]


def test_fused_block_refreshes_its_packs_in_one_launch(device, exact_fp32):
    """The fused Sequential's first call refreshes each pack and learns them;
    later calls refresh all of them in one grouped launch and none one by
    one, and every edit between calls is still seen (the tests above run
    the same edits through the group)."""
    net, twin = make(device)
    assert type(net).__name__.startswith("Fused")
    x = torch.randn(2, 6, 7, 9, device=device)
    with torch.no_grad():
        assert _counts(lambda: net(x)) == (2, 0)
        for edit in EDITS:
            assert _counts(lambda: check_same(net, twin, device)) == (0, 1)
            edit(net[0].weight)
            edit(net[2].weight)
            twin.load_state_dict(net.state_dict())
        check_same(net, twin, device)
        # A conv called on its own, outside the block's call, refreshes itself.
        assert _counts(lambda: net[0](x)) == (1, 0)
        # New pack buffers (a dtype move): the group's launch is rebuilt for them.
        net.half()
        twin.half()
        assert _counts(lambda: check_same(net, twin, device, torch.float16)) == (2, 0)
        assert _counts(lambda: check_same(net, twin, device, torch.float16)) == (0, 1)


def test_group_leaves_hooked_and_replaced_weights_to_their_conv(device, exact_fp32):
    """A member with a forward pre-hook (which may write the weight in
    place just before its conv runs) and a member whose Parameter was
    replaced refresh their own packs at their calls."""
    net, twin = make(device)
    x = torch.randn(2, 6, 7, 9, device=device)
    with torch.no_grad():
        net(x)

        def scale(m, args):
            m.weight.data.mul_(1.5)

        hooks = [m[2].register_forward_pre_hook(scale) for m in (net, twin)]
        # (The hook makes the recipe run the block's own forward; the pack
        # of the hooked conv is refreshed at its call, after the hook.)
        assert _counts(lambda: check_same(net, twin, device))[0] == 1
        for h in hooks:
            h.remove()
        net[0].weight = nn.Parameter(torch.randn_like(net[0].weight))
        twin.load_state_dict(net.state_dict())
        check_same(net, twin, device)
        check_same(net, twin, device)


def test_group_is_reset_after_an_error_and_not_copied(device, exact_fp32):
    net, twin = make(device)
    x = torch.randn(2, 6, 7, 9, device=device)
    with torch.no_grad():
        net(x)
        with pytest.raises(RuntimeError):
            net(torch.randn(2, 5, 7, 9, device=device))  # wrong channel count
        assert pack.ACTIVE.group is None and pack.ACTIVE.epoch == 0
        copied = copy.deepcopy(net)
        assert state_of(copied).packs is None
        assert _counts(lambda: copied(x))[0] == 2  # the copy learns its own
        conv_patch.remove(net)
        assert state_of(net).packs is None


@pytest.mark.gpu
def test_nhwc_pytorch_route_reads_the_grouped_pack():
    """On a GPU a stack of 64-channel 3x3 convs at 64^2 runs NHWC inside its
    fused block and PyTorch's route takes them (cuDNN is faster there, the
    packaged table says); cuDNN would copy each NCHW weight to channels_last
    at every call. They read the packs the block refreshes in one launch
    instead: after the first call no pack is refreshed one by one, the
    answer is the unpatched stack's, and in-place edits are seen."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(64, 64, 3, padding=1)).cuda().to(torch.bfloat16)
    twin = copy.deepcopy(net)
    conv_patch.apply(net)
    x = torch.randn(1, 64, 64, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        net(x)
        assert not any(state_of(net[i]).last.is_kernel for i in (0, 2, 4)), [state_of(net[i]).last for i in (0, 2, 4)]
        for edit in EDITS:
            assert _counts(lambda: net(x)) == (0, 1)
            assert rel_err(net(x), twin(x)) <= TOL[torch.bfloat16]
            edit(net[2].weight)
            twin.load_state_dict(net.state_dict())
        assert rel_err(net(x), twin(x)) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_a_lone_nhwc_pytorch_route_conv_reads_its_weight_as_it_is():
    """Outside a fused block a conv PyTorch's route takes on an NHWC input
    hands cuDNN its own weight: a pack refreshed at each call would be the
    same strided copy cuDNN makes, launched from Python (host time a
    launch-bound conv pays). No pack is made or refreshed, the answer is
    the unpatched conv's, edits between calls are seen."""
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 3, padding=1).cuda().to(torch.bfloat16)
    twin = copy.deepcopy(conv)
    net = nn.Sequential(conv)
    conv_patch.apply(net, filter_fn=lambda m, name: isinstance(m, nn.Conv2d))
    patched = net[0]
    x = torch.randn(1, 64, 64, 64, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    with torch.no_grad():
        patched(x)
        if state_of(patched).last.is_kernel:
            pytest.skip(f"a kernel takes this conv here: {state_of(patched).last}")
        for edit in EDITS:
            assert _counts(lambda: patched(x)) == (0, 0)
            assert state_of(patched).pack is None
            assert rel_err(patched(x), twin(x)) <= TOL[torch.bfloat16]
            edit(patched.weight)
            twin.load_state_dict(patched.state_dict())
        assert rel_err(patched(x), twin(x)) <= TOL[torch.bfloat16]


def test_a_failed_grouped_launch_leaves_each_pack_to_its_conv(device, exact_fp32, monkeypatch):
    """A grouped launch that cannot run (here: raises) marks nothing fresh;
    the group stops, says why, and every pack is refreshed at its conv's
    call, so the answers stay right."""
    from conv_patch.kernels import api as kernels
    net, twin = make(device)
    x = torch.randn(2, 6, 7, 9, device=device)
    with torch.no_grad():
        net(x)

        def fail(args):
            raise RuntimeError("out of resources")

        monkeypatch.setattr(kernels, "launch_grouped_weight_pack", fail)
        _data_mul(net[0].weight)
        twin.load_state_dict(net.state_dict())
        assert _counts(lambda: check_same(net, twin, device)) == (2, 0)
        assert "out of resources" in state_of(net).packs.broken
        _data_mul(net[2].weight)
        twin.load_state_dict(net.state_dict())
        assert _counts(lambda: check_same(net, twin, device)) == (2, 0)


def test_a_norm_is_no_pack_group_and_leaves_the_enclosing_one_alone(device, exact_fp32):
    """A fused GroupNorm runs no conv: called on its own it opens no pack
    group (a UNet calls dozens of them per step), and inside a fused block
    it leaves that block's group active for the convs after it."""
    norm = nn.Sequential(nn.GroupNorm(2, 6)).to(device)
    conv_patch.apply(norm)
    assert type(norm[0]).__name__.startswith("Fused")
    x = torch.randn(2, 6, 7, 9, device=device)
    seen = []
    norm[0].register_forward_hook(lambda m, a, y: seen.append(pack.ACTIVE.group))
    with torch.no_grad():
        assert rel_err(norm[0](x), torch.nn.functional.group_norm(x, 2, norm[0].weight, norm[0].bias)) <= 1e-5
    assert seen == [None] and state_of(norm[0]).packs is None
    net = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.GroupNorm(2, 6), nn.Conv2d(6, 5, 3, padding=1),
                        nn.ReLU(), nn.Conv2d(5, 4, 3, padding=1)).to(device)
    conv_patch.apply(net)
    inner = []
    net[2].register_forward_hook(lambda m, a, y: inner.append(pack.ACTIVE.group))
    with torch.no_grad():
        net(x)
    assert inner == [state_of(net).packs] and state_of(net[2]).packs is None
