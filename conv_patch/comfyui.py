"""The ComfyUI node "Conv Patch VAE".

ComfyUI loads this through ``examples/comfyui/__init__.py`` (copy or symlink
that folder into ``ComfyUI/custom_nodes/``). Nothing here imports ComfyUI:
its VAE object is used only through ``vae.first_stage_model`` (the ldm
``AutoencoderKL``, the ``AutoencodingEngine`` of SD3/FLUX, or a TAESD module)
and ``vae.vae_dtype``; its conv classes are recognised by structure (see
``conv_patch.wrappers.is_comfy_conv_class``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .patcher import apply

log = logging.getLogger("conv_patch")

DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ConvPatchVAE:
    """Patch a VAE's convolutions with conv-patch, in place, and pass it on.
    Idempotent: a VAE that went through the node before is left as it is."""

    CATEGORY = "conv-patch"
    FUNCTION = "patch"
    RETURN_TYPES = ("VAE",)
    RETURN_NAMES = ("vae",)
    DESCRIPTION = ("Runs the VAE's convolutions on conv-patch's Triton kernels (fused bias/residual/"
                   "activation epilogues, Hopper TMA kernels on sm90). Anything the kernels cannot take, "
                   "and any conv ComfyUI is casting or patching (low-VRAM, LoRA), runs the original code.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "vae": ("VAE",),
            "dtype": (list(DTYPES), {"default": "keep",
                                     "tooltip": "cast the VAE first (keep: as loaded)"}),
            "recipes": ("BOOLEAN", {"default": True,
                                    "tooltip": "fuse GroupNorm/SiLU, upsampling and residuals around the "
                                               "convolutions of the VAE's blocks (off: convolutions only)"}),
        }}

    def patch(self, vae, dtype="keep", recipes=True):
        model = getattr(vae, "first_stage_model", None)
        if not isinstance(model, nn.Module):
            raise ValueError(f"Conv Patch VAE: expected a ComfyUI VAE with a first_stage_model module, "
                             f"got {type(vae).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"Conv Patch VAE: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if DTYPES[dtype] is not None:
            model.to(DTYPES[dtype])
            if hasattr(vae, "vae_dtype"):
                vae.vae_dtype = DTYPES[dtype]
        if not recipes:
            # Blocks fused by an earlier run of the node get their own forward back.
            from conv_patch import recipes as rc
            for m in model.modules():
                rc.unfuse(m)
        report = apply(model, recipes=bool(recipes))
        log.info("Conv Patch VAE: %d convolutions patched, %d skipped, %d already patched, %d blocks fused",
                 len(report.patched), len(report.skipped), len(report.already_patched), len(report.fused))
        for fqn, why in report.skipped.items():
            log.info("  skipped %s: %s", fqn, why)
        return (vae,)


NODE_CLASS_MAPPINGS = {"ConvPatchVAE": ConvPatchVAE}
NODE_DISPLAY_NAME_MAPPINGS = {"ConvPatchVAE": "Conv Patch VAE"}
