"""Triton helpers shared by every convolution kernel: tile order, the tap
accumulation of the implicit GEMM, activations and the one epilogue.

Index conventions used throughout:
  * a GEMM row ``m`` is one output pixel ``(n, oh, ow)``; a column is one output
    channel; the reduction runs over ``(kh, kw, c_in)`` taps, tap-outer, so one
    tap's channel block is a plain strided slab of the input in either layout.
  * every tensor is addressed through runtime strides, so NCHW, NHWC and any
    other strided view are read and written in place, without a layout copy.
  * ``IDX64`` switches offset arithmetic to int64; the launcher sets it when an
    address span of a tensor reaches 2**31 elements.
"""

import os

import triton
import triton.language as tl

from conv_patch.activations import CODES, LEAKY_BASE, LEAKY_STEPS, PRELU_CODE
from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)

# Whether the kernels run through the Triton interpreter: read from
# TRITON_INTERPRET when this module is imported, right before its first
# decoration, which is when Triton decides it (every kernel module imports
# this one first).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Triton compiles a kernel once per specialisation of its integer arguments
# (whether each is 1, whether it divides by 16): left as they are, a batch of
# 2 after a batch of 1, or a 104-row latent after a 128-row one, compiles
# every kernel of the call again, seconds each with a cold cache. The
# kernels name the extents that move with a call's batch and resolution in
# ``do_not_specialize`` where nothing needs their divisibility, so a new
# batch or resolution launches what is compiled:
# * the TMA kernels (and the padded route's staging copy): boxes bound their
#   loads, and their pointer epilogue stores along the channels, whose counts
#   and strides stay specialised;
# * the pointer kernels, the batch only: their loads along a pixel row are
#   vectorised by the rows' divisibility, which the batch does not change.
BATCH_EXTENTS = ("N",)
TMA_2D_EXTENTS = ("N", "H", "W", "OH", "OW")
TMA_PADDED_EXTENTS = ("N", "HP", "WP", "OH", "OW")
TMA_3D_EXTENTS = ("N", "T", "H", "W", "Tc", "OD", "OH", "OW")
PAD_EXTENTS = ("H", "W", "HP", "WP")
# * the im2col route's column matrix: stored along its pixels, masked.
IM2COL_EXTENTS = ("L", "P8", "H", "W", "OW")
# * attention: its rows and columns are a VAE mid-block's pixels (TMA boxes,
#   and stores along the head's channels).
ATTENTION_EXTENTS = ("R", "M", "T", "split_steps")
# * GroupNorm on NHWC: loads along the channels; the partials' merge reads
#   strided triples. (The NCHW passes read along the pixels: specialised.)
GROUP_NORM_NHWC_EXTENTS = ("HW", "CHUNK", "SPLITS", "TILES")
GROUP_NORM_FINALIZE_EXTENTS = ("S", "psn", "pss", "psc")
# * the channels-last depthwise and grouped 1x1 kernels: loads along the
#   channels, a mask per pixel row.
DEPTHWISE_EXTENTS = ("H", "W", "OH", "OW", "P_TILES")
GROUPED_POINTWISE_EXTENTS = ("M",)
# * the epilogue pass after cuDNN: channels-last outputs only
#   (ops.epilogue), stored along the channels.
EPILOGUE_EXTENTS = ("HW", "W", "TILES")

# Activation codes: conv_patch/activations.py's table, which the eager fallback reads too.
ACT_RELU = tl.constexpr(CODES["relu"])
ACT_SILU = tl.constexpr(CODES["silu"])
ACT_GELU = tl.constexpr(CODES["gelu"])
ACT_GELU_TANH = tl.constexpr(CODES["gelu_tanh"])
# PReLU: the slopes are read with the bias (epilogue_values), never by activate.
ACT_PRELU = tl.constexpr(PRELU_CODE)
# LeakyReLU: the code is ACT_LEAKY + the negative slope in thousandths.
ACT_LEAKY = tl.constexpr(LEAKY_BASE)
LEAKY_STEPS_F = tl.constexpr(float(LEAKY_STEPS))


