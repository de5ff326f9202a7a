"""The ComfyUI nodes "Conv Patch VAE" and "Conv Patch Upscale Model".

``convpatch comfyui-install ComfyUI/custom_nodes`` writes the shim package
that loads this node into ComfyUI (``conv_patch.integrations.comfyui_install``). Nothing
here imports ComfyUI: its VAE object is used through ``vae.first_stage_model``
(the ldm ``AutoencoderKL``, the ``AutoencodingEngine`` of SD3/FLUX, a TAESD
module, ...), ``vae.vae_dtype`` and ``vae.patcher`` (a
``comfy.model_patcher.ModelPatcher``: ``clone``, ``add_object_patch``,
``model``, ``patches``, ``load_device``/``offload_device``); its conv classes
are recognised by structure (``conv_patch.runtime.wrappers.is_comfy_conv_class``).

The node never changes the VAE it is given: ComfyUI caches a node's output and
hands the same object to every consumer. It returns a new VAE whose model
patcher is a *clone* of the input's (what ComfyUI's LoRA loaders do) carrying
the patched blocks as object patches (``add_object_patch``): patched copies of
the model's top-level children (encoder, decoder, quant convs, ...), built by
:func:`shared_copy`, whose Parameters and buffers are the input's own tensor
objects, so no weight memory is added. ComfyUI sets them into the model when
it loads that patcher (every ``VAEDecode``/``VAEEncode`` does) and puts the
original children back when it loads any other clone of the same model, the
input's included. One model object, as ComfyUI's memory manager expects:
it tracks what is loaded per model (``model_loaded_weight_memory``,
``model.device``) and moves Parameters in place, so a second model holding
the same Parameters under its own patcher would see them moved under it.

The clone gets a patch id of its own (``patches_uuid``), as ComfyUI's
``set_model_compute_dtype`` does for the same reason: switching between the
input and the output then goes through ComfyUI's full unpatch and reload,
which resets the per-load state ComfyUI keeps on each module (low-VRAM casting,
``comfy_patched_weights``) before the other set of modules goes in. A workflow
using both VAEs pays one reload of the VAE weights per switch; one using only
the node's output pays nothing.
"""

from __future__ import annotations

import copy
import logging
import uuid
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from conv_patch.recipes import catalog as rc
from conv_patch.api.patcher import PatchConfig, PatchReport, apply, is_patched

log = logging.getLogger("conv_patch")

DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# State ComfyUI's ModelPatcher.load() keeps on a module for the load it
# made; a copy starts without it, as a freshly built module does, and the
# next load sets it for the copy.
_LOAD_STATE = ("comfy_patched_weights", "prev_comfy_cast_weights")
# What ModelPatcher keeps on the model it manages; a model copied for a new
# patcher must not inherit the input's (ModelPatcher.__init__ sets what is
# missing).
_MODEL_BOOKKEEPING = ("device", "model_loaded_weight_memory", "lowvram_patch_counter", "model_lowvram",
                      "current_weight_patches_uuid")

# Each patched child this module hands to a patcher -> the input's child it
# was copied from: a node run on a VAE whose model holds another clone's
# patched children at that moment (or on the node's own output) starts again
# from the original.
_SOURCE: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()

CastFn = Callable[[str, torch.Tensor, bool], torch.Tensor]


def shared_copy(module: nn.Module, cast: Optional[CastFn] = None) -> nn.Module:
    """A structural copy of ``module``'s tree: a new object for every module
    (same class, attributes and hooks), sharing with the original its
    ``_parameters`` and ``_buffers`` dictionaries, so the copy holds the same
    Parameter and buffer objects and no tensor memory is added. A weight
    ComfyUI replaces (``set_attr_param``) or a buffer ``.to()`` replaces is
    replaced for both. A module shared between paths stays shared. Each
    object is copied through ``copy.copy``, so wrapper and fused-block
    state that must not travel (kernel packs, plans) is left behind by their
    ``__getstate__``; ComfyUI's per-load state is left behind too.

    ``cast(name, tensor, is_parameter)`` gives the copy tensors of its own
    instead (new dictionaries; ``name`` is the tensor's path in ``module``):
    the only case where memory is added.
    """
    memo: Dict[int, nn.Module] = {}

    def visit(m: nn.Module, prefix: str) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        new = copy.copy(m)
        d = new.__dict__
        if "prev_comfy_cast_weights" in d:
            d["comfy_cast_weights"] = d["prev_comfy_cast_weights"]
        for k in _LOAD_STATE:
            d.pop(k, None)
        for k in ("weight_function", "bias_function"):
            if k in d:
                d[k] = []  # low-VRAM patches of the input's load
        if cast is not None:
            d["_parameters"] = type(m._parameters)(
                (k, None if p is None else cast(prefix + k, p, True)) for k, p in m._parameters.items())
            d["_buffers"] = type(m._buffers)(
                (k, None if b is None else cast(prefix + k, b, False)) for k, b in m._buffers.items())
        d["_modules"] = type(m._modules)()
        memo[id(m)] = new
        for name, child in m._modules.items():
            d["_modules"][name] = None if child is None else visit(child, f"{prefix}{name}.")
        return new

    return visit(module, "")


