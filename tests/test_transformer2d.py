"""diffusers' ``Transformer2DModel`` (a UNet's spatial transformer): passed
through, it runs as ``LeanTransformer2D``, which must compute its own
forward's values bit for bit, and run that forward wherever the call or the
block is not the configuration it writes out."""

import copy

import pytest
import torch

import conv_patch
from conv_patch.recipes import fuse
from conv_patch.recipes import transformer2d as rt
from conv_patch.runtime import passthrough

diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0  # noqa: E402
from diffusers.models.transformers.transformer_2d import Transformer2DModel  # noqa: E402


def _seeded(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            # Biases and norm affines far from their zero/one init, so a
            # skipped or reordered step shows.
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 0.1)
    return m


def _transformer(linear: bool, cross: bool, act: str = "geglu", layers: int = 2):
    return _seeded(Transformer2DModel(num_attention_heads=3, attention_head_dim=4, in_channels=12, num_layers=layers,
                                      norm_num_groups=4, cross_attention_dim=10 if cross else None,
                                      activation_fn=act, use_linear_projection=linear)).eval()


def _inputs(device, cross: bool, channels_last: bool = False):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 12, 5, 3, generator=g) * 2 + 0.5).to(device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    ctx = (torch.randn(2, 7, 10, generator=g) * 3).to(device) if cross else None
    return x, ctx


def _passed_through(block):
    """``block`` patched, then run as the passthrough runs an idle block:
    it and everything under it as their own classes."""
    conv_patch.apply(block)
    for c, own, _ in passthrough.own_class_swaps(list(block.modules())):
        object.__setattr__(c, "__class__", own)
    return block


@pytest.fixture
def own_forwards():
    """The names of the forwards the lean one writes out that ran (seen by
    a profile hook: a spy put in their place would be another forward, one
    the lean one leaves to run)."""
    import sys
    codes = {cls.forward.__code__: cls.__name__ for cls in (Transformer2DModel, BasicTransformerBlock, Attention)}
    calls = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            calls.append(codes[frame.f_code])

    old = sys.getprofile()
    sys.setprofile(hook)
    yield calls
    sys.setprofile(old)


@pytest.mark.parametrize("linear,cross,act,cl", [(False, True, "geglu", False), (True, True, "geglu", True),
                                                 (False, False, "gelu-approximate", False),
                                                 (True, False, "gelu", False)])
def test_lean_transformer_computes_its_own_forward_bit_for_bit(device, linear, cross, act, cl, own_forwards):
    block = _transformer(linear, cross, act).to(device)
    x, ctx = _inputs(device, cross, cl)
    with torch.no_grad():
        ref = block(x, ctx, return_dict=False)[0]
    block = _passed_through(block)
    lean = type(block)
    assert lean is fuse.lean_class(Transformer2DModel, rt.LeanTransformer2D) and lean.__name__ == "Transformer2DModel"
    own_forwards.clear()
    x0 = x.clone()
    with torch.no_grad():
        out = block(x, ctx, return_dict=False)
    assert isinstance(out, tuple) and len(out) == 1
    assert not own_forwards, own_forwards  # none of the forwards it writes out ran
    assert torch.equal(out[0], ref) and out[0].stride() == ref.stride()
    assert torch.equal(x, x0)  # the input is not written


def test_lean_transformer_runs_its_own_forward_where_it_must(device, own_forwards):
    block = _transformer(False, True).to(device)
    x, ctx = _inputs(device, True)
    with torch.no_grad():
        ref = block(x, ctx, return_dict=False)[0]
        ref_dict = block(x, ctx).sample
    block = _passed_through(block)

    def run(**kwargs):
        own_forwards.clear()
        with torch.no_grad():
            y = block(x, ctx, **{"return_dict": False, **kwargs})
        return y[0] if isinstance(y, tuple) else y.sample

    assert torch.equal(run(), ref) and not own_forwards
    # The output class it would have to build.
    assert torch.equal(run(return_dict=True), ref_dict) and own_forwards[0] == "Transformer2DModel"
    # A mask (all kept: the same values through the masked path).
    mask = torch.ones(2, 7, device=device)
    run(encoder_attention_mask=mask)
    assert own_forwards[0] == "Transformer2DModel"
    run(cross_attention_kwargs={"unused": 1})
    assert own_forwards[0] == "Transformer2DModel"
    # Autograd recorded.
    own_forwards.clear()
    with torch.enable_grad():
        assert torch.equal(block(x, ctx, return_dict=False)[0].detach(), ref)
    assert own_forwards[0] == "Transformer2DModel"
    # A global hook would not see the parts run inline.
    seen = []
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        run()
    finally:
        h.remove()
    assert own_forwards[0] == "Transformer2DModel" and "Linear" in seen


def test_lean_transformer_calls_the_parts_it_cannot_inline_as_modules(device, own_forwards):
    """A hooked part, a replaced part (a LoRA layer), another processor or a
    training dropout: called as a module, as its parent's own forward
    would; the rest still inline."""
    block = _transformer(False, True).to(device)
    x, ctx = _inputs(device, True)
    with torch.no_grad():
        ref = block(x, ctx, return_dict=False)[0]
    block = _passed_through(block)

    def run():
        own_forwards.clear()
        with torch.no_grad():
            return block(x, ctx, return_dict=False)[0]

    seen = []
    hooks = [block.transformer_blocks[1].attn2.to_k.register_forward_hook(lambda m, a, o: seen.append("to_k")),
             block.transformer_blocks[0].norm3.register_forward_hook(lambda m, a, o: seen.append("norm3")),
             block.transformer_blocks[1].ff.register_forward_pre_hook(lambda m, a: seen.append("ff"))]
    assert torch.equal(run(), ref) and not own_forwards and seen == ["norm3", "to_k", "ff"]
    for h in hooks:
        h.remove()
    # A hooked block or attention: its own forward, the others inline.
    h = block.transformer_blocks[0].register_forward_hook(lambda m, a, o: seen.append("block"))
    assert torch.equal(run(), ref) and own_forwards == ["BasicTransformerBlock", "Attention", "Attention"]
    h.remove()
    h = block.transformer_blocks[1].attn1.register_forward_pre_hook(lambda m, a, k: seen.append("attn1"),
                                                                    with_kwargs=True)
    assert torch.equal(run(), ref) and own_forwards == ["Attention"] and seen[-1] == "attn1"
    h.remove()

    class LoRALinear(torch.nn.Linear):  # a replaced part, computing the same
        calls = 0

        def forward(self, x):
            LoRALinear.calls += 1
            return super().forward(x)

    old = block.transformer_blocks[0].attn1.to_out[0]
    new = LoRALinear(old.in_features, old.out_features).to(device)
    new.load_state_dict(old.state_dict())
    block.transformer_blocks[0].attn1.to_out[0] = new
    assert torch.equal(run(), ref) and not own_forwards and LoRALinear.calls == 1
    block.transformer_blocks[0].attn1.to_out[0] = old
    # Another processor (set_attn_processor): its own computation.
    block.transformer_blocks[0].attn1.set_processor(AttnProcessor())
    y = run()
    assert own_forwards == ["Attention"] and (y - ref).abs().max() <= 1e-4 * ref.abs().max()
    block.transformer_blocks[0].attn1.set_processor(AttnProcessor2_0())
    # A training dropout (p=0 here: the same values through the module).
    drop = block.transformer_blocks[0].ff.net[1]
    drop.train()
    h = drop.register_forward_hook(lambda m, a, o: seen.append("dropout"))
    assert torch.equal(run(), ref) and not own_forwards and seen[-1] == "dropout"
    h.remove()
    drop.eval()
    assert torch.equal(run(), ref) and not own_forwards


def test_lean_transformer_takes_only_the_contracts_it_wrote_out(monkeypatch):
    assert rt.kind_of(Transformer2DModel) == "Transformer2DModel" and rt.kind_of(AttnProcessor2_0) == "AttnProcessor2_0"

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **cross_attention_kwargs):
        return hidden_states

    mine = type("Attention", (torch.nn.Module,), {"forward": forward})  # same name and contract, not diffusers'
    assert rt.kind_of(mine) is None
    # diffusers' name and module, another forward: another contract.
    other = type("Attention", (torch.nn.Module,), {"__module__": "diffusers.models.attention_processor",
                                                   "forward": lambda self, hidden_states, temb=None: hidden_states})
    assert rt.kind_of(other) is None
    # A subclass of diffusers' class is another class.
    sub = type("BasicTransformerBlock", (BasicTransformerBlock,), {"__module__": "my.blocks"})
    assert rt.kind_of(sub) is None
    # A forward wrapped at run time (by a library, a profiler): the wrapper runs.
    import functools
    real = Attention.forward
    monkeypatch.setattr(Attention, "forward", functools.wraps(real)(lambda *a, **k: real(*a, **k)))
    assert rt.kind_of(Attention) is None
    monkeypatch.setattr(Attention, "forward", real)
    assert rt.kind_of(Attention) == "Attention"


