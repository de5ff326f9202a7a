"""Triton kernels of conv-patch, installed as ``conv_patch.kernels``.

Importing this package imports Triton and decorates the kernels; whether they
run through the interpreter is fixed here, from ``TRITON_INTERPRET``, exactly as
Triton itself decides it at decoration time.
"""

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

from .conv2d import conv2d_fwd_kernel, launch_conv2d  # noqa: E402
from .conv_transpose2d import conv_transpose2d_fwd_kernel, launch_conv_transpose2d  # noqa: E402

KERNELS = {
    "conv2d": conv2d_fwd_kernel,
    "conv_transpose2d": conv_transpose2d_fwd_kernel,
}

__all__ = ["INTERPRET", "KERNELS", "launch_conv2d", "launch_conv_transpose2d"]