def _changed(m: nn.Module) -> bool:
    return any(is_patched(x) or rc.is_fused(x) for x in m.modules())


def _patch_tree(root: nn.Module, recipes: bool, config: Optional[PatchConfig] = None) -> PatchReport:
    report = apply(root, config=config, recipes=recipes)
    if not recipes:
        # Blocks fused in a VAE patched in place by an older version of the
        # node (or by conv_patch.apply) get their own forward back, in the copy.
        for m in root.modules():
            rc.unfuse(m)
    return report


def _comfy_patcher(vae):
    p = getattr(vae, "patcher", None)
    if p is None or not all(hasattr(p, a) for a in ("clone", "add_object_patch", "object_patches", "model")):
        return None
    if p.model is not vae.first_stage_model:
        log.warning("Conv Patch VAE: vae.patcher.model is not vae.first_stage_model; patching a copy of the "
                    "model without ComfyUI's patcher")
        return None
    return p


def _source_of(obj, default=None):
    """The input's child a patched child of ours was copied from, else
    ``default``."""
    try:
        src = _SOURCE.get(obj)
    except TypeError:  # not weak-referenceable (None, a number): not ours
        src = None
    return default if src is None else src


def _originals(root: nn.Module) -> nn.Module:
    """A shallow copy of ``root`` whose children are the input's own (not
    another clone's patched children set into ``root`` right now)."""
    shell = copy.copy(root)
    shell.__dict__["_modules"] = type(root._modules)(
        (name, _source_of(child, child)) for name, child in root._modules.items())
    return shell


def _caster(dtype: torch.dtype, device, unpatched: Dict[str, torch.Tensor]) -> CastFn:
    def cast(name, t, is_param):
        t = unpatched.get(name, t)  # the weight before ComfyUI's patches (LoRA) were applied in place
        if t.is_floating_point():
            t = t.detach().to(device=device if device is not None else t.device, dtype=dtype)
        elif device is not None:
            t = t.to(device)
        return nn.Parameter(t, requires_grad=False) if is_param else t
    return cast


def _needs_cast(model: nn.Module, dtype) -> bool:
    return dtype is not None and any(t.is_floating_point() and t.dtype != dtype
                                     for t in list(model.parameters()) + list(model.buffers()))


def patched_vae(vae, dtype: Optional[torch.dtype] = None, recipes: bool = True) -> Tuple[object, PatchReport]:
    """A patched VAE made from ComfyUI VAE ``vae``, which is left as it was
    (its modules, parameters, patcher and ``vae_dtype``); see the module
    docstring for how. ``dtype``: cast the result (ComfyUI's ``vae_dtype``
    too); the cast weights are a copy, made only when the VAE holds another
    dtype, and the input keeps its own. Without a ComfyUI patcher on ``vae``
    (any object with a ``first_stage_model`` module) the result holds a patched
    :func:`shared_copy` of the model."""
    model = getattr(vae, "first_stage_model", None)
    if not isinstance(model, nn.Module):
        raise ValueError(f"Conv Patch VAE: expected a ComfyUI VAE with a first_stage_model module, "
                         f"got {type(vae).__name__}")
    out = copy.copy(vae)
    p = _comfy_patcher(vae)
    if _needs_cast(model, dtype):
        out.vae_dtype = dtype
        return _cast_copy(vae, out, p, dtype, recipes)
    if dtype is not None and hasattr(vae, "vae_dtype"):
        out.vae_dtype = dtype
    tree = shared_copy(_originals(model) if p is not None else model)
    report = _patch_tree(tree, recipes)
    if p is None:
        out.first_stage_model = tree
        return out, report
    clone = p.clone()
    # A patch id of its own: see the module docstring.
    clone.patches_uuid = uuid.uuid4()
    for name, child in tree._modules.items():
        if child is not None and _changed(child):
            _SOURCE[child] = _source_of(model._modules[name], model._modules[name])
            clone.add_object_patch(name, child)
        elif _source_of(clone.object_patches.get(name)) is not None:
            del clone.object_patches[name]  # ours from an earlier run, patching nothing now
    if rc.is_fused(tree):
        log.info("Conv Patch VAE: the model itself is not fused (its patcher swaps only its children)")
    out.patcher = clone
    return out, report


