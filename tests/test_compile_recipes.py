"""torch.compile over the recipes: a fused VAE decoder traces to conv-patch's
ops as it runs eagerly, the folded upsample included
(``torch.ops.conv_patch.upsample_conv``, not the plain interpolate and
cuDNN conv), and the blocks' in-place ``out`` writes, which would be copies
of their own in a compiled graph, are left to Inductor."""

import zlib

import pytest
import torch
import torch.nn.functional as F

import conv_patch
from conv_patch.runtime import compiled, dispatch  # (compiled registers the ops)
from conv_patch.runtime.state import state_of
from _util import aot_ops, poisoned, rel_err

pytest.importorskip("diffusers")


def _decoder(device):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 12),
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        layers_per_block=1, norm_num_groups=4)
    return vae.decoder.to(device).eval()


def test_a_fused_decoder_compiles_to_conv_patch_ops_without_copies(device, exact_fp32, monkeypatch):
    """Traced op by op (a decoder not run whole: see the test below)."""
    monkeypatch.setattr(compiled, "register_whole", lambda block: None)
    dec = _decoder(device)
    z = torch.randn(1, 4, 6, 5, device=device)
    import warnings
    with torch.no_grad():
        ref = dec(z)
        report = conv_patch.apply(dec)
        assert report.fused
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seen, out = aot_ops(dec, z)
    assert rel_err(out, ref) <= 1e-5
    # Nothing of ours makes Dynamo warn (traced, target_for's lru_cache did,
    # at every compile of a patched model).
    assert not [str(w.message)[:200] for w in caught if "conv_patch" in str(w.message) or "target.py" in str(w.message)
                or "conv_patch" in (w.filename or "")]
    # The resnets' out= writes (GroupNorm over conv1's output, conv2 into
    # the shortcut's) would be copies here.
    assert not [op for op in seen if op.startswith("aten.copy")]
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in dec.modules())
    if z.is_cuda:
        # Each conv is PyTorch's convolution or a routed op, as the routing
        # decides for its shape (the composite ops' choice).
        assert (seen.count("aten.convolution.default") + seen.count("conv_patch.conv_routed.default")
                + seen.count("conv_patch.upsample_conv_routed.default")) == convs
    else:
        # One upsampler (the last up block has none): the folded op, no
        # cuDNN conv (the kernels take every call under the interpreter).
        assert seen.count("conv_patch.upsample_conv_routed.default") == 1
        assert "aten.convolution.default" not in seen and "aten.upsample_nearest2d.default" not in seen
        assert seen.count("conv_patch.conv_routed.default") == convs - 1
    # Every GroupNorm the kernels take eagerly is the GroupNorm op, not
    # Inductor's native_group_norm (on a GPU, norms this small are
    # PyTorch's eagerly too, so theirs stay in the graph).
    norms = sum(isinstance(m, torch.nn.GroupNorm) for m in dec.modules())
    if not z.is_cuda:
        assert seen.count("conv_patch.group_norm.default") == norms == 14
        assert "aten.native_group_norm.default" not in seen
    # The mid-block attention is the attention op where the kernels take it
    # eagerly (here under the interpreter; on a GPU a head this narrow is
    # SDPA's, eagerly and traced), not SDPA.
    assert seen.count("conv_patch.attention.default") == (0 if z.is_cuda else 1)
    assert z.is_cuda or not [op for op in seen if "scaled_dot_product" in op]


def _whole_ok(device, monkeypatch, pixels=1):
    """Skips where no block runs whole; else the decoder recipe's bound
    lowered to ``pixels`` (the tiny decoder's latents are far below it)."""
    from conv_patch.ops import library
    from conv_patch.recipes import diffusers as recipes
    if library.CUDAGRAPH_UNSAFE is None:
        pytest.skip("this torch cannot keep an op out of CUDA graphs")
    if not conv_patch.target.target_for(torch.device(device)).kernels:
        pytest.skip("no kernels on this device")
    assert recipes.Decoder.whole_from == 128 * 128
    monkeypatch.setattr(recipes.Decoder, "whole_from", pixels)


