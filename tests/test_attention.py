"""Blocked attention for wide heads (ops.attention, the softmax kernel) and
the mid-block attention recipes (diffusers ``Attention``, ldm ``AttnBlock``)
against float64 references and the unpatched blocks."""

import pytest
import torch
import torch.nn.functional as F

import conv_patch
from _util import TOL, poisoned, rel_err
from conv_patch import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_rows_kernel_matches_float64(device, dtype):
    from conv_patch import kernels
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


@pytest.mark.parametrize("q_shape,m,dv,dtype", [
    ((2, 3, 37, 24), 41, 27, torch.float32),
    ((50, 520), 50, 520, torch.float32),
    ((1, 1, 33, 17), 33, 20, torch.bfloat16),
], ids=["heads", "unbatched-wide", "bf16"])
def test_attention_blocks_match_float64(device, monkeypatch, q_shape, m, dv, dtype):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(*q_shape, generator=g)
    k = torch.randn(*q_shape[:-2], m, q_shape[-1], generator=g)
    v = torch.randn(*q_shape[:-2], m, dv, generator=g)
    # A few query rows per block, not dividing N: every block boundary and
    # the short last block are exercised.
    monkeypatch.setattr(ops, "ATTENTION_BLOCK_BYTES", 4 * m * 7)
    out = ops.attention(*(t.to(device, dtype) for t in (q, k, v)), scale=0.3)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3)
    assert out.dtype == dtype and rel_err(out, ref) <= TOL[dtype]
    # The default scale is SDPA's, 1/sqrt(D); one key/value set broadcast
    # over the leading dimensions.
    kb, vb = (k.flatten(0, -3)[0], v.flatten(0, -3)[0]) if k.dim() > 2 else (k, v)
    out = ops.attention(q.to(device, dtype), kb.to(device, dtype), vb.to(device, dtype))
    ref = F.scaled_dot_product_attention(q.double(), kb.double().expand(*q.shape[:-2], m, q.shape[-1]),
                                         vb.double().expand(*q.shape[:-2], m, dv))
    assert rel_err(out, ref) <= TOL[dtype]


def test_attention_leaves_autograd_to_sdpa(device):
    q = torch.randn(1, 5, 8, device=device, requires_grad=True)
    assert not ops.attention_pays(q, q, q)
    ops.attention(q, q, q).sum().backward()
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
        assert conv_patch.apply(m).fused[""].startswith("diffusers.Attention")
        calls = []
        orig = ops.attention
        try:
            ops.attention = lambda *a, **k: calls.append(1) or orig(*a, **k)
            out = m(x)
        finally:
            ops.attention = orig
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
    assert ops.attention_pays(q, k, v)
    out = ops.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    sdpa = F.scaled_dot_product_attention(q, k, v)
    assert rel_err(out, ref) <= TOL[dtype]
    # As accurate as PyTorch's own kernel, within rounding.
    assert rel_err(out, ref) <= 1.5 * rel_err(sdpa, ref) + 1e-3
