"""ComfyUI: its conv classes (recognised by structure), the rules its model
patcher relies on, and the "Conv Patch VAE" node. ComfyUI itself is not
needed: ``ComfyStyleConv2d`` below follows the contract of
``comfy.ops.disable_weight_init.Conv2d`` (class-level ``comfy_cast_weights``,
``weight_function``, ``bias_function``; ``forward`` casts/patches per call when
any is set, else runs the torch forward)."""

import copy
import importlib.util
import io
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch import pack
from conv_patch.target import target_for
from conv_patch.wrappers import PatchedConvMixin
from _util import rel_err


class CastWeightBiasOp:
    comfy_cast_weights = False
    weight_function = []
    bias_function = []


class ComfyStyleConv2d(nn.Conv2d, CastWeightBiasOp):
    def reset_parameters(self):
        return None

    def forward_comfy_cast_weights(self, input):
        weight = self.weight.to(device=input.device, dtype=input.dtype)
        for f in self.weight_function:
            weight = f(weight)
        bias = None if self.bias is None else self.bias.to(device=input.device, dtype=input.dtype)
        for f in self.bias_function:
            bias = f(bias)
        return self._conv_forward(input, weight, bias)

    def forward(self, *args, **kwargs):
        if self.comfy_cast_weights or len(self.weight_function) > 0 or len(self.bias_function) > 0:
            return self.forward_comfy_cast_weights(*args, **kwargs)
        return super().forward(*args, **kwargs)


class ManualCastConv2d(ComfyStyleConv2d):
    comfy_cast_weights = True


class ComfyStyleGroupNorm(nn.GroupNorm, CastWeightBiasOp):
    """comfy.ops.disable_weight_init.GroupNorm's contract."""

    def forward_comfy_cast_weights(self, input):
        weight = self.weight.to(device=input.device, dtype=input.dtype)
        for f in self.weight_function:
            weight = f(weight)
        return torch.nn.functional.group_norm(input, self.num_groups, weight, self.bias, self.eps)

    def forward(self, *args, **kwargs):
        if self.comfy_cast_weights or len(self.weight_function) > 0 or len(self.bias_function) > 0:
            return self.forward_comfy_cast_weights(*args, **kwargs)
        return super().forward(*args, **kwargs)


