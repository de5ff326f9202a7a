"""RMS norm over channels (+ activation) in one pass, the norm of the Wan-family
video VAEs: ``act(x / max(||x||_C, eps) * scale * gamma + bias)`` at every
position, ``||x||_C`` the L2 norm over the channel axis; and diffusers'
``RMSNorm`` over channels (LTX-Video's VAE): ``x * rsqrt(mean_C(x^2) + eps)``.

Why: PyTorch computes it (``F.normalize`` on an fp32 copy, back to the
input's dtype, times ``scale``, times ``gamma``, plus ``bias``, then the SiLU)
as about ten elementwise passes over the activation; in a Wan 2.1 decode on
an H200 those passes take ~0.4 of its 1.7 s. Here each position's channels
are read twice (their sum of squares, then normalised: the second read of a
program's slab is recent enough to come from L2) and written once.

Layer 1: ``rms_norm_kernel`` over a [N, C, S] view addressed by runtime
strides (NCDHW / NCHW: the positions contiguous; NDHWC / NHWC: the
channels), one program per (sample, block of positions), looping over the
channels in blocks; where one block holds every channel (``ONE_PASS``: up
to a few hundred channels, in either layout) the slab is read once and
normalised from registers. Layer 2: ``launch_rms_norm``.

Numerics: fp32 sum of squares and arithmetic; the result is rounded once to
the output's dtype (PyTorch rounds the normalised value before the affine).
"""

import triton
import triton.language as tl

from .common import activate
from .launch import cdiv, launch, needs_int64


@triton.jit
def store_normalised(x, inv, ok, c_ok, offs_c, y_row, syc, w_ptr, b_ptr, HAS_WEIGHT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """y = act(x * inv * gamma + bias) of a [channels, positions] block
    (gamma 1 without ``HAS_WEIGHT``)."""
    y = x * inv[None, :]
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    # Padding lanes are zeroed before the activation (exp of garbage).
    y = activate(tl.where(ok, y, 0.0), ACT)
    tl.store(y_row + offs_c[:, None] * syc, y.to(y_row.dtype.element_ty), mask=ok)


@triton.jit
def inverse_norm(ss, scale, eps, EPS_ADDED: tl.constexpr):
    """What a position's channels are multiplied by, from their sum of
    squares ``ss``: F.normalize's ``scale / max(||x||, eps)``, or, where
    ``EPS_ADDED``, ``scale / sqrt(ss + eps)`` (the launcher passes
    ``C * eps`` and ``sqrt(C) * scale`` for ``x * rsqrt(mean(x^2) + eps)``,
    diffusers' RMSNorm)."""
    if EPS_ADDED:
        inv = scale / tl.sqrt(ss + eps)
    else:
        inv = scale / tl.maximum(tl.sqrt(ss), eps)
    return inv


@triton.jit
def rms_norm_kernel(x_ptr, y_ptr, w_ptr, b_ptr, C, S, TILES, sxn, sxc, sxs, syn, syc, sys_, eps, scale,
                    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, IDX64: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, ONE_PASS: tl.constexpr,
                    EPS_ADDED: tl.constexpr):
    pid = tl.program_id(0)
    n = pid // TILES
    offs_s = (pid - n * TILES) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = offs_s < S
    if IDX64:
        n = n.to(tl.int64)
        offs_s = offs_s.to(tl.int64)
    x_row = x_ptr + n * sxn + offs_s[None, :] * sxs
    y_row = y_ptr + n * syn + offs_s[None, :] * sys_
    if ONE_PASS:
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        ok = c_ok[:, None] & s_ok[None, :]
        x = tl.load(x_row + offs_c[:, None] * sxc, mask=ok, other=0.0).to(tl.float32)
        inv = inverse_norm(tl.sum(x * x, axis=0), scale, eps, EPS_ADDED)
        store_normalised(x, inv, ok, c_ok, offs_c, y_row, syc, w_ptr, b_ptr, HAS_WEIGHT, HAS_BIAS, ACT)
        return
    ss = tl.zeros([BLOCK_S], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ok = (offs_c < C)[:, None] & s_ok[None, :]
        x = tl.load(x_row + offs_c[:, None] * sxc, mask=ok, other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=0)
    inv = inverse_norm(ss, scale, eps, EPS_ADDED)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        ok = c_ok[:, None] & s_ok[None, :]
        x = tl.load(x_row + offs_c[:, None] * sxc, mask=ok, other=0.0).to(tl.float32)
        store_normalised(x, inv, ok, c_ok, offs_c, y_row, syc, w_ptr, b_ptr, HAS_WEIGHT, HAS_BIAS, ACT)


def launch_rms_norm(x, out, weight, bias, scale, eps, activation, block_c, block_s, num_warps=4,
                    eps_added=False):
    """``out = act(x / max(||x||_C, eps) * scale * weight + bias)`` (with
    ``eps_added``: ``act(x * rsqrt(mean_C(x^2) + eps) * scale * weight +
    bias)``) for [N, C, S] views ``x`` and ``out`` (any strides; ``out`` may
    be ``x``: a program writes only the positions it has read in full),
    ``weight`` and ``bias`` (each or None) dense [C]; one pass where
    ``block_c`` covers C. Returns ``out``."""
    N, C, S = x.shape
    tiles = cdiv(S, block_s)
    if eps_added:
        scale, eps = scale * C ** 0.5, eps * C
    # (A missing weight or bias is never read: x stands in for its pointer,
    # so that a recorded plan's launches name no tensor of their own.)
    w = x if weight is None else weight
    launch(rms_norm_kernel, (N * tiles,), x, out, w, w if bias is None else bias, C, S, tiles,
           *x.stride(), *out.stride(), float(eps), float(scale),
           HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACT=int(activation), IDX64=needs_int64(x, out),
           BLOCK_C=block_c, BLOCK_S=block_s, ONE_PASS=block_c >= C, EPS_ADDED=bool(eps_added),
           num_warps=num_warps)
    return out
