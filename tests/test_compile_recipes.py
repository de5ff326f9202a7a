"""torch.compile over the recipes: a fused VAE decoder traces to conv-patch's
ops as it runs eagerly, the folded upsample included
(``torch.ops.conv_patch.upsample_conv``, not the plain interpolate and
cuDNN conv), and the blocks' in-place ``out`` writes, which would be copies
of their own in a compiled graph, are left to Inductor."""

import pytest
import torch
import torch.nn.functional as F

import conv_patch
from conv_patch.runtime import compiled, dispatch  # (compiled registers the ops)
from _util import poisoned, rel_err

pytest.importorskip("diffusers")


def _ops(fn, *args):
    """The ATen and custom ops of ``fn``'s compiled graph (after AOT
    autograd, as Inductor receives them), and the compiled result."""
    from torch._functorch.aot_autograd import aot_module_simplified
    seen = []

    def backend(gm, inputs):
        def fw(graph, _):
            seen.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            return graph.forward
        return aot_module_simplified(gm, inputs, fw_compiler=fw)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen, out


def _decoder(device):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 12),
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        layers_per_block=1, norm_num_groups=4)
    return vae.decoder.to(device).eval()


def test_a_fused_decoder_compiles_to_conv_patch_ops_without_copies(device, exact_fp32):
    dec = _decoder(device)
    z = torch.randn(1, 4, 6, 5, device=device)
    with torch.no_grad():
        ref = dec(z)
        report = conv_patch.apply(dec)
        assert report.fused
        seen, out = _ops(dec, z)
    assert rel_err(out, ref) <= 1e-5
    # One upsampler (the last up block has none): the folded op, no cuDNN conv.
    assert seen.count("conv_patch.upsample_conv.default") == 1
    assert "aten.convolution.default" not in seen and "aten.upsample_nearest2d.default" not in seen
    # The resnets' out= writes (GroupNorm over conv1's output, conv2 into
    # the shortcut's) would be copies here.
    assert not [op for op in seen if op.startswith("aten.copy")]
    assert seen.count("conv_patch.conv.default") >= 8


def test_a_hooked_upsample_conv_is_traced_as_its_module(device, exact_fp32):
    """A forward hook on the conv makes the recipe call the module itself,
    as eagerly: no op hides the hook's call."""
    dec = _decoder(device)
    z = torch.randn(1, 4, 6, 5, device=device)
    calls = []
    with torch.no_grad():
        ref = dec(z)
        conv_patch.apply(dec)
        dec.up_blocks[0].upsamplers[0].conv.register_forward_hook(lambda *a: calls.append(1))
        seen, out = _ops(dec, z)
    assert rel_err(out, ref) <= 1e-5 and calls
    assert "conv_patch.upsample_conv.default" not in seen


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
