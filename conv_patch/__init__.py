"""conv-patch: fast convolutions for diffusion VAEs, one line to apply.

    import conv_patch
    report = conv_patch.apply(pipe.vae)   # swap eligible Conv2d / ConvTranspose2d
    conv_patch.remove(pipe.vae)           # original modules back

Importing this package does not import Triton; the kernels load on the first
call that runs them.
"""

from . import ops, pack, recipes
from .patcher import PatchConfig, PatchReport, apply, is_patched, patched, remove
from .routing import ROUTE_INFO, Route, RouteDecision, select_route, static_route
from .specs import CallDesc, ConvSpec
from .wrappers import PatchedConv2d, PatchedConvTranspose2d

__version__ = "0.1.0"

__all__ = [
    "apply", "remove", "patched", "is_patched", "PatchConfig", "PatchReport",
    "Route", "RouteDecision", "ROUTE_INFO", "select_route", "static_route",
    "ConvSpec", "CallDesc", "PatchedConv2d", "PatchedConvTranspose2d", "ops", "pack", "recipes",
    "__version__",
]