def _cast_copy(vae, out, p, dtype, recipes):
    """The cast VAE: a model of its own (new weights in ``dtype``) under a new
    patcher built the way ``comfy.sd.VAE`` builds one, keeping the input
    patcher's weight patches."""
    model = vae.first_stage_model
    if p is None:
        tree = shared_copy(model, _caster(dtype, None, {}))
        out.first_stage_model = tree
        return out, _patch_tree(tree, recipes)
    # A weight ComfyUI patched in place has its unpatched value in the
    # patcher's backup: the copy is cast from that, and patched again on load.
    unpatched = {k: getattr(b, "weight", b) for k, b in (getattr(p, "backup", None) or {}).items()}
    tree = shared_copy(_originals(model), _caster(dtype, p.offload_device, unpatched))
    for k in _MODEL_BOOKKEEPING:
        tree.__dict__.pop(k, None)
    report = _patch_tree(tree, recipes)
    new = type(p)(tree, load_device=p.load_device, offload_device=p.offload_device)
    for k, v in getattr(p, "patches", {}).items():
        new.patches[k] = v[:]
    out.first_stage_model = tree
    out.patcher = new
    return out, report


class ConvPatchVAE:
    """Return a copy of the VAE whose convolutions run on conv-patch's kernels;
    the input VAE is left as it was. Idempotent: a VAE that went through the
    node before gets the same patching again, never a second layer of it."""

    CATEGORY = "conv-patch"
    FUNCTION = "patch"
    RETURN_TYPES = ("VAE",)
    RETURN_NAMES = ("vae",)
    DESCRIPTION = ("Runs the VAE's convolutions on conv-patch's Triton kernels (fused bias/residual/"
                   "activation epilogues, Hopper TMA kernels on sm90). Anything the kernels cannot take, "
                   "and any conv ComfyUI is casting or patching (low-VRAM, LoRA), runs the original code. "
                   "The input VAE is not changed: the output shares its weights (a copy only when a dtype "
                   "cast is asked for). Without Triton (Windows) everything runs the original code.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "vae": ("VAE",),
            "dtype": (list(DTYPES), {"default": "keep",
                                     "tooltip": "cast the output VAE (a copy of the weights; the input keeps "
                                                "its own). keep: as loaded"}),
            "recipes": ("BOOLEAN", {"default": True,
                                    "tooltip": "fuse GroupNorm/SiLU, upsampling and residuals around the "
                                               "convolutions of the VAE's blocks (off: convolutions only)"}),
        }}

    def patch(self, vae, dtype="keep", recipes=True):
        if dtype not in DTYPES:
            raise ValueError(f"Conv Patch VAE: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        out, report = patched_vae(vae, DTYPES[dtype], bool(recipes))
        log.info("Conv Patch VAE: %d convolutions patched, %d skipped, %d already patched, %d blocks fused",
                 len(report.patched), len(report.skipped), len(report.already_patched), len(report.fused))
        for fqn, why in report.skipped.items():
            log.info("  skipped %s: %s", fqn, why)
        return (out,)


# -- upscale models -------------------------------------------------------------
# ComfyUI's UPSCALE_MODEL is a spandrel ``ImageModelDescriptor``: its public
# ``model`` property is the network, and every method of the descriptor
# (``__call__``'s padding and clamp, ``to``, ``scale``...) reads the network
# through it. The node's output is a copy of the descriptor whose class is a
# subclass of the input's (``isinstance`` holds) overriding ``model`` with a
# patched ``shared_copy`` of the network: no weight memory added, the input
# descriptor and its network untouched, nothing of spandrel's private state
# written. ComfyUI moves an upscale model to the GPU for each upscale and
# back after it (``to``): the copy's Parameters are the input's own objects,
# moved for both, as one model.
_DESCRIPTORS: Dict[type, type] = {}


def _patched_descriptor_class(cls: type) -> type:
    sub = _DESCRIPTORS.get(cls)
    if sub is None:
        sub = _DESCRIPTORS[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
            "model": property(lambda self: self.__dict__["cp_model"],
                              doc="The network, patched by conv-patch (a copy sharing the input's weights)."),
            "cp_descriptor_base": cls,
        })
    return sub