@pytest.mark.parametrize("linear", [False, True])
def test_unet_patched_computes_the_unpatched_values_with_the_lean_transformers(device, linear, own_forwards,
                                                                               monkeypatch):
    """A UNet with SD1.5's structure, patched with this recipe alone and its
    convs left unpatched (under the interpreter a patched projection or a
    GroupNorm recipe would do work, with its own rounding, and keep its
    block from being passed through): its values bit for bit, from the
    third call on through ``LeanTransformer2D``."""
    from conv_patch.recipes import catalog
    monkeypatch.setattr(catalog, "ORDER", [rt.TRANSFORMER_2D])
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=10,
                                attention_head_dim=4, norm_num_groups=4, layers_per_block=1, sample_size=6,
                                use_linear_projection=linear).eval().to(device)
    patched = copy.deepcopy(unet)
    report = conv_patch.apply(patched, filter_fn=lambda m, fqn: False)
    assert sum(v.startswith("diffusers.Transformer2DModel") for v in report.fused.values()) == 4
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 6, 6, generator=g).to(device)
    ctx = torch.randn(2, 5, 10, generator=g).to(device)
    t = torch.tensor(7, device=device)
    with torch.no_grad():
        ref = unet(x, t, ctx).sample
        ran = []
        for call in range(3):
            own_forwards.clear()
            out = patched(x, t, ctx).sample
            assert torch.equal(out, ref)
            ran.append(own_forwards.count("Transformer2DModel"))
    # The first two calls (building, watched) ran the four transformers'
    # own forwards; the third passed them through, lean.
    assert ran == [4, 4, 0]
