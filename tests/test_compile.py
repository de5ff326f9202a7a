"""torch.compile: the wrappers and the functional API become one custom op
(``torch.ops.conv_patch.conv``) per convolution in the traced graph, with no
graph break, and give the eager answer. Traced with a recording backend and
with aot_eager (Inductor's C++/Triton codegen is not needed to check this);
Inductor itself in its default, max-autotune-no-cudagraphs and
reduce-overhead modes on a model with recipe blocks (issue 46)."""

import pytest
import torch

import conv_patch
from conv_patch import functional
from conv_patch.runtime import compiled
from conv_patch.runtime.state import state_of
from _util import aot_ops, rel_err


def _net(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.SiLU(),
        torch.nn.ConvTranspose2d(16, 8, 4, 2, 1),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)).to(device).eval()


def _recording():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm
    return backend, seen


def test_compiled_patched_model_is_one_op_per_conv(device, exact_fp32):
    net = _net(device)
    x = torch.randn(1, 8, 6, 7, device=device)
    with torch.no_grad():
        ref = net(x)
        conv_patch.apply(net)
        backend, seen = _recording()
        torch._dynamo.reset()
        out = torch.compile(net, backend=backend, fullgraph=True)(x)
        assert seen.count("conv_patch.conv.default") == 3
        assert rel_err(out, ref) <= 1e-5
        torch._dynamo.reset()
        aot = torch.compile(net, backend="aot_eager", fullgraph=True)
        assert rel_err(aot(x), ref) <= 1e-5
        # NHWC input: the fake implementation keeps the layout the kernel writes.
        x_cl = x.contiguous(memory_format=torch.channels_last)
        assert rel_err(aot(x_cl), ref) <= 1e-5


def test_a_traced_conv_guards_on_what_the_unpatched_one_does(device, exact_fp32):
    """Dynamo guards every value a trace reads, and a compiled model checks
    its guards at every call: a patched conv's trace reads the geometry
    from the module's own attributes (as nn.Conv2d's forward does), never
    the wrapper's state, so that the compiled patched model costs the host
    what the unpatched one does. The geometry so read is right: "same"
    padding with an even kernel (the odd pad at the end), dilation, and a
    transposed conv's output padding given per call."""
    from conv_patch.runtime.state import STATE
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(5, 6, 4, padding="same", dilation=(1, 2)),
        torch.nn.ConvTranspose2d(6, 4, 3, 2, 1, output_padding=1),
        torch.nn.Conv2d(4, 3, 3, stride=(2, 1), padding=(2, 0))).to(device).eval()
    x = torch.randn(2, 5, 7, 9, device=device)
    with torch.no_grad():
        ref = net(x)
        conv_patch.apply(net)
        torch._dynamo.reset()
        ours = torch._dynamo.explain(net)(x)
        assert ours.graph_count == 1 and ours.graph_break_count == 0
        assert not [g.name for g in ours.out_guards if f"['{STATE}']" in g.name]
        torch._dynamo.reset()
        out = torch.compile(net, backend="aot_eager", fullgraph=True)(x)
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5


def test_traced_convs_the_kernels_would_not_take_are_pytorchs_convolutions(device, exact_fp32):
    """``conv_patch::conv`` is composite: traced with known sizes, a call the
    routing hands to PyTorch (here float64, which no kernel computes)
    becomes PyTorch's convolution in the graph Inductor gets, fused and
    scheduled as in the unpatched model; a call the kernels may take stays
    one routed op (under the interpreter every float32 call). With symbolic
    sizes (dynamic shapes) the same choice at the traced sizes, and the
    graph computes other sizes right."""
    torch.manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        net = _net(device).to(dtype)
        x = torch.randn(1, 8, 6, 7, device=device, dtype=dtype)
        with torch.no_grad():
            ref = net(x)
            conv_patch.apply(net)
            seen, out = aot_ops(net, x)
            assert rel_err(out, ref) <= (1e-12 if dtype == torch.float64 else 1e-5)
            routed = seen.count("conv_patch.conv_routed.default")
            if dtype == torch.float64:
                assert routed == 0 and seen.count("aten.convolution.default") == 3
            elif device == "cpu":
                assert routed == 3 and "aten.convolution.default" not in seen
            # Dynamic shapes: decided at the traced sizes (their hints).
            seen, out = aot_ops(net, x, dynamic=True)
            assert rel_err(out, ref) <= (1e-12 if dtype == torch.float64 else 1e-5)
            if dtype == torch.float64:
                assert "conv_patch.conv_routed.default" not in seen and seen.count("aten.convolution.default") == 3
            elif device == "cpu":
                assert seen.count("conv_patch.conv_routed.default") == 3
            # ... and the graph serves another size.
            x2 = torch.randn(2, 8, 9, 5, device=device, dtype=dtype)
            assert rel_err(torch.compile(net, fullgraph=True, dynamic=True, backend="aot_eager")(x2),
                           _net(device).to(dtype)(x2)) <= (1e-12 if dtype == torch.float64 else 1e-5)


