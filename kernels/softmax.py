"""Row softmax of materialised attention scores (fp32 in, any float out).

Why: the VAE mid-block attention has one head of 512 channels, beyond the
head-dim limit (256) of FlashAttention and cuDNN attention, so PyTorch runs
its memory-efficient kernel at ~150 TF/s (3.6 ms at 1024^2, 67 ms at 2048^2
on the H200). ``conv_patch.functional.attention`` instead materialises the scores
of a block of query rows with cuBLAS (fp32 output) and normalises them here,
writing the probabilities in the dtype of the second GEMM.

Layer 1: ``softmax_rows_kernel``; layer 2: ``launch_softmax_rows``.

One program per row, two passes: the first keeps a running maximum and a
running sum rescaled to it (one exp per element), the second writes
``exp(x - max) / sum``. A row of a 16384-token image is 64 KiB, so the
second pass mostly reads what the first left in L2. ``scale`` is applied in
fp32 before the exponent, folded with log2(e) so that the kernel uses exp2.
"""

import triton
import triton.language as tl

from .common import INTERPRET  # noqa: F401  (fixed before this module's decorations)
from .launch import launch

LOG2E = 1.4426950408889634


@triton.jit
def softmax_rows_kernel(s_ptr, p_ptr, COLS, stride_s, stride_p, scale_log2, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = s_ptr + row * stride_s
    dst = p_ptr + row * stride_p
    # Scores of a real row are finite; the running maximum starts from the
    # first block so that no -inf - -inf is ever formed.
    idx = tl.arange(0, BLOCK)
    x = tl.load(src + idx, mask=idx < COLS, other=float("-inf")).to(tl.float32) * scale_log2
    m = tl.max(x, axis=0)
    total = tl.sum(tl.exp2(x - m), axis=0)
    for c0 in range(BLOCK, COLS, BLOCK):
        idx = c0 + tl.arange(0, BLOCK)
        x = tl.load(src + idx, mask=idx < COLS, other=float("-inf")).to(tl.float32) * scale_log2
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), axis=0)
        m = m_new
    inv = 1.0 / total
    for c0 in range(0, COLS, BLOCK):
        idx = c0 + tl.arange(0, BLOCK)
        ok = idx < COLS
        x = tl.load(src + idx, mask=ok, other=float("-inf")).to(tl.float32) * scale_log2
        tl.store(dst + idx, (tl.exp2(x - m) * inv).to(p_ptr.dtype.element_ty), mask=ok)


def launch_softmax_rows(s, p, scale, block, num_warps=8):
    """``p[i] = softmax(scale * s[i])`` for the rows of 2-D ``s`` and ``p``
    (unit stride along a row; ``p`` may be another dtype)."""
    rows, cols = s.shape
    launch(softmax_rows_kernel, (rows,), s, p, cols, s.stride(0), p.stride(0), float(scale) * LOG2E,
           BLOCK=block, num_warps=num_warps)
    return p
