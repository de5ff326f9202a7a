"""Weight pack: [C_out, C_in, KH, KW] (any strides) -> dense (co, kh, kw, ci).

Each output channel's row is a [C_in, KH*KW] -> [KH*KW, C_in] transpose; a
program moves one row block with both sides read and written in runs, where
PyTorch's generic strided copy reads the source at stride KH*KW.
"""

import triton
import triton.language as tl


@triton.jit
def pack_weight_kernel(src_ptr, dst_ptr, C_in, KW, TAPS, s_co, s_ci, s_kh, s_kw,
                       BLOCK_CI: tl.constexpr, BLOCK_T: tl.constexpr):
    co = tl.program_id(0).to(tl.int64)
    ci = tl.program_id(1) * BLOCK_CI + tl.arange(0, BLOCK_CI)
    t = tl.arange(0, BLOCK_T)
    mask = (ci < C_in)[:, None] & (t < TAPS)[None, :]
    kh = t // KW
    kw = t - kh * KW
    src = src_ptr + co * s_co + ci[:, None] * s_ci + (kh * s_kh + kw * s_kw)[None, :]
    vals = tl.load(src, mask=mask)
    dst = dst_ptr + co * TAPS * C_in + t[None, :] * C_in + ci[:, None]
    tl.store(dst, vals, mask=mask)


def launch_pack_weight(src, dst):
    """``src`` [C_out, C_in, KH, KW] any strides; ``dst`` same shape stored
    channels_last (co, kh, kw, ci)."""
    c_out, c_in, kh, kw = src.shape
    taps = kh * kw
    block_t = triton.next_power_of_2(taps)
    block_ci = max(16, min(triton.next_power_of_2(c_in), 4096 // block_t))
    pack_weight_kernel[(c_out, triton.cdiv(c_in, block_ci))](
        src, dst, c_in, kw, taps, *src.stride(), BLOCK_CI=block_ci, BLOCK_T=block_t, num_warps=4)
    return dst