def test_a_graph_replayed_as_cuda_graphs_gets_pytorchs_convolutions(device, exact_fp32):
    """Traced for CUDA-graph replay (reduce-overhead's Inductor option), a
    CUDA graph's composite conv op is PyTorch's convolution even where the
    kernels would take the call: the routed op's weight pack, made at its
    first call, would be allocated in the graph tree's pool, which refuses
    it. The option is set whatever the device; a CPU graph is never replayed
    so and keeps the routed op (under the interpreter, every float32 call)."""
    from torch._inductor import config
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        on_gpu, on_cpu = torch.empty(1, device="cuda"), torch.empty(1)
    with config.patch({"triton.cudagraphs": True}):
        assert compiled.replayed_as_cuda_graphs(on_gpu) and not compiled.replayed_as_cuda_graphs(on_cpu)
    assert not compiled.replayed_as_cuda_graphs(on_gpu)
    net = _net(device)
    x = torch.randn(1, 8, 6, 7, device=device)
    with torch.no_grad():
        ref = net(x)
        conv_patch.apply(net)
        with config.patch({"triton.cudagraphs": True}):
            seen, out = aot_ops(net, x)
    assert rel_err(out, ref) <= 1e-5
    ours = [op for op in seen if "conv_patch" in op]
    if device.type == "cuda":
        assert seen.count("aten.convolution.default") == 3 and not ours
    else:
        assert len(ours) == 3


def test_fused_call_and_functional_api_under_compile(device, exact_fp32):
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).to(device).eval()
    x = torch.randn(2, 8, 5, 5, device=device)
    r = torch.randn(2, 8, 5, 5, device=device)
    w = torch.randn(4, 8, 3, 3, device=device)
    with torch.no_grad():
        ref = torch.relu(conv(x) + 0.5 * r)
        ref_f = torch.nn.functional.conv2d(x, w, padding=1).sigmoid()
        conv_patch.apply(torch.nn.Sequential(conv))  # wraps it inside the Sequential
        wrapped = conv_patch.runtime.wrappers.PatchedConv2d.wrap(conv)
        torch._dynamo.reset()
        fused = torch.compile(lambda a, b: wrapped(a, residual=b, beta=0.5, activation="relu"),
                              backend="aot_eager", fullgraph=True)
        assert rel_err(fused(x, r), ref) <= 1e-5
        func = torch.compile(lambda a: functional.conv2d(a, w, padding=1).sigmoid(), backend="aot_eager",
                             fullgraph=True)
        assert rel_err(func(x), ref_f) <= 1e-5


def test_compile_with_grad_traces_the_original_forward(device):
    net = _net(device)
    conv_patch.apply(net)
    x = torch.randn(1, 8, 4, 4, device=device, requires_grad=True)
    backend, seen = _recording()
    torch._dynamo.reset()
    y = torch.compile(net, backend=backend, fullgraph=True)(x)
    y.sum().backward()
    assert x.grad is not None and "conv_patch.conv.default" not in seen


def test_fused_vae_blocks_compile_fullgraph(device, exact_fp32):
    """Recipe blocks (GroupNorm+SiLU, residual epilogue, folded upsample)
    under torch.compile: no graph break, the eager answer."""
    import pytest
    resnet = pytest.importorskip("diffusers.models.resnet")
    upsampling = pytest.importorskip("diffusers.models.upsampling")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        resnet.ResnetBlock2D(in_channels=8, out_channels=12, temb_channels=None, groups=4),
        upsampling.Upsample2D(12, use_conv=True)).to(device).eval()

    def run(x):
        return net[1](net[0](x, None))
    x = torch.randn(1, 8, 5, 6, device=device)
    with torch.no_grad():
        ref = run(x)
        report = conv_patch.apply(net)
        assert {"0", "1"} <= set(report.fused)
        backend, seen = _recording()
        torch._dynamo.reset()
        out = torch.compile(run, backend=backend, fullgraph=True)(x)
        assert seen.count("conv_patch.conv.default") >= 3
        assert rel_err(out, ref) <= 1e-5


