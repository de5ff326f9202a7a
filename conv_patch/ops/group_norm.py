"""GroupNorm as a torch-facing op: ``group_norm`` (fp32 statistics, the
activation and a folded conv bias in one pass of conv-patch's kernels where
they take the call, PyTorch otherwise) and the rule of which calls they take
(``group_norm_target``). ``conv_patch.runtime.dispatch`` plans GroupNorm modules'
calls on top of these; ``conv_patch.functional`` re-exports them."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.ops.conv2d import nhwc
from conv_patch.ops.loader import kernels
from conv_patch.activations import activation_code, eager_epilogue
from conv_patch.specs import KERNEL_DTYPES, needs_grad
from conv_patch.target import Target, target_for


# Launch sizes of the GroupNorm kernels (apply block, stats block, stats
# programs). Memory-bound and simple, so fixed: on a GPU 2048-element apply
# blocks, 4096-element stats blocks and ~1024 stats programs (8 per SM on an
# H200; swept over the FLUX decoder's GroupNorm inputs: 4096 x 1024 read them
# in 0.38 ms against 0.54 with 2048 x 1024 and 0.53 with 8192 x 1024); under
# the interpreter, where each program costs Python time, as few and as large
# as possible.
GN_LAUNCH = {"gpu": (2048, 4096, 1024), "interpreter": (1 << 16, 1 << 16, 1)}


def as_4d(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A dense 5-D [N, C, T, H, W] tensor as the [N, C, T*H, W] view of the
    same memory, in the matching 4-D layout (NCDHW as NCHW, NDHWC as NHWC),
    else None. A GroupNorm's groups span every axis after C, so the norm of
    the view is the norm of the tensor: video VAEs' GroupNorms run the 4-D
    kernels."""
    if x is None or x.dim() != 5:
        return None
    n, c, t, h, w = x.shape
    if x.is_contiguous():
        return x.view(n, c, t * h, w)
    if x.is_contiguous(memory_format=torch.channels_last_3d):
        return x.permute(0, 2, 3, 4, 1).view(n, t * h, w, c).permute(0, 3, 1, 2)
    return None


def from_4d(y: torch.Tensor, shape) -> torch.Tensor:
    """``as_4d``'s inverse: [N, C, T*H, W] ``y`` (NCHW or NHWC) as the 5-D
    view ``shape`` of it (NCDHW or NDHWC)."""
    n, c, t, h, w = shape
    if y.is_contiguous():
        return y.view(shape)
    return y.permute(0, 2, 3, 1).view(n, t, h, w, c).permute(0, 4, 1, 2, 3)


def group_norm_target(x, num_groups, weight, bias) -> Optional[Target]:
    """The target whose GroupNorm kernels take this call, or None."""
    if x.dim() not in (4, 5) or x.shape[1] % num_groups:
        raise ValueError(f"group_norm: expected [N, C, H, W] or [N, C, T, H, W] with C divisible by "
                         f"{num_groups} groups, got {tuple(x.shape)}")
    # Under torch.compile the eager expression is traced (Inductor fuses it).
    if torch.compiler.is_compiling():
        return None
    target = target_for(x.device)
    # A 5-D input of any layout is taken (``group_norm`` makes a strided one
    # contiguous, the copy PyTorch's GroupNorm makes too); a 4-D one dense.
    ok = (target.kernels and x.dtype in KERNEL_DTYPES
          and (x.dim() == 5 or x.is_contiguous() or nhwc(x)) and x.numel() > 0 and not needs_grad(x, weight, bias)
          and all(t is None or (t.device == x.device and t.dim() == 1 and t.is_contiguous())
                  for t in (weight, bias)))
    return target if ok else None


def launch_sizes(target: Target) -> tuple:
    """(block, stats block, programs) of the GroupNorm launch on ``target``."""
    return GN_LAUNCH["interpreter" if target.interpreter else "gpu"]


def modulated(y: torch.Tensor, modulation: Optional[tuple]) -> torch.Tensor:
    """``y * m + a`` for ``modulation`` (m, a), else ``y``: a normalised
    value's spatial modulation as PyTorch ops."""
    return y if modulation is None else y * modulation[0] + modulation[1]


