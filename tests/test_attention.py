"""Blocked attention for wide heads (functional.attention, the softmax kernel) and
the mid-block attention recipes (diffusers ``Attention``, ldm ``AttnBlock``)
against float64 references and the unpatched blocks."""

import pytest
import torch
import torch.nn.functional as F

import conv_patch
from _util import TOL, poisoned, rel_err
from conv_patch import functional
from conv_patch.ops import attention as attention_op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_rows_kernel_matches_float64(device, dtype):
    from conv_patch.kernels import api as kernels
    g = torch.Generator().manual_seed(3)
    # Rows longer than the block (a loop of 3 blocks, the last partial) and
    # shifted far from zero, where a softmax without the max would overflow.
    s = (torch.randn(5, 37, generator=g) * 4 + 90).to(device)
    p = poisoned((5, 37), dtype, device)
    kernels.launch_softmax_rows(s, p, 0.7, 16)
    ref = torch.softmax(s.double().cpu() * 0.7, -1)
    assert rel_err(p, ref) <= TOL[dtype]
    # A strided destination (a block of a larger buffer).
    big = poisoned((5, 40), dtype, device)
    kernels.launch_softmax_rows(s, big[:, :37], 0.7, 64)
    assert rel_err(big[:, :37], ref) <= TOL[dtype] and torch.isnan(big[:, 37:].float()).all()


@pytest.mark.parametrize("route", ["fused", "blocked"])
@pytest.mark.parametrize("q_shape,m,dv,dtype", [
    ((2, 3, 37, 24), 41, 27, torch.float32),
    ((50, 520), 50, 520, torch.float32),
    ((1, 1, 33, 17), 33, 20, torch.bfloat16),
    ((1, 1, 21, 16), 70, 48, torch.float16),
], ids=["heads", "unbatched-wide", "bf16", "fp16"])
def test_attention_blocks_match_float64(device, monkeypatch, route, q_shape, m, dv, dtype):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(*q_shape, generator=g)
    k = torch.randn(*q_shape[:-2], m, q_shape[-1], generator=g)
    v = torch.randn(*q_shape[:-2], m, dv, generator=g)
    # Small heads, which the GPU leaves to SDPA, asked down the kernels'
    # routes (the cuBLAS one is the GPU's off Hopper). A few query rows per
    # block, not dividing N: every block boundary and the short last block
    # are exercised.
    monkeypatch.setattr(attention_op, "ATTENTION_BLOCK_BYTES", 4 * m * 7)
    monkeypatch.setattr(attention_op, "FUSED_ATTENTION_BLOCK_BYTES", 4 * (m + 8) * 7)
    q_, k_, v_ = (t.to(device, dtype) for t in (q, k, v))
    if route not in functional.attention_routes(q_, k_, v_):
        pytest.skip(f"no {route} route for {dtype} here (fp32 TMA dots are TF32)")
    out = functional.attention(q_, k_, v_, scale=0.3, route=route)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3)
    assert out.dtype == dtype and rel_err(out, ref) <= TOL[dtype]
    # The default scale is SDPA's, 1/sqrt(D); one key/value set broadcast
    # over the leading dimensions.
    kb, vb = (k.flatten(0, -3)[0], v.flatten(0, -3)[0]) if k.dim() > 2 else (k, v)
    out = functional.attention(q.to(device, dtype), kb.to(device, dtype), vb.to(device, dtype), route=route)
    ref = F.scaled_dot_product_attention(q.double(), kb.double().expand(*q.shape[:-2], m, q.shape[-1]),
                                         vb.double().expand(*q.shape[:-2], m, dv))
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("splits", [None, 2, 3])
def test_fused_attention_kernels_write_every_output_and_nothing_else(device, splits):
    """The two kernels launched directly: poisoned scores scratch (its
    columns past M must never be read), poisoned partials wider than needed,
    a strided output window that must be written exactly; scores spread
    widely (score tiles whose maxima differ by ~100, whose weights underflow
    to zero) and keys not a multiple of the score tile. ``splits``: the keys
    shared among P V programs (3 score tiles: 2 splits of 2 and 1 tiles,
    3 of one each), their fp32 partials summed."""
    from conv_patch.kernels import api as kernels
    interp = device.type == "cpu"
    cfg = attention_op.FUSED_ATTENTION_TILES["interpreter" if interp else "gpu"]
    # fp32 under the interpreter; on GPUs the route's bf16 (the GPU tiles
    # hold no fp32 pipeline in shared memory, and tl.dot rounds fp32 to TF32).
    dtype = torch.float32 if interp else torch.bfloat16
    g = torch.Generator().manual_seed(8)
    r, m, d, dv = 45, 75, 40, 24
    q = torch.randn(r, d, generator=g)
    k = torch.randn(m, d, generator=g) * torch.linspace(0.2, 6.0, m)[:, None]
    v = torch.randn(m, dv, generator=g)
    t = kernels.attention_partial_columns(m, cfg)
    e = poisoned((r + 3, m + 21), dtype, device)
    mx, sm = poisoned((t + 2, r + 5), torch.float32, device), poisoned((t + 2, r + 5), torch.float32, device)
    big = poisoned((r + 4, dv + 5), dtype, device)
    win = big[2:2 + r, 3:3 + dv]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    kernels.launch_attention_block(q.to(device), k.to(device), v.to(device), win, e, mx, sm, 0.7, cfg, interp,
                                   splits=splits)
    # Against the rounded inputs: sharp scores amplify bf16's input rounding
    # to ~1% on their own, which is not the kernels' error.
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.7)
    assert rel_err(win, ref) <= TOL[dtype]
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[2:2 + r, 3:3 + dv] = False
    assert torch.isnan(big[outside]).all()


