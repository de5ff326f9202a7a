"""ComfyUI: its conv classes (recognised by structure), the rules its model
patcher relies on, and the "Conv Patch VAE" node. ComfyUI itself is not
needed: ``ComfyStyleConv2d`` below follows the contract of
``comfy.ops.disable_weight_init.Conv2d`` (class-level ``comfy_cast_weights``,
``weight_function``, ``bias_function``; ``forward`` casts/patches per call when
any is set, else runs the torch forward)."""

import copy
import importlib.util
import io
import os
import pickle
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import conv_patch
import conv_patch.integrations.comfyui
import conv_patch.integrations.comfyui_install
from conv_patch.runtime import pack
from conv_patch.recipes.catalog import is_fused
from conv_patch.target import target_for
from conv_patch.runtime.wrappers import PatchedConvMixin
from conv_patch.runtime.state import state_of
from _util import ComfyCausalConv3d, rel_err


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


class ComfyStyleConv3d(nn.Conv3d, CastWeightBiasOp):
    """comfy.ops.disable_weight_init.Conv3d's contract: its own
    ``_conv_forward`` (the same conv as the torch class's; ComfyUI calls
    cuDNN directly there behind a workaround flag) that cuts the time taps
    to the input's frames under ``autopad="causal_zero"``, which its forward
    hands on (as it does a cast or patched call) to
    ``forward_comfy_cast_weights``."""

    def reset_parameters(self):
        return None

    def _conv_forward(self, input, weight, bias, autopad=None, *args, **kwargs):
        if autopad == "causal_zero":
            weight = weight[:, :, -input.shape[2]:]
        return torch.nn.functional.conv3d(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def forward_comfy_cast_weights(self, input, autopad=None):
        weight = self.weight.to(device=input.device, dtype=input.dtype)
        for f in self.weight_function:
            weight = f(weight)
        bias = None if self.bias is None else self.bias.to(device=input.device, dtype=input.dtype)
        return self._conv_forward(input, weight, bias, autopad=autopad)

    def forward(self, *args, **kwargs):
        if (self.comfy_cast_weights or len(self.weight_function) > 0 or len(self.bias_function) > 0
                or "autopad" in kwargs):
            return self.forward_comfy_cast_weights(*args, **kwargs)
        return super().forward(*args, **kwargs)


class ManualCastConv3d(ComfyStyleConv3d):
    comfy_cast_weights = True


class ComfyStyleCausalConv3d(ComfyCausalConv3d, ComfyStyleConv3d):
    """ComfyUI's WanVAE ``CausalConv3d``, built on its ops' Conv3d."""


class ShiftedComfyConv3d(ComfyStyleConv3d):
    """A class built on ComfyUI's Conv3d with a forward of its own: its
    contract is unknown."""

    def forward(self, x):
        return super().forward(x.roll(1, 2))


def _seeded(net, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return net


def test_comfy_conv3d_classes_are_patched_by_their_contract(device, exact_fp32):
    """ComfyUI's own Conv3d, whose ``_conv_forward`` is its own (all of
    ComfyUI's video VAEs' convs), is patched as a plain Conv3d, and its
    WanVAE ``CausalConv3d`` as a causal one; each computes what the class
    does, a call with ComfyUI's ``autopad`` and a cast one included. A
    class built on it with a forward of its own stays skipped. (Before,
    every one was skipped: "overrides _conv_forward".)"""
    net = _seeded(nn.ModuleDict({
        "plain": ComfyStyleConv3d(5, 6, 3, padding=(0, 1, 1)),
        "strided": ComfyStyleConv3d(6, 7, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1)),
        "cast": ManualCastConv3d(5, 4, 1),
        "causal": ComfyStyleCausalConv3d(5, 6, 3, padding=1),
        "shifted": ShiftedComfyConv3d(5, 6, 1),
    })).to(device).eval()
    ref = copy.deepcopy(net)
    x = torch.randn(1, 5, 5, 7, 6, device=device)
    one = torch.randn(1, 5, 1, 7, 6, device=device)
    cache = torch.randn(1, 5, 2, 7, 6, device=device)
    report = conv_patch.apply(net)
    assert sorted(report.patched) == ["cast", "causal", "plain", "strided"], report
    assert "shifted" in report.skipped and "contract is unknown" in report.skipped["shifted"]
    assert isinstance(net["plain"], ComfyStyleConv3d) and isinstance(net["plain"], PatchedConvMixin)
    with torch.no_grad():
        h = net["plain"](x)
        assert rel_err(h, ref["plain"](x)) <= 1e-5
        assert rel_err(net["strided"](h), ref["strided"](h)) <= 1e-5
        assert rel_err(net["cast"](x), ref["cast"](x)) <= 1e-5
        assert _label(net["cast"]).startswith("fallback (ComfyUI")
        # ComfyUI's own argument: the class's forward computes it.
        y = net["plain"](one, autopad="causal_zero")
        assert rel_err(y, ref["plain"](one, autopad="causal_zero")) <= 1e-5
        assert _label(net["plain"]) == "fallback (ComfyUI's own arguments (autopad))"
        assert rel_err(net["plain"](x), ref["plain"](x)) <= 1e-5
        for args in ((x,), (x, cache)):
            assert rel_err(net["causal"](*args), ref["causal"](*args)) <= 1e-5
        slots, ref_slots = [cache.clone()], [cache.clone()]
        assert rel_err(net["causal"](x, cache_list=slots, cache_idx=0),
                       ref["causal"](x, cache_list=ref_slots, cache_idx=0)) <= 1e-5
        assert slots == [None] == ref_slots
        assert rel_err(net["shifted"](x), ref["shifted"](x)) <= 1e-5
    conv_patch.remove(net)
    assert type(net["plain"]) is ComfyStyleConv3d and type(net["causal"]) is ComfyStyleCausalConv3d


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


# -- the node ---------------------------------------------------------------
# Stand-ins for what the node meets in ComfyUI, modelled on comfy/sd.py's VAE
# and comfy/model_patcher.py's ModelPatcher (what the node and ComfyUI's memory
# manager, comfy.model_management.load_models_gpu, use of them): the patcher
# keeps its load bookkeeping on the model, clones share the model and the
# backup dictionaries, object patches go into the model on every load, and a
# load with another patch id unpatches and reloads first.


def _set_attr(obj, path, value):
    *parents, last = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
    prev = getattr(obj, last)
    setattr(obj, last, value)
    return prev


class StandInPatcher:
    def __init__(self, model, load_device, offload_device):
        self.model, self.load_device, self.offload_device = model, load_device, offload_device
        if getattr(model, "device", None) is None:
            model.device = offload_device
        self.patches, self.backup, self.object_patches, self.object_patches_backup = {}, {}, {}, {}
        self.patches_uuid, self.parent = uuid.uuid4(), None
        for k, v in (("model_loaded_weight_memory", 0), ("model_lowvram", False),
                     ("current_weight_patches_uuid", None)):
            if not hasattr(model, k):
                setattr(model, k, v)

    def clone(self):
        n = type(self)(self.model, self.load_device, self.offload_device)
        n.patches = {k: v[:] for k, v in self.patches.items()}
        n.patches_uuid, n.object_patches = self.patches_uuid, self.object_patches.copy()
        n.backup, n.object_patches_backup, n.parent = self.backup, self.object_patches_backup, self
        return n

    def is_clone(self, other):
        return hasattr(other, "model") and self.model is other.model

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def patch_model(self):
        for k, obj in self.object_patches.items():
            old = _set_attr(self.model, k, obj)
            self.object_patches_backup.setdefault(k, old)

    def load(self, device):
        for m in self.model.modules():
            if m._parameters:
                m.comfy_patched_weights = True
        self.model.to(device)
        self.model.device, self.model.current_weight_patches_uuid = device, self.patches_uuid
        self.model.model_loaded_weight_memory = sum(p.numel() for p in self.model.parameters())

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            self.model.current_weight_patches_uuid = None
            self.model.to(device_to)
            self.model.device, self.model.model_loaded_weight_memory = device_to, 0
            for m in self.model.modules():
                m.__dict__.pop("comfy_patched_weights", None)
        for k, old in self.object_patches_backup.items():
            _set_attr(self.model, k, old)
        self.object_patches_backup.clear()

    def partially_load(self, device):
        cur = self.model.current_weight_patches_uuid
        self.unpatch_model(self.offload_device, unpatch_weights=cur is not None and cur != self.patches_uuid)
        self.patch_model()
        self.model.reloads = getattr(self.model, "reloads", 0)
        if not (self.model.model_lowvram is False and self.model.model_loaded_weight_memory > 0):
            self.model.reloads += 1
            self.load(device)

    def detach(self, unpatch_all=True):
        if unpatch_all:
            self.unpatch_model(self.offload_device, unpatch_weights=True)


LOADED = []  # comfy.model_management.current_loaded_models


def load_models_gpu(models):
    for m in models:
        for other in [o for o in LOADED if o is not m and m.is_clone(o)]:
            LOADED.remove(other)
            other.detach(unpatch_all=False)
        if m not in LOADED:
            LOADED.append(m)
        m.partially_load(m.load_device)


class StandInVAE:
    """comfy.sd.VAE as its __init__ builds it, decode/encode as it runs them."""

    def __init__(self, model, dtype=torch.float32, device="cpu"):
        self.first_stage_model = model.eval()
        self.device, self.vae_dtype = torch.device(device), dtype
        self.first_stage_model.to(self.vae_dtype)
        self.patcher = StandInPatcher(self.first_stage_model, load_device=self.device,
                                      offload_device=torch.device("cpu"))

    def decode(self, z):
        load_models_gpu([self.patcher])
        return self.first_stage_model.decode(z.to(self.vae_dtype).to(self.device)).float()

    def encode(self, x):
        load_models_gpu([self.patcher])
        return self.first_stage_model.encode(x.to(self.vae_dtype).to(self.device)).float()


class TinyAutoencoder(nn.Module):
    """The shape of ComfyUI's first_stage_model: top-level convs and blocks."""

    def __init__(self, device, decoder=None, encoder=None):
        super().__init__()
        self.decoder = decoder if decoder is not None else _net(device)
        self.encoder = encoder if encoder is not None else _net(device, seed=1)
        self.post_quant_conv = ComfyStyleConv2d(8, 8, 1).to(device)
        self.quant_conv = ComfyStyleConv2d(8, 8, 1).to(device)
        self.head = nn.Identity()  # a child with nothing to patch
        with torch.no_grad():  # ComfyUI's convs skip initialisation (weights are loaded next)
            for conv in (self.post_quant_conv, self.quant_conv):
                conv.weight.copy_(torch.eye(8).view(8, 8, 1, 1) + 0.1)
                conv.bias.fill_(0.1)

    def decode(self, z):
        return self.decoder(self.post_quant_conv(z))

    def encode(self, x):
        return self.quant_conv(self.encoder(x))


def _snapshot(model):
    """Everything the node must leave alone: each module's class and
    attributes, each parameter/buffer object."""
    return [(fqn, type(m), sorted(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
            for fqn, m in model.named_modules()]


def _install_node(tmp_path):
    from conv_patch.integrations import comfyui_install
    init = comfyui_install.install(str(tmp_path))
    spec = importlib.util.spec_from_file_location("conv_patch_node", init)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def node(tmp_path):
    LOADED.clear()
    yield _install_node(tmp_path).NODE_CLASS_MAPPINGS["ConvPatchVAE"]()
    LOADED.clear()


def test_node_package_follows_comfyui_conventions(tmp_path):
    mod = _install_node(tmp_path)
    cls = mod.NODE_CLASS_MAPPINGS["ConvPatchVAE"]
    assert cls is conv_patch.integrations.comfyui.ConvPatchVAE
    assert mod.NODE_DISPLAY_NAME_MAPPINGS["ConvPatchVAE"] == "Conv Patch VAE"
    inputs = cls.INPUT_TYPES()
    assert inputs["required"]["vae"] == ("VAE",)
    assert inputs["required"]["recipes"][0] == "BOOLEAN" and inputs["required"]["recipes"][1]["default"] is True
    assert cls.RETURN_TYPES == ("VAE",) and callable(getattr(cls, cls.FUNCTION)) and cls.CATEGORY


def _has_cp_state(model):
    return any(k.startswith("_cp_") for m in model.modules() for k in m.__dict__)


def test_node_leaves_the_input_vae_as_it_was(node, device, exact_fp32):
    vae = StandInVAE(TinyAutoencoder(device), device=device)
    model, patcher = vae.first_stage_model, vae.patcher
    z = torch.randn(1, 8, 6, 6, device=device)
    with torch.no_grad():
        ref = vae.decode(z)
        before = _snapshot(model)
        (out,) = node.patch(vae)
        assert _snapshot(model) == before and vae.patcher is patcher and not patcher.object_patches
        # The output: a clone of the input's patcher (ComfyUI's memory manager
        # sees one model) carrying patched copies of the changed children.
        assert out is not vae and out.patcher is not patcher and out.patcher.is_clone(patcher)
        assert out.first_stage_model is model and out.patcher.patches_uuid != patcher.patches_uuid
        dec = out.patcher.object_patches["decoder"]
        assert sorted(out.patcher.object_patches) == ["decoder", "encoder", "post_quant_conv", "quant_conv"]
        assert conv_patch.is_patched(dec[0]) and is_fused(dec)
        # The same Parameter objects: no weight memory added.
        assert dec[0].weight is model.decoder[0].weight
        assert dec[0].weight.data_ptr() == model.decoder[0].weight.data_ptr()
        assert rel_err(out.decode(z), ref) <= 1e-5
        assert model.decoder is dec and model.post_quant_conv is out.patcher.object_patches["post_quant_conv"]
        # Loading the input again (another branch of the workflow) puts its
        # own modules back, after a full unpatch (its per-load state reset).
        reloads = model.reloads
        assert rel_err(vae.decode(z), ref) <= 1e-5 and model.reloads == reloads + 1
        assert _snapshot(model) == before and not _has_cp_state(model)
        assert all(not conv_patch.is_patched(m) for m in model.modules())
        assert rel_err(model.decode(z), ref) <= 1e-5  # its forward as it was
        assert rel_err(out.decode(z), ref) <= 1e-5 and model.decoder is dec


def test_node_runs_are_idempotent_and_independent(node, device, exact_fp32):
    vae = StandInVAE(TinyAutoencoder(device), device=device)
    model = vae.first_stage_model
    z = torch.randn(1, 8, 5, 7, device=device)
    with torch.no_grad():
        ref = vae.decode(z)
        before = _snapshot(model)
        (a,) = node.patch(vae)
        (b,) = node.patch(vae)
        pa, pb = a.patcher.object_patches, b.patcher.object_patches
        assert a.patcher is not b.patcher and all(pa[k] is not pb[k] for k in pa)
        assert rel_err(a.decode(z), ref) <= 1e-5
        # The node run while a's modules are in the model starts from the input's own.
        (c,) = node.patch(vae)
        assert model.decoder is pa["decoder"] and c.patcher.object_patches["decoder"] is not pa["decoder"]
        assert rel_err(b.decode(z), ref) <= 1e-5 and rel_err(c.decode(z), ref) <= 1e-5
        # A second node on an output: patched the same way, not wrapped twice.
        (aa,) = node.patch(a)
        dec = aa.patcher.object_patches["decoder"]
        assert dec is not pa["decoder"] and conv_patch.is_patched(dec[0])
        assert not conv_patch.is_patched(state_of(dec[0]).original) and dec[0].weight is pa["decoder"][0].weight
        assert rel_err(aa.decode(z), ref) <= 1e-5
        # recipes off on the output: convolutions only; a stays fused.
        (plain,) = node.patch(a, recipes=False)
        dec = plain.patcher.object_patches["decoder"]
        assert conv_patch.is_patched(dec[0]) and not is_fused(dec)
        assert is_fused(pa["decoder"])
        assert rel_err(plain.decode(z), ref) <= 1e-5
        assert rel_err(vae.decode(z), ref) <= 1e-5 and _snapshot(model) == before and not _has_cp_state(model)


def test_node_cast_copies_only_the_output(node, device):
    vae = StandInVAE(TinyAutoencoder(device), device=device)
    model = vae.first_stage_model
    params = {k: (p, p.dtype) for k, p in model.named_parameters()}
    z = torch.randn(1, 8, 6, 6, device=device)
    with torch.no_grad():
        ref = vae.decode(z)
        before = _snapshot(model)
        (cast,) = node.patch(vae, dtype="bf16")
        assert cast.vae_dtype is torch.bfloat16 and vae.vae_dtype is torch.float32
        assert _snapshot(model) == before and all(p.dtype is d for p, d in params.values())
        assert {p.dtype for p in cast.first_stage_model.parameters()} == {torch.bfloat16}
        # A model of its own under a patcher of its own: no weights shared.
        assert cast.first_stage_model is not model and cast.patcher.model is cast.first_stage_model
        assert not cast.patcher.is_clone(vae.patcher) and conv_patch.is_patched(cast.first_stage_model.decoder[0])
        assert rel_err(cast.decode(z), ref) <= 2e-2
        (same,) = node.patch(vae, dtype="fp32")  # already fp32: no copy
        assert same.patcher.is_clone(vae.patcher)


def test_node_without_a_comfyui_patcher_copies_the_module_tree(node, device, exact_fp32):
    vae = SimpleNamespace(first_stage_model=_net(device), vae_dtype=torch.float32)
    model = vae.first_stage_model
    x = torch.randn(1, 8, 6, 6, device=device)
    with torch.no_grad():
        ref = model(x)
        before = _snapshot(model)
        (out,) = node.patch(vae)
        assert _snapshot(model) == before and out.first_stage_model is not model
        assert conv_patch.is_patched(out.first_stage_model[0]) and is_fused(out.first_stage_model)
        assert out.first_stage_model[0].weight is model[0].weight
        assert rel_err(out.first_stage_model(x), ref) <= 1e-5
        (again,) = node.patch(out, recipes=False)
        assert not is_fused(again.first_stage_model) and is_fused(out.first_stage_model)
        assert rel_err(again.first_stage_model(x), ref) <= 1e-5
    with pytest.raises(ValueError, match="first_stage_model"):
        node.patch(SimpleNamespace())
    with pytest.raises(ValueError, match="dtype"):
        node.patch(vae, dtype="int8")


def test_shared_copy_leaves_comfyui_load_state_behind(device):
    net = _net(device)
    conv = net[0]
    conv.comfy_patched_weights = True
    conv.prev_comfy_cast_weights, conv.comfy_cast_weights = False, True
    conv.weight_function = [lambda w: w]
    dup = conv_patch.integrations.comfyui.shared_copy(net)
    c = dup[0]
    assert c is not conv and c._parameters is conv._parameters and c._buffers is conv._buffers
    assert "comfy_patched_weights" not in c.__dict__ and c.comfy_cast_weights is False and c.weight_function == []
    assert conv.comfy_cast_weights is True and conv.weight_function  # the original keeps its own
    shared = nn.Sequential(conv, conv)
    dup = conv_patch.integrations.comfyui.shared_copy(shared)
    assert dup[0] is dup[1] and dup[0] is not conv


def test_node_on_a_small_ldm_vae_matches_unpatched(node, device, exact_fp32):
    ldm = pytest.importorskip("ldm.modules.diffusionmodules.model")
    torch.manual_seed(0)
    cfg = dict(ch=32, out_ch=3, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=[8], in_channels=3,
               resolution=16, z_channels=4)
    enc, dec = ldm.Encoder(double_z=True, **cfg), ldm.Decoder(**cfg)
    model = TinyAutoencoder(device, decoder=dec, encoder=enc)
    model.post_quant_conv, model.quant_conv = nn.Conv2d(4, 4, 1), nn.Conv2d(8, 8, 1)
    vae = StandInVAE(model.to(device), device=device)
    x, z = torch.randn(1, 3, 16, 16, device=device), torch.randn(1, 4, 8, 8, device=device)
    with torch.no_grad():
        ref_dec, ref_enc = vae.decode(z), vae.encode(x)
        (out,) = node.patch(vae)
        assert is_fused(out.patcher.object_patches["decoder"])
        assert rel_err(out.decode(z), ref_dec) <= 2e-6 and rel_err(out.encode(x), ref_enc) <= 2e-6
        assert rel_err(vae.decode(z), ref_dec) <= 1e-7  # the input's own modules again
        assert not _has_cp_state(vae.first_stage_model)


# -- convpatch comfyui-install ----------------------------------------------

def _cli(capsys, *argv):
    from conv_patch.tools.cli import main
    rc = main(["comfyui-install", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_comfyui_install_writes_a_shim_and_refreshes_it(tmp_path, capsys):
    nodes = tmp_path / "ComfyUI" / "custom_nodes"
    nodes.mkdir(parents=True)
    rc, out, err = _cli(capsys, str(tmp_path / "ComfyUI"))  # ComfyUI's root: its custom_nodes
    init = nodes / "conv_patch_node" / "__init__.py"
    assert rc == 0 and not err and init.is_file() and str(init) in out and "restart ComfyUI" in out
    spec = importlib.util.spec_from_file_location("conv_patch_node", init)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.NODE_CLASS_MAPPINGS == conv_patch.integrations.comfyui.NODE_CLASS_MAPPINGS
    (init.parent / "__pycache__").mkdir()
    init.write_text(init.read_text() + "# an older shim\n")
    rc, out, err = _cli(capsys, str(nodes))  # ours: refreshed
    assert rc == 0 and init.read_text() == conv_patch.integrations.comfyui_install.SHIM


def test_comfyui_install_refuses_bad_folders(tmp_path, capsys):
    for path, what in ((tmp_path / "missing", "no such folder"), (tmp_path / "file", "not a folder")):
        if what == "not a folder":
            path.write_text("x")
        rc, out, err = _cli(capsys, str(path))
        assert rc == 2 and not out and err.count("\n") == 1 and str(path) in err and what in err
    foreign = tmp_path / "conv_patch_node"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("print('mine')\n")
    (foreign / "notes.txt").write_text("keep me\n")
    rc, out, err = _cli(capsys, str(tmp_path))
    assert rc == 2 and err.count("\n") == 1 and str(foreign) in err and "--force" in err
    assert (foreign / "notes.txt").is_file()
    link = tmp_path / "links" / "conv_patch_node"
    link.parent.mkdir()
    link.symlink_to(foreign)
    rc, out, err = _cli(capsys, str(link.parent))
    assert rc == 2 and "symlink" in err and (foreign / "notes.txt").is_file()
    rc, out, err = _cli(capsys, str(tmp_path), "--force")
    assert rc == 0 and sorted(p.name for p in foreign.iterdir()) == ["__init__.py"]
    rc, out, err = _cli(capsys, str(link.parent), "--force")
    assert rc == 0 and not link.is_symlink() and (link / "__init__.py").is_file() and foreign.is_dir()


def test_comfyui_install_refuses_an_unwritable_folder(tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root: permissions are not enforced, so ask as if they were
            monkeypatch.setattr(conv_patch.integrations.comfyui_install.os, "access", lambda p, mode: False)
        rc, out, err = _cli(capsys, str(ro))
        assert rc == 2 and err.count("\n") == 1 and str(ro) in err and "permission denied" in err
    finally:
        ro.chmod(0o700)


def test_shim_says_which_pip_when_conv_patch_is_missing(tmp_path):
    init = conv_patch.integrations.comfyui_install.install(str(tmp_path))
    # -S: without site-packages, as a ComfyUI Python conv-patch was not
    # installed into; the shim must load, log one line and export no nodes.
    code = ("import runpy, sys; g = runpy.run_path(sys.argv[1]); "
            "assert g['NODE_CLASS_MAPPINGS'] == {}, g['NODE_CLASS_MAPPINGS']")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(init)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "not installed in the Python running ComfyUI" in r.stderr and "-m pip install" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


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
