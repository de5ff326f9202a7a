"""conv-patch: fast convolutions for diffusion VAEs, one line to apply.

    import conv_patch
    report = conv_patch.apply(pipe.vae)   # swap eligible Conv2d / ConvTranspose2d / Conv3d
    conv_patch.last_route(pipe.vae.decoder.conv_in)   # what a conv's last call ran, and why
    conv_patch.warmup(pipe.vae.decode, latents)       # compile ahead: first calls at this input, now
    conv_patch.last_pass(pipe.vae.decoder)            # what compiling ahead did at its first call, or why not
    conv_patch.remove(pipe.vae)           # original modules back

The layers below: api/ (apply and remove), runtime/ (what runs at a
patched call), routing/ (which route it takes), ops/ (what a route runs),
the Triton kernels (conv_patch.kernels), the block recipes
(conv_patch.recipes), parallel/ (bands), integrations/ (ComfyUI), tools/
(the convpatch command); docs/design.md draws them.

Importing this package does not import Triton; the kernels load on the first
call that runs them.
"""

__version__ = "0.1.0"

import os as _os

# kernels/, recipes/ and configs/ are sub-packages of this one, without
# __init__.py (conv_patch/checkout.py says why). An installed wheel has them
# inside this folder; a checkout (editable installs included) has them
# beside it, so there its parent is searched too. A namespace portion never
# wins over an installed package of the same name.
if not _os.path.isdir(_os.path.join(__path__[0], "kernels")):
    __path__.append(_os.path.dirname(__path__[0]))
del _os


try:
    import torch as _torch  # noqa: F401  (every module below needs it)
except ModuleNotFoundError as _e:
    if _e.name != "torch":
        raise
    # torch is a declared dependency, so only a broken install (--no-deps, an
    # uninstalled torch) lands here. The package still imports, so that the
    # convpatch command can say so in one line (exit 2) instead of a traceback
    # from deep inside; any use of it raises the same message.
    TORCH_MISSING = "PyTorch is not installed here: pip install torch (a CUDA build on a GPU machine)"

    def __getattr__(name):
        if name not in __all__:  # a submodule (conv_patch.tools.cli imports), a dunder probed by inspect/pickle
            raise AttributeError(name)
        raise ModuleNotFoundError(f"conv_patch.{name}: {TORCH_MISSING}", name="torch")
else:
    TORCH_MISSING = None
    from conv_patch import functional
    from conv_patch.api.patcher import PatchConfig, PatchReport, apply, is_patched, last_route, patched, remove
    from conv_patch.api.warmup import last_pass, warmup
    del _torch

__all__ = [
    "apply", "remove", "patched", "is_patched", "last_route", "warmup", "last_pass", "PatchConfig",
    "PatchReport", "functional", "__version__",
]