def test_a_big_vae_half_compiles_to_one_op_running_its_eager_forward(device, exact_fp32, monkeypatch):
    """A VAE decoder (``Recipe.whole_from``) is one ``whole_block`` op
    in the compiled graph, computing what the patched decoder computes
    eagerly, bit for bit, in the caller's layout; it stays out of CUDA
    graphs (reduce-overhead), and a copy of the patched decoder (deepcopy,
    with other weights) compiles to its own block, never the original's."""
    import copy
    _whole_ok(device, monkeypatch)
    dec = _decoder(device)
    z = torch.randn(1, 4, 6, 5, device=device)
    with torch.no_grad():
        conv_patch.apply(dec)
        other = copy.deepcopy(dec)
        for p in other.parameters():
            p.mul_(1.5)
        eagers = []
        for model, x in ((dec, z), (dec, z.contiguous(memory_format=torch.channels_last)), (other, z)):
            # (Its second call: the op's runs are planned, as eager calls are
            # after the first, which builds the plans.)
            model(x)
            eager = model(x)
            seen, out = aot_ops(model, x)
            assert seen == ["conv_patch.whole_block.default"]
            assert torch.equal(out, eager) and out.stride() == eager.stride()
            eagers.append(eager)
        assert not torch.equal(eagers[2], eagers[0])  # (the copy's own weights: its block, not the original's)
        # Dynamic shapes: the fake's output size follows the input's.
        torch._dynamo.reset()
        fn = torch.compile(dec, backend="aot_eager", fullgraph=True, dynamic=True)
        for shape in ((1, 4, 6, 5), (2, 4, 3, 7)):
            x = torch.randn(shape, device=device)
            y, ref = fn(x), dec(x)
            assert y.shape == ref.shape and rel_err(y, ref) <= 1e-6, (shape, (y - ref).abs().max().item())
    assert torch.Tag.cudagraph_unsafe in torch.ops.conv_patch.whole_block.default.tags


def test_a_block_run_whole_compiles_ahead_at_its_first_compiled_call(device, exact_fp32, monkeypatch):
    """A compiled graph runs a whole block's forward, not its call, so the
    first-call hook that compiles the kernels ahead (a forward pre-hook)
    never runs: the op makes that pass itself before the block's first
    call, once per block, with the call's input, and leaves the hook on
    (taking it off would change what Dynamo guarded: the graph would
    compile again). Recorded where the pass starts (on the CPU it would
    refuse: no CUDA tensor)."""
    from conv_patch.api import warmup
    _whole_ok(device, monkeypatch)
    passes = []
    monkeypatch.setattr(warmup, "_first_pass", lambda module, fn, args, kwargs, what: passes.append((module, args)))
    dec = _decoder(device)
    z = torch.randn(1, 4, 6, 5, device=device)
    with torch.no_grad():
        ref = dec(z)
        report = conv_patch.apply(dec)
        assert report.compile_ahead and warmup.first_pass_pending(dec)
        torch._dynamo.reset()
        fn = torch.compile(dec, backend="aot_eager", fullgraph=True)
        calls = compiled.whole_block_calls()
        for _ in range(3):
            assert rel_err(fn(z), ref) <= 1e-5
    assert compiled.whole_block_calls() - calls == 3
    assert len(passes) == 1 and passes[0][0] is dec and passes[0][1][0] is z
    assert warmup.first_pass_pending(dec)


def test_a_block_run_whole_is_covered_by_its_first_compiled_calls_pass(device, exact_fp32, monkeypatch):
    """The pass a whole block makes at its first compiled call compiles
    every kernel specialisation the compiled calls after it launch: a
    launch it missed compiles one at a time inside the compiled call (cold,
    seconds each). The kernels are not run here: the launches' arguments
    are what is compared (the decode's answer is the test above's)."""
    from triton.runtime.interpreter import InterpretedFunction
    from test_warmup import _forced_pass, _launch_key
    _whole_ok(device, monkeypatch)
    _, kernel_launch = _forced_pass(monkeypatch, device)
    ahead, launched = set(), []
    monkeypatch.setattr(kernel_launch, "compile_only",
                        lambda kernel, grid, args, meta: ahead.add(_launch_key(kernel, args, meta)))
    monkeypatch.setattr(InterpretedFunction, "run",
                        lambda self, *args, grid, warmup, **kw: launched.append(_launch_key(self, args, kw)))
    dec = _decoder(device)
    z = torch.randn(1, 4, 6, 5, device=device)
    with torch.no_grad():
        conv_patch.apply(dec)
        torch._dynamo.reset()
        fn = torch.compile(dec, backend="aot_eager", fullgraph=True)
        calls = compiled.whole_block_calls()
        for _ in range(3):
            fn(z)
    assert compiled.whole_block_calls() - calls == 3
    assert ahead and launched
    missed = [k for k in launched if k not in ahead]
    assert not missed, f"{len(set(missed))} launch signatures not compiled ahead: {sorted(set(map(str, missed)))[:3]}"
    # The block's record says the pass ran (a skipped one would say why).
    rec = conv_patch.last_pass(dec)
    assert rec is not None and rec.skipped is None and rec.seconds > 0, rec


