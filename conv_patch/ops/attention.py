"""Attention for wide heads: ``F.scaled_dot_product_attention`` where PyTorch
has a fused kernel for the head width, the scores materialised in blocks
where it has none (the VAE mid-block's single 512-channel head)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from conv_patch.ops import library
from conv_patch.ops.loader import kernels
from conv_patch.routing.registry import tma_arch
from conv_patch.specs import HALF_DTYPES, KERNEL_DTYPES, needs_grad
from conv_patch.target import Target, target_for

# Attention with a head wider than 256 channels (the VAE mid-block's single
# 512-channel head) has no FlashAttention or cuDNN kernel in PyTorch; its
# memory-efficient kernel ran at ~150 TF/s on the H200 (3.6 ms at N = 16384,
# 67 ms at N = 65536). So the scores of a block of query rows are
# materialised. On Hopper (and under the interpreter) two Triton GEMMs do it
# with the softmax folded into them and the scores written once, in the
# input dtype (kernels/attention.py); elsewhere cuBLAS runs both GEMMs
# with fp32 scores and a softmax pass between them (kernels/softmax.py). The
# probabilities are rounded once to the input dtype for the second GEMM, as
# FlashAttention rounds them. Blocks are bounded in bytes so that a 2048^2
# decode stays within its memory budget: its mid-block runs where little
# else is allocated, far below the decode's peak in the last up block.
ATTENTION_BLOCK_BYTES = 256 << 20
FUSED_ATTENTION_BLOCK_BYTES = 1 << 30
# Softmax (block, warps) per program. H200, fp32 scores to bf16: 8192 with 16
# warps ran a 4096 x 16384 block in 0.105 ms against 0.163 with (2048, 8) (the
# second pass reads the row back from L2), and a 1024 x 65536 block at the
# same 4 TB/s as every other choice. Under the interpreter one block per row.
SOFTMAX_LAUNCH = {"gpu": (8192, 16), "interpreter": (1 << 16, 4)}
# Tiles of the fused route: the score tile (its width is the granularity of
# the softmax partials and the P V kernel's K step) and the P V tile. H200,
# bf16, one 512-wide head (bench/results/attention-tiles-h200-2026-12-01.json):
# scores 128x128x64 with 4 warps and 3 stages ran at 494-532 TF/s (8 warps
# 442-480; 128x256 and 256x128 tiles 277-390; 4 stages 424; a persistent,
# flattened loop no faster), P V 128x128 with 8 warps and 3 stages at 560-575
# (whole attention at 65536 tokens 19.0 ms against 23.6 with 2 stages, 21.5
# with 4 warps, 20.1 with 64-row and 21.7 with 128x256 tiles; 4 stages exceed
# shared memory); GROUP_M 32 saved 2% over 8, and 32-row combine programs
# 0.1 ms of 0.45 over 128-row ones (64 programs). Interpreter tiles are small so
# that the tests' awkward sizes span several tiles and K blocks.
FUSED_ATTENTION_TILES = {
    "gpu": {"scores": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 32, "num_warps": 4, "num_stages": 3},
            "combine": {"BLOCK_R": 32, "BLOCK_T": 32, "num_warps": 4},
            "pv": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}},
    "interpreter": {"scores": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2},
                    "combine": {"BLOCK_R": 16, "BLOCK_T": 2},
                    "pv": {"BLOCK_M": 16, "BLOCK_N": 16}},
}


def attention_pays(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``attention`` materialises the scores (a CUDA fp16/bf16 call
    with a head wider than PyTorch's fused kernels take, or any call under
    the interpreter, where the tests exercise it) instead of calling SDPA."""
    return _attention_target(q, k, v) is not None


