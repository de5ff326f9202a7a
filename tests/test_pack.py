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
from conv_patch import pack
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
    assert net[0]._cp_last.is_kernel
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
    assert net[0]._cp_pack.buf.dtype == torch.float32
    net.half()
    twin.half()
    assert net[0]._cp_pack is None  # released at the move, not at the next call
    check_same(net, twin, device, torch.float16)
    gc.collect()
    assert pack.stats()["live"] == base + 2 and net[0]._cp_pack.buf.dtype == torch.float16
    conv_patch.remove(net)
    gc.collect()
    assert pack.stats()["live"] == base


def test_channels_last_weights_need_no_pack(device, exact_fp32):
    gc.collect()
    base = pack.stats()["live"]
    net, twin = make(device, channels_last=True)
    check_same(net, twin, device)
    # The transposed conv's [C_in, C_out, k, k] weight still needs one.
    assert pack.stats()["live"] == base + 1 and net[0]._cp_pack is None


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
        assert isinstance(net[0].base_layer, conv_patch.PatchedConv2d)
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
        assert net[0].base_layer._cp_last.is_kernel
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