def test_a_big_vae_half_runs_whole_only_from_its_recipes_size(device, exact_fp32, monkeypatch):
    """Below its recipe's ``whole_from`` (N·H·W of the input) the decoder
    is traced op by op (where Inductor's unpatched graph may beat the eager
    run); from it on, one op. With dynamic shapes the bound is a guard: a
    size across it compiles again, and each side computes right."""
    _whole_ok(device, monkeypatch, pixels=40)
    dec = _decoder(device)
    small, big = torch.randn(1, 4, 6, 5, device=device), torch.randn(2, 4, 3, 7, device=device)  # 30, 42
    with torch.no_grad():
        ref_small, ref_big = dec(small), dec(big)
        conv_patch.apply(dec)
        seen, out = aot_ops(dec, small)
        assert "conv_patch.whole_block.default" not in seen and rel_err(out, ref_small) <= 1e-5
        seen, out = aot_ops(dec, big)
        assert seen == ["conv_patch.whole_block.default"] and rel_err(out, ref_big) <= 1e-5
        torch._dynamo.reset()
        fn = torch.compile(dec, backend="aot_eager", fullgraph=True, dynamic=True)
        assert rel_err(fn(small), ref_small) <= 1e-5 and rel_err(fn(big), ref_big) <= 1e-5


def test_a_big_vae_half_is_traced_op_by_op_where_it_cannot_run_whole(device, exact_fp32, monkeypatch):
    """Where the eager forward cannot stand for the traced call (a gradient
    is needed: the op has no backward; a strided input) the decoder's recipe
    is traced as before: no ``whole_block``, and the same answer."""
    _whole_ok(device, monkeypatch)
    dec = _decoder(device)
    z = torch.randn(1, 4, 12, 5, device=device)
    with torch.no_grad():
        ref = dec(z[:, :, ::2])
    conv_patch.apply(dec)
    with torch.no_grad():
        seen, out = aot_ops(dec, z[:, :, ::2])
    assert "conv_patch.whole_block.default" not in seen and rel_err(out, ref) <= 1e-5
    seen, out = aot_ops(dec, z[:, :, ::2].contiguous())
    assert "conv_patch.whole_block.default" not in seen and rel_err(out, ref) <= 1e-5