def test_pv_splits_fill_the_gpu_only_where_a_block_leaves_it_idle():
    from conv_patch.kernels import attention as kattn
    cfg = attention_op.FUSED_ATTENTION_TILES["gpu"]  # 128x128 P V tiles, 128-key score tiles
    # 8192^2 decode: 1M keys, 512-row blocks (16 tiles) -> 2 programs per SM.
    assert kattn.pv_splits(512, 512, 1 << 20, cfg, 132) == 17
    # 4096^2: 2048-row blocks (64 tiles, under half the SMs) -> split.
    assert kattn.pv_splits(2048, 512, 1 << 18, cfg, 132) == 5
    # 512^2 and 2048^2 decodes: 128 and 256 tiles -> unsplit, as are a few
    # keys (each split keeps >= 16 score tiles) and an unknown SM count.
    assert kattn.pv_splits(4096, 512, 4096, cfg, 132) == 1
    assert kattn.pv_splits(8192, 512, 65536, cfg, 132) == 1
    assert kattn.pv_splits(512, 512, 1024, cfg, 132) == 1
    assert kattn.pv_splits(512, 512, 1 << 20, cfg, None) == 1


def test_attention_route_can_be_asked_for_where_it_is_available(device):
    q = torch.randn(1, 6, 8, device=device)
    chosen = functional.attention_route(q, q, q)
    assert chosen == ("fused" if device.type == "cpu" else "sdpa")  # fp32: SDPA on GPUs
    # ... where the cuBLAS route can still be asked for (the fused one's dots would be TF32).
    assert functional.attention_routes(q, q, q) == (("blocked", "fused", "sdpa") if device.type == "cpu"
                                             else ("blocked", "sdpa"))
    ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert rel_err(functional.attention(q, q, q, route="blocked"), ref) <= 1e-5
    assert rel_err(functional.attention(q, q, q, route="sdpa"), ref) <= 1e-5
    with pytest.raises(ValueError, match="'fused' is not available.*available: (blocked, fused, )?sdpa"):
        functional.attention(q.requires_grad_(), q, q, route="fused")


def test_attention_leaves_autograd_to_sdpa(device):
    q = torch.randn(1, 5, 8, device=device, requires_grad=True)
    assert not functional.attention_pays(q, q, q)
    functional.attention(q, q, q).sum().backward()
    assert q.grad is not None


diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention_processor import Attention, AttnProcessor  # noqa: E402


def _vae_attention(c=12, heads=2, rescale=2.0):
    torch.manual_seed(0)
    m = Attention(c, heads=heads, dim_head=c // heads, rescale_output_factor=rescale, eps=1e-6,
                  norm_num_groups=3, residual_connection=True, bias=True, upcast_softmax=True,
                  _from_deprecated_attn_block=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (p.dim() == 1))
    return m.eval()