def test_the_compiled_op_runs_through_the_dispatch_core(device, exact_fp32, monkeypatch):
    """The custom op's calls are planned per signature on a call site (one
    per geometry and weight), replayed, and weighed like a wrapper's: where
    dispatch says PyTorch, the op runs PyTorch."""
    from conv_patch.runtime import compiled, dispatch
    from conv_patch.routing.registry import Route
    from conv_patch.routing.decide import RouteDecision
    torch.manual_seed(0)
    x = torch.randn(1, 5, 7, 6, device=device)
    w, b = torch.randn(6, 5, 3, 3, device=device), torch.randn(6, device=device)
    ref = torch.nn.functional.conv2d(x, w, b, padding=1)

    def op(w):
        return torch.ops.conv_patch.conv(x, w, b, None, False, [1, 1], [1, 1], [1, 1], [1, 1], [0, 0], 1.0,
                                         "none", 1.0)
    def new_site(before):
        (site,) = [s for k, s in dispatch.sites().items() if k not in before]
        return site
    with torch.no_grad():
        before = dispatch.sites()
        for _ in range(2):
            assert rel_err(op(w), ref) <= 1e-5
        site = new_site(before)  # one site for both calls
        assert site.spec == compiled._spec(x, w, b, False, [1, 1], [1, 1], [1, 1], [1, 1], [0, 0])
        assert len(state_of(site).plans) == 1 and state_of(site).last.is_kernel
        assert next(iter(state_of(site).plans.values())).program is not None  # recorded, then replayed

        from conv_patch.runtime import planner
        monkeypatch.setattr(planner, "decide", lambda *a, **k: RouteDecision(Route.FALLBACK, "test"))
        w2 = w.clone()
        before = dispatch.sites()
        assert rel_err(op(w2), ref) <= 1e-6
        last = state_of(new_site(before)).last
        assert not last.is_kernel and last.reason == "test"


@pytest.mark.parametrize("which", ["conv", "conv_routed", "upsample_conv", "upsample_conv_routed", "group_norm",
                                   "attention"])
def test_the_ops_refuse_a_call_that_needs_a_gradient(device, which, exact_fp32):
    """conv-patch's kernel ops have no autograd formula: where a gradient is
    needed they raise (never a result autograd would differentiate
    wrongly); without one they compute, and pass torch's op checks
    (schema, fake, the dispatcher's view of them). The composite conv ops
    (``conv``, ``upsample_conv``) compute such a call as PyTorch's ops, and
    their gradient is PyTorch's."""
    import conv_patch.ops.attention  # noqa: F401 (the modules that define the ops)
    import conv_patch.ops.group_norm  # noqa: F401
    import conv_patch.runtime.compiled  # noqa: F401
    torch.manual_seed(0)
    x = torch.randn(1, 8, 5, 6, device=device)
    w, b = torch.randn(8, 8, 3, 3, device=device), torch.randn(8, device=device)
    conv_args = (x, w, b, None, False, [1, 1], [1, 1], [1, 1], [1, 1], [0, 0], 1.0, "none", 1.0)
    op, args, ref = {
        "conv_routed": (torch.ops.conv_patch.conv_routed.default, conv_args,
                        lambda x: torch.nn.functional.conv2d(x, w, b, padding=1)),
        "upsample_conv_routed": (torch.ops.conv_patch.upsample_conv_routed.default, (x, w, b, None, "none"),
                                 lambda x: torch.nn.functional.conv2d(
                                     torch.nn.functional.interpolate(x, scale_factor=2.0), w, b, padding=1)),
        "conv": (torch.ops.conv_patch.conv.default,
                 (x, w, b, None, False, [1, 1], [1, 1], [1, 1], [1, 1], [0, 0], 1.0, "none", 1.0),
                 lambda x: torch.nn.functional.conv2d(x, w, b, padding=1)),
        "upsample_conv": (torch.ops.conv_patch.upsample_conv.default, (x, w, b, None, "none"),
                          lambda x: torch.nn.functional.conv2d(torch.nn.functional.interpolate(x, scale_factor=2.0),
                                                               w, b, padding=1)),
        "group_norm": (torch.ops.conv_patch.group_norm.default, (x, 2, b, b, 1e-5, "silu", None, None, None),
                       lambda x: torch.nn.functional.silu(torch.nn.functional.group_norm(x, 2, b, b))),
        "attention": (torch.ops.conv_patch.attention.default, (x[0], x[0] * 0.5, x[0].flip(1), None),
                      lambda x: torch.nn.functional.scaled_dot_product_attention(x[0], x[0] * 0.5, x[0].flip(1))),
    }[which]
    with torch.no_grad():
        assert rel_err(op(*args), ref(x)) <= 1e-4
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    xg = x.clone().requires_grad_()
    needs = (xg,) + args[1:]
    if which in ("conv", "upsample_conv"):
        xr = x.clone().requires_grad_()
        y, y_ref = op(*needs), ref(xr)
        assert rel_err(y.detach(), y_ref.detach()) <= 1e-4
        (y * y_ref.detach()).sum().backward()
        (y_ref * y_ref.detach()).sum().backward()
        assert rel_err(xg.grad, xr.grad) <= 1e-4
        return
    with pytest.raises(RuntimeError, match=f"conv_patch::{which} computes no gradient"):
        op(*needs)