def attention_route(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """"fused" (kernels/attention.py), "blocked" (cuBLAS + softmax kernel) or
    "sdpa": what ``attention`` runs for these tensors."""
    if _attention_target(q, k, v) is None:
        return "sdpa"
    return "fused" if "fused" in attention_routes(q, k, v) else "blocked"


def attention_routes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """Every route that can compute this call, whether or not it pays: what
    ``attention(..., route=)`` may ask for. "sdpa" always; "blocked" where
    the kernels take the tensors; "fused" where, besides, TMA does (on a
    GPU fp16/bf16 only: Triton's fp32 dot is TF32 there)."""
    target = _attention_target(q, k, v, any_width=True)
    if target is None:
        return ("sdpa",)
    fused = target.interpreter or (tma_arch(target.arch) and q.dtype in HALF_DTYPES)
    return ("blocked", "fused", "sdpa") if fused else ("blocked", "sdpa")


def _attention_target(q, k, v, any_width: bool = False, traced: bool = False) -> Optional[Target]:
    """The target whose kernels take this call, or None (SDPA). Under
    torch.compile tracing None, except for ``traced``: whether the call,
    run, would take the kernels (``attention``'s op then stands for it)."""
    if (torch.compiler.is_compiling() and not traced) or q.dim() < 2 or needs_grad(q, k, v):
        return None
    target = target_for(q.device)
    if not target.kernels or not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return None
    if target.interpreter or any_width:
        ok = q.dtype in KERNEL_DTYPES
    else:
        ok = q.dtype in HALF_DTYPES and max(q.shape[-1], v.shape[-1]) > 256
    return target if ok else None


def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) as a TMA can describe it: unit column stride, 16-byte
    aligned base and row stride; otherwise a copy with its rows padded to a
    16-byte multiple, returned as a view of the original width."""
    align = 16 // t.element_size()
    if t.stride(1) == 1 and t.stride(0) % align == 0 and t.data_ptr() % 16 == 0:
        return t
    cols = -(-t.shape[1] // align) * align
    out = t.new_zeros((t.shape[0], cols))
    out[:, :t.shape[1]] = t
    return out[:, :t.shape[1]]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None, *,
              route: Optional[str] = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, scale=scale)`` (no mask, no
    dropout) for [..., N, D] queries and [..., M, D] keys and values: scores
    materialised in blocks of query rows where that pays (``attention_pays``;
    ``attention_route`` names the kernels), SDPA otherwise. ``route``
    ("fused", "blocked" or "sdpa"; benchmarks and tests) overrides the choice
    where ``attention_routes`` lists it."""
    if route is None:
        if torch.compiler.is_compiling() and _attention_target(q, k, v, traced=True) is not None:
            # One opaque op of the compiled graph, the kernels the eager call
            # runs: traced, SDPA would be PyTorch's memory-efficient kernel
            # for these wide heads (FLUX.1's decoder at 1024², H100: 4.55 ms
            # against the kernels' 1.08; docs/performance.md).
            return attention_compiled(q, k, v, None if scale is None else float(scale))
        route = attention_route(q, k, v)
    else:
        routes = attention_routes(q, k, v)
        if route not in routes:
            raise ValueError(f"attention route {route!r} is not available for these tensors "
                             f"(available: {', '.join(sorted(routes))})")
    if route == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    interp = target_for(q.device).interpreter
    kern = kernels()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    n, d, m, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q3 = q.expand(*lead, n, d).reshape(-1, n, d)
    k3 = k.expand(*lead, m, d).reshape(-1, m, d)
    v3 = v.expand(*lead, m, dv).reshape(-1, m, dv)
    out = torch.empty((q3.shape[0], n, dv), dtype=q.dtype, device=q.device)
    if route == "fused":
        config = FUSED_ATTENTION_TILES["interpreter" if interp else "gpu"]
        align = 16 // q.element_size()
        m_pad = -(-m // align) * align
        rows = max(1, min(n, FUSED_ATTENTION_BLOCK_BYTES // (m_pad * q.element_size())))
        t = kern.attention_partial_columns(m, config)
        e = torch.empty((rows, m_pad), dtype=q.dtype, device=q.device)
        # The partials' row stride a multiple of 16 whatever ``rows``: the
        # kernels are specialised on it (a new size would compile them again).
        mx = torch.empty((t, -(-rows // 16) * 16), dtype=torch.float32, device=q.device)
        sm = torch.empty_like(mx)
        for b in range(q3.shape[0]):
            qb, kb, vb = _tma_rows(q3[b]), _tma_rows(k3[b]), _tma_rows(v3[b])
            for i in range(0, n, rows):
                r = min(rows, n - i)
                kern.launch_attention_block(qb[i:i + r], kb, vb, out[b, i:i + r], e, mx, sm, scale, config,
                                            interp)
        return out.view(*lead, n, dv)
    rows = max(1, min(n, ATTENTION_BLOCK_BYTES // (4 * max(m, 1))))
    scores = torch.empty((rows, m), dtype=torch.float32, device=q.device)
    probs = torch.empty((rows, m), dtype=q.dtype, device=q.device)
    block, warps = SOFTMAX_LAUNCH["interpreter" if interp else "gpu"]
    for b in range(q3.shape[0]):
        kt = k3[b].t()
        if interp:
            kt = kt.float()
        for i in range(0, n, rows):
            r = min(rows, n - i)
            if interp:
                torch.mm(q3[b, i:i + r].float(), kt, out=scores[:r])
            else:
                torch.mm(q3[b, i:i + r], kt, out_dtype=torch.float32, out=scores[:r])
            kern.launch_softmax_rows(scores[:r], probs[:r], scale, block, warps)
            torch.mm(probs[:r], v3[b], out=out[b, i:i + r])
    return out.view(*lead, n, dv)


@library.op("attention(Tensor q, Tensor k, Tensor v, float? scale) -> Tensor")
def attention_compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """``attention`` as one op of a compiled graph (run, it chooses its
    route as the eager call does)."""
    return attention(q, k, v, scale).contiguous()


@library.fake(attention_compiled)
def _(q, k, v, scale):
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return q.new_empty((*lead, q.shape[-2], v.shape[-1]))
