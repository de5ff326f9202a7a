"""The "Conv Patch Upscale Model" node on ComfyUI's UPSCALE_MODEL: a
spandrel ``ImageModelDescriptor``, stood in for by ``Descriptor`` below
(its contract as ComfyUI uses it: the network behind the public ``model``
property, ``__call__`` under inference mode reading it, ``to`` moving it,
``scale``). The input is left as it was, the output shares its weights,
computes what it computes, and goes through the node again without a
second layer of patching."""

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.integrations import comfyui
from bench import zoo
from _util import TOL, rel_err


class Descriptor:
    def __init__(self, model, scale):
        self._model = model.eval()
        self.scale = scale
        self.tags = ["test"]

    @property
    def model(self):
        return self._model

    @torch.inference_mode()
    def __call__(self, image):
        return self.model(image).clamp_(0, 1)

    def to(self, *args, **kwargs):
        self.model.to(*args, **kwargs)
        return self


def _nets():
    return {"srvgg": zoo.srvgg_x4(True)[0], "rrdb-spandrel": zoo.rrdb_spandrel(True)[0]}


def _seeded(net, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (0.25 if p.dim() == 1 and p.numel() == 8 else 0.0))
    return net


@pytest.mark.parametrize("name", ["srvgg", "rrdb-spandrel"])
def test_the_node_patches_a_copy_and_computes_the_same(name, exact_fp32):
    net = _seeded(_nets()[name])
    desc = Descriptor(net, 4)
    before = {k: v.data_ptr() for k, v in net.state_dict().items()}
    node = comfyui.NODE_CLASS_MAPPINGS["ConvPatchUpscaleModel"]()
    (out,) = node.patch(desc)
    assert isinstance(out, Descriptor) and out.scale == 4 and out.tags == ["test"]
    assert desc.model is net and not any(conv_patch.is_patched(m) for m in net.modules())
    assert any(conv_patch.is_patched(m) for m in out.model.modules())
    assert {k: v.data_ptr() for k, v in out.model.state_dict().items()} == before  # no weight copied
    g = torch.Generator().manual_seed(5)
    image = torch.rand(1, 3, 9, 7, generator=g)
    assert rel_err(out(image), desc(image)) <= TOL[torch.float32] * 10
    if name == "srvgg":
        assert conv_patch.recipes.catalog.is_fused(out.model)
    again, = node.patch(out)
    assert again.model is not out.model and type(again) is type(out)
    assert sum(conv_patch.is_patched(m) for m in again.model.modules()) == sum(
        conv_patch.is_patched(m) for m in out.model.modules())


def test_moving_the_output_moves_one_model():
    net = _seeded(_nets()["srvgg"])
    desc = Descriptor(net, 4)
    out, _ = comfyui.patched_upscale_model(desc)
    out.to(torch.float64)
    assert next(net.parameters()).dtype == torch.float64  # the same Parameters, as ComfyUI's .to() expects


@pytest.mark.parametrize("bad", [object(), nn.Conv2d(3, 3, 1)])
def test_what_is_not_an_upscale_model(bad):
    with pytest.raises(ValueError, match="Conv Patch Upscale Model"):
        comfyui.patched_upscale_model(bad)


def test_the_cuda_graphs_option():
    net = _seeded(_nets()["srvgg"])
    plain, _ = comfyui.patched_upscale_model(Descriptor(net, 4))
    graphed, _ = comfyui.patched_upscale_model(Descriptor(net, 4), cuda_graphs=True)
    from conv_patch.runtime.state import peek
    # Off: the compact net replays under cuda_graphs="auto"'s memory bound,
    # an ESRGAN's RRDBs do not; on: every fused block, bounded by count only.
    assert peek(plain.model).graphs.auto and not peek(graphed.model).graphs.auto
    rrdb, _ = comfyui.patched_upscale_model(Descriptor(_seeded(_nets()["rrdb-spandrel"]), 4))
    assert not any(peek(m) is not None and peek(m).graphs is not None for m in rrdb.model.modules())
    convs_only, report = comfyui.patched_upscale_model(Descriptor(net, 4), recipes=False, cuda_graphs=True)
    assert not report.fused  # (graphs replay fused blocks: none without recipes)