def _conv_op_calls(fn, *args) -> int:
    """Calls of conv-patch's custom ops in one call of ``fn`` (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(1 for e in prof.events() if e.name.startswith("conv_patch::"))


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", "reduce-overhead"])
def test_patched_model_compiles_fullgraph_with_inductor_in_every_mode(device, exact_fp32, mode):
    """Issue 46: a patched model (convs and a VAE's fused recipe blocks)
    compiles with ``fullgraph=True`` under Inductor in the default,
    max-autotune-no-cudagraphs and reduce-overhead modes (no graph break from
    conv-patch's op or its recipes: one graph), its convs conv-patch's op in
    the compiled code, and gives the eager answer. (On the CPU
    reduce-overhead runs without CUDA graphs.)"""
    resnet = pytest.importorskip("diffusers.models.resnet")
    upsampling = pytest.importorskip("diffusers.models.upsampling")
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        resnet.ResnetBlock2D(in_channels=8, out_channels=12, temb_channels=None, groups=4),
        upsampling.Upsample2D(12, use_conv=True), torch.nn.SiLU(),
        torch.nn.ConvTranspose2d(12, 8, 4, 2, 1)).to(device).eval()

    def run(x):
        return net[3](net[2](net[1](net[0](x, None))))
    x = torch.randn(1, 8, 5, 6, device=device)
    with torch.no_grad():
        ref = run(x)
        report = conv_patch.apply(net)
        assert {"0", "1"} <= set(report.fused)
        torch._dynamo.reset()
        f = torch.compile(run, fullgraph=True, mode=mode)
        try:
            seen = []
            for _ in range(3):  # (reduce-overhead on a GPU: warm-up, capture, replay)
                torch.compiler.cudagraph_mark_step_begin()
                out = f(x).clone()
                assert rel_err(out, ref) <= 1e-5
                seen.append(counters["stats"]["unique_graphs"])
            # Steady: no graph compiled after the first call
            # (test_recipe_model_compiles_once: in a fresh process too).
            assert seen[2] == seen[1] == seen[0]
            if not (device.type == "cuda" and mode == "reduce-overhead"):  # (a graph replay calls no op)
                assert _conv_op_calls(f, x) >= 4
        finally:
            torch._dynamo.reset()


_COMPILE_ONCE = """
import sys, torch, conv_patch
from diffusers.models.resnet import ResnetBlock2D
from torch._dynamo.utils import counters
dev = sys.argv[1]
net = torch.nn.Sequential(ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=None, groups=4)).to(dev).eval()
conv_patch.apply(net)
f = torch.compile(lambda x: net[0](x, None), backend="eager", fullgraph=True)
x = torch.randn(1, 8, 5, 6, device=dev)
with torch.no_grad():
    for _ in range(3):
        f(x)
print("graphs", counters["stats"]["unique_graphs"])
"""


def test_recipe_model_compiles_once(device):
    """A patched model with a fused recipe block, compiled in a fresh process
    (conv-patch's kernels not imported yet), compiles one graph over three
    calls: nothing the first call changes (a module imported, a plan made)
    makes Dynamo compile again."""
    import subprocess
    import sys
    pytest.importorskip("diffusers")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ONCE, device.type], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "1", proc.stdout