def test_a_hooked_upsample_conv_is_traced_as_its_module(device, exact_fp32, monkeypatch):
    """A forward hook on the conv makes the recipe call the module itself,
    as eagerly: no op hides the hook's call (traced op by op; run whole, the
    decoder's eager forward calls it)."""
    monkeypatch.setattr(compiled, "register_whole", lambda block: None)
    dec = _decoder(device)
    z = torch.randn(1, 4, 6, 5, device=device)
    calls = []
    with torch.no_grad():
        ref = dec(z)
        conv_patch.apply(dec)
        dec.up_blocks[0].upsamplers[0].conv.register_forward_hook(lambda *a: calls.append(1))
        seen, out = aot_ops(dec, z)
    assert rel_err(out, ref) <= 1e-5 and calls
    assert not [op for op in seen if "upsample_conv" in op]


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("residual,activation", [(False, "none"), (True, "silu"), (True, "leaky_relu_0.2")])
@pytest.mark.parametrize("fold", [True, False])
def test_the_upsample_op_against_float64(device, exact_fp32, monkeypatch, nhwc, residual, activation, fold):
    """Both of its ways (the four 2x2 convs, or the conv of the upsampled
    input), each layout, an epilogue; opcheck holds its fake to the real."""
    monkeypatch.setattr(dispatch, "subpixel_pays", lambda x, w: fold)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 4, 7, generator=g, dtype=torch.float64)
    w = torch.randn(6, 5, 3, 3, generator=g, dtype=torch.float64) * 45 ** -0.5
    b = torch.randn(6, generator=g, dtype=torch.float64)
    r = torch.randn(2, 6, 8, 14, generator=g, dtype=torch.float64) if residual else None
    ref = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w, b, padding=1)
    if r is not None:
        ref = ref + r
    ref = {"none": lambda t: t, "silu": F.silu, "leaky_relu_0.2": lambda t: F.leaky_relu(t, 0.2)}[activation](ref)
    xs = x.float().to(device)
    xs = xs.contiguous(memory_format=torch.channels_last) if nhwc else xs
    args = (xs, w.float().to(device), b.float().to(device), None if r is None else r.float().to(device), activation)
    with torch.no_grad():
        y = compiled.upsample_conv(*args)
    assert rel_err(y, ref) <= 1e-5
    assert y.is_contiguous(memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    torch.library.opcheck(compiled.upsample_conv, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_the_upsample_op_writes_nothing_it_was_given(device, exact_fp32):
    """A custom op must neither alias nor write its inputs: the residual
    stays as it was."""
    x = torch.randn(1, 4, 3, 5, device=device)
    w, b = torch.randn(4, 4, 3, 3, device=device), torch.randn(4, device=device)
    r = poisoned((1, 4, 6, 10), torch.float32, device).normal_()
    before = r.clone()
    with torch.no_grad():
        y = compiled.upsample_conv(x, w, b, r, "none")
    assert torch.equal(r, before) and y.data_ptr() != r.data_ptr()


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "ncdhw", "ndhwc", "strided5d"])
@pytest.mark.parametrize("extras", ["plain", "input_bias", "modulation"])
def test_the_group_norm_op_against_float64(device, layout, extras):
    """``torch.ops.conv_patch.group_norm`` (what a compiled graph runs for
    a GroupNorm the kernels take): the norm of ``x + input_bias``, modulated,
    SiLU'd, against float64, in the layout its fake claims, on awkward
    shapes (12 channels in 3 groups, odd spatial sizes) with a large mean
    and an outlier; and opcheck's schema/fake/AOT checks."""
    from conv_patch.ops import group_norm as gno
    if extras == "input_bias" and layout != "nhwc" and layout != "nchw":
        pytest.skip("input_bias is a 4-D call's (a conv's bias folded into the norm)")
    g = torch.Generator().manual_seed(zlib.crc32(f"{layout}/{extras}".encode()))  # (str hash() varies by process)
    shape = (2, 12, 5, 7) if layout in ("nchw", "nhwc") else (1, 12, 3, 4, 5)
    x = (torch.randn(shape, generator=g) + 40.0)
    x.view(-1)[7] *= 25
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "ndhwc":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    elif layout == "strided5d":
        x = x.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)  # a [B, T, C, H, W] clip permuted back
    w, b = 1 + 0.1 * torch.randn(12, generator=g), 0.1 * torch.randn(12, generator=g)
    ib = 0.5 * torch.randn(12, generator=g) if extras == "input_bias" else None
    # (Modulation in x's layout, as CogVideoX's spatial norm passes it.)
    mod = (tuple(torch.empty_like(x).copy_(torch.randn(shape, generator=g)) for _ in range(2))
           if extras == "modulation" else None)
    xd = x + (0 if ib is None else ib.view(-1, *([1] * (x.dim() - 2))))
    ref = F.group_norm(xd.double(), 3, w.double(), b.double(), 1e-5)
    ref = F.silu(ref if mod is None else ref * mod[0].double() + mod[1].double())
    args = [t if not isinstance(t, torch.Tensor) else t.to(device)
            for t in (x, 3, w, b, 1e-5, "silu", ib, *(mod or (None, None)))]
    with torch.no_grad():
        y = torch.ops.conv_patch.group_norm(*args)
        eager = gno.group_norm(args[0], 3, args[2], args[3], 1e-5, "silu", input_bias=args[6],
                               modulation=mod and (args[7], args[8]))
    assert rel_err(y, ref) <= 1e-5 and rel_err(eager, ref) <= 1e-5
    if device == "cpu":
        # (On a GPU the op's norm site may plan PyTorch's norm at this size,
        # which rounds differently from the kernels'.)
        assert torch.equal(y, eager)
    assert y.is_contiguous(memory_format=gno.output_format(args[0]))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.conv_patch.group_norm(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                                 for t in args])
    assert fake.shape == y.shape and fake.stride() == y.stride()
    torch.library.opcheck(torch.ops.conv_patch.group_norm.default, tuple(args),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_the_group_norm_op_is_planned_and_replayed(device, monkeypatch):
    """The GroupNorm op runs through the one dispatch entry on a norm site
    (one per parameters): its first call at a signature builds a plan, the
    next ones replay it (no build, no Python launcher: a compiled graph
    calls the op at every GroupNorm), and an in-place edit of the weight is
    read by the replay."""
    from conv_patch.runtime import planner
    builds = []
    build = planner.build_group_norm
    monkeypatch.setattr(planner, "build_group_norm", lambda *a, **k: builds.append(1) or build(*a, **k))
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 12, 5, 7, generator=g) + 20).to(device)
    w, b = (1 + 0.1 * torch.randn(12, generator=g)).to(device), (0.1 * torch.randn(12, generator=g)).to(device)
    with torch.no_grad():
        for _ in range(3):
            y = torch.ops.conv_patch.group_norm(x, 3, w, b, 1e-5, "silu", None, None, None)
            assert rel_err(y, F.silu(F.group_norm(x.double(), 3, w.double(), b.double()))) <= 1e-5
        assert len(builds) == 1
        site = dispatch.norm_site(3, w, b, 1e-5)
        assert site is dispatch.norm_site(3, w, b, 1e-5) and len(state_of(site).plans) == 1
        w.mul_(2)
        y = torch.ops.conv_patch.group_norm(x, 3, w, b, 1e-5, "silu", None, None, None)
        assert len(builds) == 1
        assert rel_err(y, F.silu(F.group_norm(x.double(), 3, w.double(), b.double()))) <= 1e-5
        # A call the kernels do not take (float64) runs PyTorch's GroupNorm
        # on the site's parameters.
        xd, wd, bd = x.double(), w.double(), b.double()
        y = torch.ops.conv_patch.group_norm(xd, 3, wd, bd, 1e-5, "silu", None, None, None)
        assert y.dtype == torch.float64 and rel_err(y, F.silu(F.group_norm(xd, 3, wd, bd))) <= 1e-12
        assert not any(p.kernel for p in state_of(dispatch.norm_site(3, wd, bd, 1e-5)).plans.values())


