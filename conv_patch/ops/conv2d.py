"""The convolution op's torch-facing layer: output shape and allocation,
the launch of a routed kernel (``run_kernel``), the cuDNN route with its
fused epilogue pass (``cudnn_conv2d``, ``epilogue``), and the NHWC staging
copy. Plans (conv_patch/dispatch/) call these once per signature and
replay what they launched."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.activations import activation_code, eager_epilogue
from conv_patch.routing.registry import Route, launcher
from conv_patch.routing.select import RouteDecision
from conv_patch.specs import ConvSpec, needs_grad, suggests_channels_last
from conv_patch.target import Target, dot_precision, target_for

def kernel_errors():
    """Errors that mean "this kernel cannot run on this machine", not "the
    answer would be wrong": compile failures and resource limits."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - Triton always has them today
        return ()
    return (CompilationError, OutOfResources)


_KERNELS = []


def kernels():
    """``conv_patch.kernels.api``, imported on the first launch only (it imports
    Triton); then held here, since an import statement on every launch is
    host time on the hot path."""
    if not _KERNELS:
        from conv_patch.kernels import api as k
        _KERNELS.append(k)
    return _KERNELS[0]


def check_residual(residual: Optional[torch.Tensor], out_shape: tuple) -> None:
    if residual is not None and tuple(residual.shape) != tuple(out_shape):
        raise ValueError(
            f"residual has shape {tuple(residual.shape)}, the convolution's output is {tuple(out_shape)}")


def output_shape(spec: ConvSpec, shape: tuple, output_padding=None) -> tuple:
    oh, ow = spec.output_hw(shape[-2], shape[-1], output_padding)
    return tuple(shape[:-3]) + (spec.out_channels, oh, ow)


def output_memory_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """The memory format of PyTorch's conv2d / conv_transpose2d output for
    ``x`` and ``weight`` (as the caller holds it: a transposed conv's
    [C_in, C_out, KH, KW]): channels_last where the input or the weight
    suggests it (cuDNN's ``cudnn_conv_suggest_memory_format``, mkldnn's and
    the CPU's own rule alike; float64, which the kernels never take, aside).
    A 3-D input is batched as PyTorch batches it, by ``unsqueeze(0)``."""
    shape, stride = tuple(x.shape), x.stride()
    if len(shape) == 3:
        shape, stride = (1,) + shape, (shape[0] * stride[0],) + stride
    if suggests_channels_last(shape, stride) or suggests_channels_last(tuple(weight.shape), weight.stride()):
        return torch.channels_last
    return torch.contiguous_format


def run_kernel(decision: RouteDecision, target: Target, spec: ConvSpec, x: torch.Tensor,
               w: torch.Tensor, bias: Optional[torch.Tensor], *, residual=None, beta=1.0,
               activation: str = "none", out_scale=1.0, output_padding=None,
               out: Optional[torch.Tensor] = None, force_int64: bool = False,
               memory_format: Optional[torch.memory_format] = None) -> torch.Tensor:
    """Launch the routed kernel. ``w`` is the [C_out, C_in, KH, KW] view the
    kernels read (see conv_patch.runtime.pack); ``decision`` must be a kernel route.
    ``memory_format``: the output's where ``out`` is not given (PyTorch's,
    ``output_memory_format`` of the input and the caller's own weight; by
    default of ``w``)."""
    k = kernels()

    if out is None and memory_format is None:
        memory_format = output_memory_format(x, w)
    unbatched = x.dim() == 3
    if unbatched:
        x = x.unsqueeze(0)
        residual = residual.unsqueeze(0) if residual is not None else None
    shape = output_shape(spec, tuple(x.shape), output_padding)
    if out is None:
        out = k.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format)
    elif unbatched:
        out = out.unsqueeze(0)
    launch = launcher(k, decision.route)
    if decision.route is Route.CONV2D_TMA:
        if not w.is_contiguous(memory_format=torch.channels_last):
            # The functional API reads weights in place; the TMA descriptor
            # needs the co,kh,kw,ci pack the wrappers keep.
            w = w.contiguous(memory_format=torch.channels_last)
        if not nhwc(x) and not k.reads_nchw_in_place(x, w.shape, spec.pad_begin, spec.stride,
                                                             decision.config):
            # The NHWC staging copy (see kernels/conv2d_tma.py); ``out`` was
            # allocated above in the caller's layout and stays in it.
            x = to_nhwc(x)
    launch(x, w, bias, out, residual,
           stride=spec.stride, padding=spec.pad_begin, dilation=spec.dilation,
           beta=beta, activation=activation_code(activation), out_scale=out_scale,
           config=decision.config, precision=dot_precision(x.dtype, target),
           upcast=target.interpreter, force_int64=force_int64)
    return out.squeeze(0) if unbatched else out


