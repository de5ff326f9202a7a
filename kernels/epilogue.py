"""The fused epilogue as a pass of its own, for convolutions cuDNN computes.

Why: where the sm90 table routes a shape to cuDNN (the 512-channel 3x3 convs
of a VAE decoder, measured faster there), PyTorch adds the bias in a kernel
of its own, and that broadcast over a channels_last output is not
vectorised: 18 of them took 0.97 ms of a 21 ms FLUX decode at 1024^2 on
the H200, a residual add after them another pass. Here bias, residual*beta,
activation and scale are one read of the conv's output (and the residual)
and one write, through ``epilogue_store``, the helper every conv kernel
ends in, so the cuDNN route computes exactly what the kernels' epilogue does.

Layer 1: ``epilogue_kernel``; layer 2: ``launch_epilogue``. Tiles are
[pixels, channels] of one sample; tensors are addressed through their
strides (the output may be a parity view of a larger one), the channel
stride being 1 in the NHWC tensors this is launched for.
"""

import triton
import triton.language as tl

from .common import EPILOGUE_EXTENTS, epilogue_store, wide
from .launch import cdiv, launch, needs_int64, next_pow2


@triton.jit(do_not_specialize=EPILOGUE_EXTENTS)
def epilogue_kernel(y_ptr, bias_ptr, res_ptr, out_ptr, C, HW, W, TILES,
                    syn, syc, syh, syw, srn, src, srh, srw, son, soc, soh, sow,
                    beta, out_scale, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                    IDX64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    n = pid // TILES
    m = (pid - n * TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < HW
    oh = m // W
    ow = m - oh * W
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < C
    n = wide(n, IDX64)
    rows = n * syn + wide(oh, IDX64) * syh + wide(ow, IDX64) * syw
    y = tl.load(y_ptr + rows[:, None] + wide(offs_n, IDX64)[None, :] * syc,
                mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    epilogue_store(y, n, oh, ow, row_ok, offs_n, n_ok, out_ptr, son, soc, soh, sow, bias_ptr, res_ptr,
                   srn, src, srh, srw, beta, out_scale, HAS_BIAS, HAS_RES, ACT, IDX64)


def launch_epilogue(y, bias, residual, out, *, beta, activation, out_scale, block):
    """``out = out_scale * act(y + bias + beta * residual)`` for [N, C, H, W]
    ``y``, ``residual`` and ``out`` of one shape (``out`` may be ``y`` or
    ``residual``: each element is read before it is written, by the same
    program); ``block`` elements per program."""
    N, C, H, W = y.shape
    block_n = min(next_pow2(C), 256)
    block_m = max(1, block // block_n)
    tiles = cdiv(H * W, block_m)
    res = residual if residual is not None else out
    launch(epilogue_kernel, (N * tiles, cdiv(C, block_n)),
        y, bias if bias is not None else out, res, out, C, H * W, W, tiles,
        *y.stride(), *res.stride(), *out.stride(), float(beta), float(out_scale),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=int(activation),
        IDX64=needs_int64(y, out, residual), BLOCK_M=block_m, BLOCK_N=block_n)
    return out
