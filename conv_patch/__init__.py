"""conv-patch: fast convolutions for diffusion VAEs, one line to apply.

    import conv_patch
    report = conv_patch.apply(pipe.vae)   # swap eligible Conv2d / ConvTranspose2d
    conv_patch.remove(pipe.vae)           # original modules back

Importing this package does not import Triton; the kernels load on the first
call that runs them.
"""

__version__ = "0.1.0"

import os as _os

# kernels/, recipes/ and configs/ are sub-packages of this one (pyproject.toml
# installs them as conv_patch.kernels, .recipes and .configs). They hold no
# __init__.py: Python running from a checkout's root (pytest, ``python -c``,
# a notebook) has the root on sys.path, and there a folder with one would be
# a top-level package of that name, hiding an installed one (Hugging Face's
# ``kernels``, which transformers imports). Without one a folder is at most a
# namespace portion, which never wins over an installed package. An
# installed wheel has them inside this folder; a checkout (editable installs
# included) has them beside it, so there its parent is searched too.
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
    from conv_patch.api.patcher import PatchConfig, PatchReport, apply, is_patched, patched, remove
    from conv_patch.routing.select import ROUTE_INFO, Route, RouteDecision, select_route, static_route
    from conv_patch.specs import CallDesc, ConvSpec
    from conv_patch.runtime.wrappers import PatchedConv2d, PatchedConvTranspose2d
    del _torch

__all__ = [
    "apply", "remove", "patched", "is_patched", "PatchConfig", "PatchReport",
    "Route", "RouteDecision", "ROUTE_INFO", "select_route", "static_route",
    "ConvSpec", "CallDesc", "PatchedConv2d", "PatchedConvTranspose2d", "functional",
    "__version__",
]