def _net(device, cls=ComfyStyleConv2d, seed=0):
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(cls(8, 16, 3, padding=1), nn.ReLU(), cls(16, 8, 3, padding=1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return net.to(device).eval()


def _label(m):
    return m.extra_repr().split("route=")[1]


def test_comfy_convs_are_wrapped_and_keep_their_contract(device, exact_fp32):
    net = _net(device)
    x = torch.randn(2, 8, 9, 10, device=device)
    with torch.no_grad():
        ref = net(x)
        report = conv_patch.apply(net)
        assert sorted(report.patched) == ["0", "2"] and not report.skipped
        conv = net[0]
        # What ComfyUI's model patcher looks for, and what its forward's
        # super() call needs.
        assert isinstance(conv, ComfyStyleConv2d) and isinstance(conv, PatchedConvMixin)
        assert hasattr(conv, "comfy_cast_weights") and conv.weight_function == []
        out = net(x)
        assert rel_err(out, ref) <= 1e-5
        if target_for(x.device).kernels:
            assert _label(conv) == "conv2d_igemm"


def test_weight_patching_and_casting_use_the_per_call_weight(device, exact_fp32):
    net = _net(device)
    x = torch.randn(1, 8, 7, 7, device=device)
    with torch.no_grad():
        conv_patch.apply(net)
        conv = net[0]
        plain = conv(x)
        # ComfyUI's patcher sets LoRA/low-VRAM patches on the module at that
        # path, which is now the wrapper.
        conv.weight_function = [lambda w: w * 2]
        patched = conv(x)
        bias = conv.bias.view(1, -1, 1, 1)
        assert rel_err(patched, 2 * (plain - bias) + bias) <= 1e-5
        assert _label(conv).startswith("fallback (ComfyUI")
        conv.weight_function = []
        assert rel_err(conv(x), plain) <= 1e-5  # the pack was never stale
        # Low-VRAM: weights kept in another dtype, cast per call.
        conv.comfy_cast_weights = True
        conv.to(torch.float64)
        assert rel_err(conv(x), plain) <= 1e-5 and _label(conv).startswith("fallback (ComfyUI")


def test_manual_cast_class_always_casts(device):
    net = _net(device, ManualCastConv2d)
    x = torch.randn(1, 8, 6, 6, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = net(x)
        conv_patch.apply(net)
        assert rel_err(net(x), ref) <= 1e-2 and _label(net[0]).startswith("fallback (ComfyUI")


def test_remove_pickle_deepcopy(device):
    net = _net(device)
    originals = [net[0], net[2]]
    conv_patch.apply(net)
    buf = io.BytesIO()
    pickle.dump(net, buf)
    clone = pickle.loads(buf.getvalue())
    assert type(clone[0]) is type(net[0]) and torch.equal(clone[0].weight, net[0].weight)
    dup = copy.deepcopy(net)
    assert type(dup[2]) is type(net[2])
    assert conv_patch.remove(net) == ["", "0", "2"]  # the Sequential's recipe, then the convs
    assert net[0] is originals[0] and type(net[0]) is ComfyStyleConv2d


def test_packs_released_on_every_move(device):
    """ComfyUI offloads models back and forth; each move drops the pack, so
    packs never pile up (the GPU version of this checks memory)."""
    net = _net(device)
    net[0].weight.data = net[0].weight.data.contiguous()  # NCHW weight: needs a pack
    x = torch.randn(1, 8, 5, 5, device=device)
    conv_patch.apply(net)
    if not target_for(x.device).kernels:
        pytest.skip("no kernels here")
    with torch.no_grad():
        net(x)
        live = pack.stats()["live"]
        for _ in range(50):
            net.to(torch.float64)
            net.to(torch.float32)
            net(x)
    assert pack.stats()["live"] <= live


def _load_node_package():
    path = Path(__file__).resolve().parents[1] / "examples" / "comfyui" / "__init__.py"
    spec = importlib.util.spec_from_file_location("conv_patch_comfyui_node", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_node_package_follows_comfyui_conventions():
    mod = _load_node_package()
    cls = mod.NODE_CLASS_MAPPINGS["ConvPatchVAE"]
    assert mod.NODE_DISPLAY_NAME_MAPPINGS["ConvPatchVAE"] == "Conv Patch VAE"
    inputs = cls.INPUT_TYPES()
    assert inputs["required"]["vae"] == ("VAE",)
    assert inputs["required"]["recipes"][0] == "BOOLEAN" and inputs["required"]["recipes"][1]["default"] is True
    assert cls.RETURN_TYPES == ("VAE",) and callable(getattr(cls, cls.FUNCTION)) and cls.CATEGORY


def test_node_patches_first_stage_model_idempotently(device, exact_fp32):
    node = _load_node_package().NODE_CLASS_MAPPINGS["ConvPatchVAE"]()
    vae = SimpleNamespace(first_stage_model=_net(device), vae_dtype=torch.float32)
    x = torch.randn(1, 8, 6, 6, device=device)
    with torch.no_grad():
        ref = vae.first_stage_model(x)
        (out_vae,) = node.patch(vae)
        assert out_vae is vae and conv_patch.is_patched(vae.first_stage_model[0])
        first = vae.first_stage_model[0]
        node.patch(vae)
        assert vae.first_stage_model[0] is first  # not wrapped twice
        assert rel_err(vae.first_stage_model(x), ref) <= 1e-5
        assert conv_patch.recipes.is_fused(vae.first_stage_model)
        node.patch(vae, recipes=False)  # turns the recipes off again, convs stay patched
        assert not conv_patch.recipes.is_fused(vae.first_stage_model) and vae.first_stage_model[0] is first
        assert rel_err(vae.first_stage_model(x), ref) <= 1e-5
    (cast,) = node.patch(SimpleNamespace(first_stage_model=_net(device), vae_dtype=torch.float32), dtype="bf16")
    assert cast.vae_dtype is torch.bfloat16 and cast.first_stage_model[0].weight.dtype is torch.bfloat16
    with pytest.raises(ValueError, match="first_stage_model"):
        node.patch(SimpleNamespace())


def test_comfy_group_norm_keeps_its_contract(device, exact_fp32):
    gn = ComfyStyleGroupNorm(4, 12).to(device)
    with torch.no_grad():
        gn.weight.copy_(torch.linspace(0.5, 1.5, 12))
        gn.bias.copy_(torch.linspace(-0.2, 0.2, 12))
    net = nn.Sequential(gn).eval()
    x = torch.randn(2, 12, 5, 7, device=device) + 3
    with torch.no_grad():
        ref = net(x)
        report = conv_patch.apply(net)
        assert report.fused["0"].startswith("group_norm")
        assert isinstance(net[0], ComfyStyleGroupNorm) and hasattr(net[0], "comfy_cast_weights")
        assert rel_err(net(x), ref) <= 1e-5
        # A LoRA-style patch set by ComfyUI's patcher: its own forward, with the per-call weight.
        net[0].weight_function = [lambda w: w * 2]
        doubled = net(x)
        net[0].weight_function = []
        expect = torch.nn.functional.group_norm(x, 4, gn.weight * 2, gn.bias, gn.eps)
        assert rel_err(doubled, expect) <= 1e-5