def cudnn_conv2d(spec: ConvSpec, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *,
                 residual=None, beta=1.0, activation: str = "none", out_scale=1.0,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The CUDNN route: ``F.conv2d`` computes the convolution without its
    bias, and ``epilogue`` adds bias, residual, activation and scale in one
    pass (PyTorch's own bias add is a pass of its own, unvectorised on a
    channels_last output)."""
    if spec.pad_begin != spec.pad_end:
        (t, l), (b, r) = spec.pad_begin, spec.pad_end
        x, padding = F.pad(x, (l, r, t, b)), 0
    else:
        padding = spec.pad_begin
    y = F.conv2d(x, weight, None, spec.stride, padding, spec.dilation)
    check_residual(residual, y.shape)
    if bias is None and residual is None and activation == "none" and out_scale == 1.0:
        return y if out is None else out.copy_(y)
    return epilogue(y, bias, residual, beta, activation, out_scale, out=y if out is None else out)


# Elements per program of the epilogue pass: memory-bound, like the
# GroupNorm apply pass, so the same size; under the interpreter one program.
EPILOGUE_BLOCK = {"gpu": 4096, "interpreter": 1 << 16}


def _epilogue_target(y: torch.Tensor, bias=None, residual=None, out=None) -> Optional[Target]:
    """The target whose epilogue kernel takes a conv output shaped and laid
    out like ``y`` (dense NHWC, 4-D, on a device with kernels; inference),
    or None."""
    if torch.compiler.is_compiling() or y.dim() != 4 or needs_grad(y, bias, residual):
        return None
    target = target_for(y.device)
    if not (target.kernels and y.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (y.is_contiguous(memory_format=torch.channels_last) or y.shape[1] == 1)):
        return None
    ok = all(t is None or (t.device == y.device and t.dtype == y.dtype) for t in (bias, residual, out)) and (
        bias is None or (bias.dim() == 1 and bias.is_contiguous()))
    return target if ok else None


def epilogue(y: torch.Tensor, bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
             beta=1.0, activation: str = "none", out_scale=1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out_scale * act(y + bias + beta * residual)`` with ``bias`` per
    channel of [N, C, H, W] ``y``: one pass of the conv kernels' epilogue
    on dense NHWC outputs on a device with kernels, PyTorch ops otherwise.
    Into ``out`` when given (which may be ``y`` or ``residual``)."""
    code = activation_code(activation)
    check_residual(residual, y.shape)
    if out is not None and tuple(out.shape) != tuple(y.shape):
        raise ValueError(f"epilogue: out has shape {tuple(out.shape)}, expected {tuple(y.shape)}")
    target = _epilogue_target(y, bias, residual, out)
    if target is None:
        z = y
        if bias is not None:
            # [C, 1, 1]: the channel is dim -3 of a batched and of an unbatched output.
            b = bias.view(-1, 1, 1)
            z = y.add_(b) if out is y else y + b
        z = eager_epilogue(z, residual, beta, activation, out_scale)
        return z if out is None or z is out else out.copy_(z)
    k = kernels()
    if out is None:
        fmt = torch.channels_last if y.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
        out = k.empty(y.shape, dtype=y.dtype, device=y.device, memory_format=fmt)
    block = EPILOGUE_BLOCK["interpreter" if target.interpreter else "gpu"]
    return k.launch_epilogue(y, bias, residual, out, beta=beta, activation=code, out_scale=out_scale,
                                   block=block)


def to_nhwc(x: torch.Tensor) -> torch.Tensor:
    """A dense channels_last copy of a contiguous NCHW ``x`` (Triton kernel;
    see kernels/layout.py for why not PyTorch's own)."""
    k = kernels()
    if x.is_contiguous(memory_format=torch.channels_last):
        return x
    out = k.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    return k.launch_nchw_to_nhwc(x.contiguous(), out)


def nhwc(x: torch.Tensor) -> bool:
    """Dense channels_last and not also contiguous (an NHWC activation)."""
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