@pytest.mark.parametrize("family", ["wan2.1", "ltx-video", "hunyuan-video", "mochi", "cogvideox"])
def test_a_patched_video_vae_decode_compiles_fullgraph(family, exact_fp32):
    """Each diffusers video VAE family's decode, tiny, patched, compiled as
    a user compiles it (``torch.compile(vae.decode, fullgraph=True)``):
    no graph break from the recipes (HunyuanVideo's masked attention fell
    back to ``Attention.forward(block, ...)``, which Dynamo cannot trace),
    and the unpatched decode's output."""
    import copy

    from bench.video import TINY_CLIPS, build_vae, latents
    cpu = torch.device("cpu")
    vae = build_vae(family, True, cpu, torch.float32)
    frames, h, w = TINY_CLIPS.get(family, (3, 8, 8))[:3]
    z = latents(vae, frames, h, w, cpu, torch.float32)
    patched = copy.deepcopy(vae)
    assert conv_patch.apply(patched).patched
    torch._dynamo.reset()
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = torch.compile(patched.decode, backend="aot_eager", fullgraph=True)(z).sample
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("pays", [False, True])
def test_a_traced_group_norm_is_the_op_only_where_the_kernels_pay(device, exact_fp32, monkeypatch, pays):
    """Under tracing a GroupNorm is the op where the plans would run the
    kernels eagerly (``costs.group_norm_pays`` on a GPU), else PyTorch's
    GroupNorm for Inductor, as the eager plans decide: a GPU's decision,
    made on the CPU by a stand-in target and crossover."""
    from conv_patch.routing import costs
    from conv_patch.target import Target
    if torch.device(device).type != "cpu":
        pytest.skip("the stand-in GPU target is the CPU test's")
    from conv_patch.recipes import fuse
    monkeypatch.setattr(compiled, "target_for", lambda d: Target("sm90", True, sms=132))
    monkeypatch.setattr(costs, "GROUP_NORM_MIN_ELEMENTS", 0 if pays else 1 << 30)
    norm = torch.nn.GroupNorm(4, 12).eval()
    x = torch.randn(2, 12, 5, 7) + 3
    with torch.no_grad():
        seen, out = aot_ops(lambda t: fuse.group_norm(norm, t, "silu"), x)
        ref = F.silu(norm(x))
    assert rel_err(out, ref) <= 1e-5
    assert ("conv_patch.group_norm.default" in seen) is pays
    assert ("aten.native_group_norm.default" in seen) is not pays