@triton.jit
def wide(x, IDX64: tl.constexpr):
    """``x`` as int64 where IDX64 (offsets past 2**31 elements), else as it is."""
    if IDX64:
        return x.to(tl.int64)
    else:
        return x


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Walk output tiles GROUP_M rows at a time so that neighbouring programs
    share input rows and weight columns in L2."""
    per_group = GROUP_M * num_pid_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def output_tile(N, OH, OW, C_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                IDX64: tl.constexpr):
    """This program's tile of the implicit GEMM over all N*OH*OW output
    pixels (rows may span images): (row_ok, n, oh, ow) per row, (offs_n,
    n_ok) per column; ``n`` is int64 under IDX64."""
    M = N * OH * OW
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(C_out, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ow = offs_m % OW
    t = offs_m // OW
    return offs_m < M, wide(t // OH, IDX64), t % OH, ow, offs_n, offs_n < C_out


@triton.jit
def round_to_tf32(x):
    """Round fp32 to the nearest TF32 value (ties away from zero). The tensor
    cores read only the top 19 bits of an fp32 operand, i.e. they truncate;
    truncation is biased, and over a VAE's 40 convs it left the fp32 decode
    5x further from exact than cuDNN's TF32 (measured on an H200)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x1000) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b as the portable kernels compute it."""
    if UPCAST:
        # The interpreter's tl.dot is wrong on bf16 operands (Triton
        # 3.4-3.9); on hardware this branch is compiled out.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if PRECISION == "tf32":
        a = round_to_tf32(a)
        b = round_to_tf32(b)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def accumulate_tap(acc, x_ptr, w_ptr, x_row, row_ok, ih, iw, H, W, C_in,
                   sxc, sxh, sxw, w_tap, swi, w_col, n_ok,
                   IDX64: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += x[rows, :, ih, iw] @ w[tap, :, cols] over all input channels.

    Rows whose (ih, iw) fall outside the input read zeros: that is the zero
    padding, applied by the mask instead of a padded copy.
    """
    ok = row_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    offs_k = tl.arange(0, BLOCK_K)
    if IDX64:
        a_ptrs = x_ptr + (x_row + ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw)[:, None] \
            + offs_k.to(tl.int64)[None, :] * sxc
        a_step = tl.cast(sxc, tl.int64) * BLOCK_K
    else:
        a_ptrs = x_ptr + (x_row + ih * sxh + iw * sxw)[:, None] + offs_k[None, :] * sxc
        a_step = sxc * BLOCK_K
    b_ptrs = w_ptr + w_tap + offs_k[:, None] * swi + w_col[None, :]
    # The loop body is kept to the loads and the dot: pointers advance instead
    # of being recomputed, which also keeps the interpreter (CI) fast.
    for c0 in range(0, C_in, BLOCK_K):
        k_ok = offs_k < C_in - c0
        a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST, PRECISION)
        a_ptrs += a_step
        b_ptrs += BLOCK_K * swi
    return acc


@triton.jit
def activate(x, ACT: tl.constexpr):
    tl.static_assert(ACT != ACT_PRELU, "PReLU's slopes are read in epilogue_values")
    if ACT == ACT_RELU:
        x = tl.maximum(x, 0.0)
    elif ACT == ACT_SILU:
        # x * sigmoid(x); exp overflow to inf gives the right limit (-0).
        x = x / (1.0 + tl.exp(-x))
    elif ACT == ACT_GELU:
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == ACT_GELU_TANH:
        # tanh(z) = 2*sigmoid(2z) - 1: core Triton has no portable tanh
        # (libdevice differs between CUDA and ROCm), and this form saturates
        # cleanly at both ends.
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0
        x = 0.5 * x * (1.0 + t)
    elif ACT >= ACT_LEAKY:
        x = tl.where(x >= 0.0, x, x * ((ACT - ACT_LEAKY) / LEAKY_STEPS_F))
    return x


@triton.jit
def epilogue_values(acc, r, offs_n, n_ok, bias_ptr, beta, out_scale, HAS_BIAS: tl.constexpr,
                    HAS_RES: tl.constexpr, ACT: tl.constexpr):
    """``out_scale * act(acc + bias + beta * r)`` in fp32, ``r`` the
    residual tile (read under HAS_RES only). The fusion semantics of every
    kernel, whichever way its tile is then stored. Under PReLU ``bias_ptr``
    is the [C, 2] (bias, slope) buffer (``ChannelSlopes.params``: fp32, or
    the bias's and the slopes' own dtype)."""
    if ACT == ACT_PRELU:
        b = tl.load(bias_ptr + 2 * offs_n, mask=n_ok, other=0.0).to(tl.float32)
        slope = tl.load(bias_ptr + 2 * offs_n + 1, mask=n_ok, other=0.0).to(tl.float32)
        acc += b[None, :]
        if HAS_RES:
            acc += beta * r
        acc = tl.where(acc >= 0.0, acc, acc * slope[None, :])
    else:
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            acc += b[None, :]
        if HAS_RES:
            acc += beta * r
        acc = activate(acc, ACT)
    return acc * out_scale


@triton.jit
def epilogue_store(acc, n, oh, ow, row_ok, offs_n, n_ok,
                   out_ptr, son, soc, soh, sow, bias_ptr, res_ptr, srn, src, srh, srw,
                   beta, out_scale, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                   ACT: tl.constexpr, IDX64: tl.constexpr):
    """out[n, :, oh, ow] = out_scale * act(acc + bias + beta * residual), in
    fp32, cast once at the store. Every kernel ends here (or, storing by
    TMA, in ``epilogue_values``), so the fusion semantics cannot drift
    between them. ``n`` is already int64 under IDX64."""
    mask = row_ok[:, None] & n_ok[None, :]
    oh = wide(oh, IDX64)
    ow = wide(ow, IDX64)
    col = wide(offs_n, IDX64)
    r = acc
    if HAS_RES:
        res_row = n * srn + oh * srh + ow * srw
        r = tl.load(res_ptr + res_row[:, None] + col[None, :] * src,
                    mask=mask, other=0.0).to(tl.float32)
    acc = epilogue_values(acc, r, offs_n, n_ok, bias_ptr, beta, out_scale, HAS_BIAS, HAS_RES, ACT)
    out_row = n * son + oh * soh + ow * sow
    tl.store(out_ptr + out_row[:, None] + col[None, :] * soc,
             acc.to(out_ptr.dtype.element_ty), mask=mask)