@pytest.mark.parametrize("channels_last", [False, True])
def test_diffusers_attention_fused_matches_unpatched(device, exact_fp32, channels_last):
    m = _vae_attention().to(device)
    x = torch.randn(2, 12, 5, 7, device=device) + 0.3
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = m(x)
        assert conv_patch.apply(m, config=conv_patch.PatchConfig(compile_ahead=False)).fused[""].startswith("diffusers.Attention")
        calls = []
        orig = functional.attention
        try:
            functional.attention = lambda *a, **k: calls.append(1) or orig(*a, **k)
            out = m(x)
        finally:
            functional.attention = orig
    assert calls == [1], "the fused forward did not run"
    assert rel_err(out, ref) <= 1e-5
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_diffusers_attention_falls_back_where_it_must(device, exact_fp32):
    m = _vae_attention().to(device)
    x = torch.randn(1, 12, 4, 3, device=device)
    conv_patch.apply(m)
    with torch.no_grad():
        ref = m(x)
        tokens = x.flatten(2).transpose(1, 2)
        # A mask, or another processor, is the class's own business.
        mask = torch.zeros(1, 12, 12, device=device)
        mask[..., :2] = -1e4
        got = m(x, attention_mask=mask)
        conv_patch.remove(m)
        want = m(x, attention_mask=mask)
        conv_patch.apply(m)
        assert rel_err(got, want) <= 1e-5 and rel_err(got, ref) > 1e-3
        m.set_processor(AttnProcessor())
        assert rel_err(m(x), ref) <= 1e-5
        assert m(tokens.contiguous()).dim() == 3  # token input: unfused


def test_ldm_attn_block_fused_matches_unpatched(device, exact_fp32):
    ldm = pytest.importorskip("ldm.modules.diffusionmodules.model")
    torch.manual_seed(0)
    m = ldm.AttnBlock(32).to(device).eval()
    x = torch.randn(1, 32, 5, 6, device=device)
    with torch.no_grad():
        ref = m(x)
        assert conv_patch.apply(m).fused[""].startswith("ldm.AttnBlock")
        assert rel_err(m(x), ref) <= 1e-5
        assert rel_err(m(x.contiguous(memory_format=torch.channels_last)), ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_wide_head_attention_on_the_gpu(dtype):
    # The FLUX VAE mid-block at a 512^2 image: one 512-wide head, 4096 tokens.
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 1, 4096, 512, device="cuda", generator=g).to(dtype) for _ in range(3))
    assert functional.attention_pays(q, k, v)
    out = functional.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    sdpa = F.scaled_dot_product_attention(q, k, v)
    assert rel_err(out, ref) <= TOL[dtype]
    # As accurate as PyTorch's own kernel, within rounding.
    assert rel_err(out, ref) <= 1.5 * rel_err(sdpa, ref) + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["fused", "blocked"])
def test_wide_head_attention_routes_on_the_gpu(monkeypatch, route):
    """Both routes against float64 and SDPA on sharp scores (std ~6, where
    score tiles' maxima differ and P's rounding matters), keys not a
    multiple of the score tile, query blocks not dividing N, a batch of 2."""
    g = torch.Generator(device="cuda").manual_seed(6)
    n, m = 2500, 2000 + 37
    q = torch.randn(2, 1, n, 512, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 1, m, 512, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(attention_op, "FUSED_ATTENTION_BLOCK_BYTES", 2 * (m + 3) * 999)
    monkeypatch.setattr(attention_op, "ATTENTION_BLOCK_BYTES", 4 * m * 999)
    if route not in functional.attention_routes(q, k, v):
        pytest.skip("the fused route needs TMA (sm90+)")
    out = functional.attention(q, k, v, scale=0.27, route=route)
    check = slice(0, 1200)
    ref = F.scaled_dot_product_attention(q[..., check, :].double(), k.double(), v.double(), scale=0.27)
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=0.27)[..., check, :]
    assert rel_err(out[..., check, :], ref) <= 1.5 * rel_err(sdpa, ref) + 1e-3
    # The last rows (another query block) as well.
    ref = F.scaled_dot_product_attention(q[..., -300:, :].double(), k.double(), v.double(), scale=0.27)
    assert rel_err(out[..., -300:, :], ref) <= TOL[torch.bfloat16]