def torch_group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, activation="none", input_bias=None,
                     modulation=None) -> torch.Tensor:
    """The op's eager expression: ``act(F.group_norm(x + input_bias) * m + a)``."""
    if input_bias is not None:
        x = x + input_bias.to(x.dtype).view(-1, *([1] * (x.dim() - 2)))
    return eager_epilogue(modulated(F.group_norm(x, num_groups, weight, bias, eps), modulation), None, 1.0,
                          activation, 1.0)


def group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5,
               activation: str = "none", out: Optional[torch.Tensor] = None,
               input_bias: Optional[torch.Tensor] = None, modulation: Optional[tuple] = None) -> torch.Tensor:
    """``act(F.group_norm(x + input_bias, num_groups, weight, bias, eps))``
    with fp32 statistics, output in ``x``'s dtype and memory format (into
    ``out`` when given, which may be ``x`` itself: normalised in place).
    ``input_bias`` ([C], per channel) is a conv bias the conv that made
    ``x`` left out: the norm folds it into its statistics and its affine, so
    a conv without a fused epilogue (the cuDNN route) needs no bias pass.
    Dense NCHW or NHWC 4-D inputs run the Triton kernels (on a GPU, or the
    CPU under the interpreter), and 5-D ones as the 4-D view (``as_4d``) of
    themselves (NCDHW, NDHWC) or of their contiguous copy; anything else
    runs PyTorch. ``modulation`` (m, a), tensors of ``x``'s shape: the
    normalised value times ``m`` plus ``a`` before the activation, in the
    same pass where they are dense in ``x``'s layout (CogVideoX's spatial
    norm)."""
    code = activation_code(activation)
    if x.dim() == 5:
        x4, out4 = as_4d(x), as_4d(out)
        mod = None if modulation is None else tuple(as_4d(t) for t in modulation)
        if (group_norm_target(x, num_groups, weight, bias) is None or (out is not None and out4 is None)
                or (mod is not None and (None in mod or x4 is None))):
            y = torch_group_norm(x, num_groups, weight, bias, eps, activation, input_bias, modulation)
            return y if out is None else out.copy_(y)
        if x4 is None:
            # (A strided input, such as a [N, T, C, H, W] tensor permuted
            # back, normalised from a contiguous copy into a contiguous
            # output, as PyTorch's GroupNorm does.)
            x4 = as_4d(x.contiguous(memory_format=torch.contiguous_format if out is None or out.is_contiguous()
                                    else torch.channels_last_3d))
        y = group_norm(x4, num_groups, weight, bias, eps, activation, out4, input_bias, mod)
        return out if out is not None else from_4d(y, x.shape)
    is_nhwc = nhwc(x)
    fmt = torch.channels_last if is_nhwc else torch.contiguous_format
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous(memory_format=fmt)):
        raise ValueError(f"group_norm: out must match the input's shape {tuple(x.shape)}, dtype and layout")
    if input_bias is not None and tuple(input_bias.shape) != (x.shape[1],):
        raise ValueError(f"group_norm: input_bias must be [{x.shape[1]}], got {tuple(input_bias.shape)}")
    target = group_norm_target(x, num_groups, weight, bias)
    if modulation is not None and not all(t.shape == x.shape and t.device == x.device
                                          and t.is_contiguous(memory_format=fmt) for t in modulation):
        target = None
    if input_bias is not None and not (target is not None and is_nhwc and input_bias.is_contiguous()
                                       and input_bias.device == x.device):
        # Only the NHWC statistics kernel takes the bias; elsewhere it is added first.
        x, input_bias = x + input_bias.to(x.dtype).view(-1, 1, 1), None
    if target is None:
        y = torch_group_norm(x, num_groups, weight, bias, eps, activation, input_bias, modulation)
        return y if out is None else out.copy_(y)
    k = kernels()
    if out is None:
        out = k.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    block, stats_block, programs = launch_sizes(target)
    k.launch_group_norm(x, out, num_groups, weight, bias, float(eps), code, is_nhwc, block,
                              stats_block, programs, input_bias=input_bias, modulation=modulation)
    return out


def output_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format of ``group_norm``'s output on ``x`` (no ``out``):
    NHWC for an NHWC 4-D input, NDHWC for an NDHWC 5-D one (the kernels
    write in the input's layout), else contiguous (a strided 5-D input is
    normalised from a contiguous copy, as PyTorch's GroupNorm does)."""
    if x.dim() == 5:
        return (torch.channels_last_3d if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d)
                else torch.contiguous_format)
    return torch.channels_last if nhwc(x) else torch.contiguous_format