def patched_upscale_model(model, recipes: bool = True, cuda_graphs: bool = False) -> Tuple[object, PatchReport]:
    """A patched copy of ComfyUI upscale model ``model`` (a spandrel
    descriptor, or any object whose ``model`` property is the network),
    which is left as it was; see the comment above for how. A model the node
    patched before is patched again from its original network, never a
    second layer. ``cuda_graphs`` (with ``recipes``): every fused block
    (each RRDB, a compact net) replays a CUDA graph per tile shape
    (``PatchConfig(cuda_graphs=True)``). Off, the default: only a compact
    net does, within ``cuda_graphs="auto"``'s memory bound
    (``runtime/graphs.py``); each graph keeps its call's activations, and
    ComfyUI's tiles come in up to four shapes (inside, right and bottom
    edges, corner), gigabytes for an fp32 ESRGAN at 512²."""
    net = getattr(model, "model", None)
    if not isinstance(net, nn.Module):
        raise ValueError(f"Conv Patch Upscale Model: expected an upscale model with a `model` network, "
                         f"got {type(model).__name__}")
    cls = type(model)
    base = getattr(cls, "cp_descriptor_base", cls)
    if not isinstance(getattr(base, "model", None), property):
        raise ValueError(f"Conv Patch Upscale Model: {base.__name__}.model is not a property; "
                         "not a spandrel model descriptor")
    source = model.__dict__.get("cp_source", net)
    tree = shared_copy(source)
    report = _patch_tree(tree, recipes, PatchConfig(cuda_graphs=True) if recipes and cuda_graphs else None)
    out = object.__new__(_patched_descriptor_class(base))
    out.__dict__.update(model.__dict__)
    out.__dict__.update(cp_model=tree, cp_source=source)
    return out, report


class ConvPatchUpscaleModel:
    """Return a copy of the upscale model (ESRGAN/RRDB, Real-ESRGAN compact,
    any spandrel net) whose convolutions run on conv-patch's kernels; the
    input model is left as it was."""

    CATEGORY = "conv-patch"
    FUNCTION = "patch"
    RETURN_TYPES = ("UPSCALE_MODEL",)
    RETURN_NAMES = ("upscale_model",)
    DESCRIPTION = ("Runs the upscale model's convolutions on conv-patch's Triton kernels, with the ESRGAN "
                   "dense blocks' and Real-ESRGAN compact nets' activations and residuals fused into them. "
                   "Anything the kernels cannot take runs the original code. The input model is not "
                   "changed: the output shares its weights. Without Triton everything runs the original code.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "upscale_model": ("UPSCALE_MODEL",),
            "recipes": ("BOOLEAN", {"default": True,
                                    "tooltip": "fuse activations, residuals and concatenations around the "
                                               "convolutions of the net's blocks (off: convolutions only)"}),
            "cuda_graphs": ("BOOLEAN", {"default": False,
                                        "tooltip": "replay every fused block (each ESRGAN RRDB) from a CUDA "
                                                   "graph per tile shape; needs recipes; keeps each tile "
                                                   "shape's activations in GPU memory (off: only a compact "
                                                   "net does, within a 32nd of the GPU's memory)"}),
        }}

    def patch(self, upscale_model, recipes=True, cuda_graphs=False):
        out, report = patched_upscale_model(upscale_model, bool(recipes), bool(cuda_graphs))
        log.info("Conv Patch Upscale Model: %d convolutions patched, %d skipped, %d blocks fused",
                 len(report.patched), len(report.skipped), len(report.fused))
        for fqn, why in report.skipped.items():
            log.info("  skipped %s: %s", fqn, why)
        return (out,)


NODE_CLASS_MAPPINGS = {"ConvPatchVAE": ConvPatchVAE, "ConvPatchUpscaleModel": ConvPatchUpscaleModel}
NODE_DISPLAY_NAME_MAPPINGS = {"ConvPatchVAE": "Conv Patch VAE", "ConvPatchUpscaleModel": "Conv Patch Upscale Model"}
