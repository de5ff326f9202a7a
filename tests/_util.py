"""Helpers shared by the tests (imported as a plain module: pytest puts
tests/ on sys.path)."""

import torch
import torch.nn.functional as F

# ||out - ref|| / ||ref|| bounds against a float64 reference.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output (unwritten poisoned element?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poisoned(shape, dtype, device, channels_last=False):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.full(shape, float("nan"), dtype=dtype, device=device).contiguous(memory_format=fmt)


def randn(gen, *shape, scale=1.0, dtype=torch.float32, device="cpu"):
    """Seeded normal values, drawn on the CPU so every device sees the same."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def act64(y, activation):
    if activation == "relu":
        return F.relu(y)
    if activation == "silu":
        return F.silu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if activation.startswith("leaky_relu"):
        slope = 0.01 if activation == "leaky_relu" else float(activation.rsplit("_", 1)[1])
        return F.leaky_relu(y, slope)
    assert activation == "none", activation
    return y


def conv_kernels() -> dict:
    """The convolution kernels (@triton.jit), by name: what the signature
    and recompilation tests look at."""
    from conv_patch.kernels import (conv2d, conv2d_flat, conv2d_tma, conv2d_tma_padded, conv3d, conv3d_tma,
                                    conv_transpose2d)
    return {"conv2d": conv2d.conv2d_fwd_kernel, "conv_transpose2d": conv_transpose2d.conv_transpose2d_fwd_kernel,
            "conv2d_tma": conv2d_tma.conv2d_tma_kernel, "conv2d_flat": conv2d_flat.conv2d_flat_kernel,
            "conv2d_tma_padded": conv2d_tma_padded.conv2d_tma_padded_kernel,
            "conv3d": conv3d.conv3d_fwd_kernel, "conv3d_tma": conv3d_tma.conv3d_tma_kernel}


def refuse_fallback(monkeypatch, recipe_module):
    """Make a recipe module's ``base`` (the block's own forward) fail: a
    test of the fused forward must not pass on a silent fallback."""
    def refuse(m, *a, **k):
        raise AssertionError(f"{type(m).__name__} fell back to its own forward")
    monkeypatch.setattr(recipe_module, "base", refuse)


def perturbed(block, seed: int, scale: float = 0.2):
    """``block`` in eval mode with seeded noise added to every parameter
    (no parameter left at its initial zero or one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return block.eval()


def aot_ops(fn, *args, dynamic=False):
    """The ATen and custom ops of ``fn``'s compiled graph (after AOT
    autograd, as Inductor receives them: composite ops replaced by what
    they chose), and the compiled result."""
    from torch._functorch.aot_autograd import aot_module_simplified
    seen = []

    def backend(gm, inputs):
        def fw(graph, _):
            seen.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            return graph.forward
        return aot_module_simplified(gm, inputs, fw_compiler=fw)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    return seen, out


class ComfyCausalConv3d:
    """ComfyUI's WanVAE causal conv contract, mixed in before a Conv3d class
    (torch's, or one following ComfyUI's own ``Conv3d``): the padding moved
    to ``_padding`` (time at the front only), the cached frames of the
    previous chunk by argument or by list slot (which it clears) put in
    front of ``x``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._padding = (self.padding[2], self.padding[2], self.padding[1], self.padding[1], 2 * self.padding[0], 0)
        self.padding = (0, 0, 0)

    def forward(self, x, cache_x=None, cache_list=None, cache_idx=None):
        if cache_list is not None:
            cache_x, cache_list[cache_idx] = cache_list[cache_idx], None
        padding = list(self._padding)
        if cache_x is not None and self._padding[4] > 0:
            x = torch.cat([cache_x, x], dim=2)
            padding[4] -= cache_x.shape[2]
        return super().forward(F.pad(x, padding))
