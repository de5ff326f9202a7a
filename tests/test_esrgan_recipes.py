"""ESRGAN's residual dense block and RRDB (recipes/esrgan.py) against the
blocks' own forwards in float64: the dense block's new-arch form (the
zoo's, basicsr's) and the old-arch "CNA" form spandrel (and so ComfyUI)
builds, through one NHWC buffer's channel prefixes, with the block's own
forward made to fail, batches and NHWC inputs included; hooks, ESRGAN+'s
``plus`` paths and another residual scale stay the block's own. Real-ESRGAN's
compact net likewise."""

import copy

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.recipes import esrgan, fuse
from conv_patch.runtime import pack
from bench.zoo import ResidualDenseBlock_5C as NewArchBlock
from _util import TOL, perturbed, refuse_fallback, rel_err


def _cna(cin, cout, act=True):
    layers = [nn.Conv2d(cin, cout, 3, 1, 1)] + ([nn.LeakyReLU(0.2, inplace=True)] if act else [])
    return nn.Sequential(*layers)


class ResidualDenseBlock_5C(nn.Module):  # noqa: N801 - the class name is what the recipe matches
    """The old-arch structure spandrel loads: each conv a Sequential of the
    conv and its activation (conv5's the conv alone), optional ESRGAN+
    1x1 paths (``plus``)."""

    def __init__(self, nf, gc, plus=False, scale=0.2):
        super().__init__()
        self.conv1x1 = nn.Conv2d(nf, gc, 1, bias=False) if plus else None
        self.conv1, self.conv2 = _cna(nf, gc), _cna(nf + gc, gc)
        self.conv3, self.conv4 = _cna(nf + 2 * gc, gc), _cna(nf + 3 * gc, gc)
        self.conv5 = _cna(nf + 4 * gc, nf, act=False)

    def forward(self, x):
        x1 = self.conv1(x)
        x2 = self.conv2(torch.cat((x, x1), 1))
        if self.conv1x1:
            x2 = x2 + self.conv1x1(x)
        x3 = self.conv3(torch.cat((x, x1, x2), 1))
        x4 = self.conv4(torch.cat((x, x1, x2, x3), 1))
        if self.conv1x1:
            x4 = x4 + x2
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        return x5 * 0.2 + x


class ResidualDenseBlock(NewArchBlock):
    """A block of the same structure whose forward scales its residual by 0.1."""

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        return self.conv5(torch.cat((x, x1, x2, x3, x4), 1)) * 0.1 + x


def _on(device, module, x):
    """The module and its input where the kernels run: float32 under the
    interpreter (CI), fp16 on a GPU (the upscalers' dtype), with the
    tolerance against float64 that dtype allows through a few layers."""
    if device.type == "cpu":
        return module, x, TOL[torch.float32]
    return module.to(device, torch.float16), x.to(device, torch.float16), TOL[torch.float16] * 5


def _input(nf, n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, nf, 7, 9, generator=g) + 3.0  # a large mean
    x[0, 1, 3, 4] = 40.0  # and an outlier
    return x


def _fused_dense(block, device, monkeypatch, refused=()):
    """(the fused block's output, its float64 reference, the tolerance, the
    ``torch.cat`` calls it made): on the graph path, the block's own forward
    and the modules of the classes ``refused`` made to fail."""
    nf = block.conv1.in_channels if isinstance(block.conv1, nn.Conv2d) else block.conv1[0].in_channels
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("esrgan.ResidualDenseBlock"), report.fused
    x = _input(nf)
    expected = ref(x.double())
    block, x, tol = _on(device, block, x)
    refuse_fallback(monkeypatch, esrgan)
    for cls in refused:
        monkeypatch.setattr(cls, "forward", lambda *a: pytest.fail(f"a {cls.__name__} ran as a module"))
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: (cats.append(1), real_cat(*a, **k))[1])
    with torch.no_grad(), pack.graph_path():
        y = block(x)
    return y, expected, tol, cats


@pytest.mark.parametrize("form", ["new-arch", "old-arch"])
def test_the_dense_block_against_its_own_forward(form, device, exact_fp32, monkeypatch):
    nf, gc = 12, 5  # channels no multiple of 8
    block = perturbed(NewArchBlock(nf, gc) if form == "new-arch" else ResidualDenseBlock_5C(nf, gc), 3, 0.05)
    y, expected, tol, cats = _fused_dense(block, device, monkeypatch)
    assert not cats  # the channel prefixes were read in place
    assert rel_err(y, expected) <= tol


@pytest.mark.parametrize("act", [lambda gc: nn.SiLU(), lambda gc: nn.PReLU(gc), lambda gc: nn.PReLU()],
                         ids=["silu", "prelu", "prelu-one-slope"])
def test_the_dense_block_with_other_activations(act, device, exact_fp32, monkeypatch):
    """spandrel's ``act_type``s: a PReLU's slopes (one per channel or one)
    read with the bias in the epilogue, its module never called."""
    block = perturbed(_swap(NewArchBlock(12, 5), "lrelu", act(5)), 6, 0.3)
    y, expected, tol, _ = _fused_dense(block, device, monkeypatch, refused=(nn.PReLU,))
    assert rel_err(y, expected) <= tol


@pytest.mark.parametrize("n,nhwc", [(2, False), (1, True), (3, True)])
def test_the_dense_block_on_batches_and_nhwc_inputs(n, nhwc, device, exact_fp32, monkeypatch):
    """The buffer is NHWC, so a batch's and an NHWC input's channel
    prefixes are read in place too; the output comes back in the input's
    layout."""
    block, x, expected, tol = _patched_on(perturbed(NewArchBlock(12, 5), 4, 0.05), n, nhwc, device)
    refuse_fallback(monkeypatch, esrgan)
    with torch.no_grad():
        y = block(x)
    assert rel_err(y, expected) <= tol
    assert y.stride() == x.stride()


def _patched_on(m, n, nhwc, device):
    """(``m`` patched, on the test device, an input of ``n`` images of 12
    channels (NHWC where ``nhwc``), the unpatched answer in float64, the
    tolerance)."""
    ref = copy.deepcopy(m).double()
    conv_patch.apply(m)
    x = _input(12, n=n)
    expected = ref(x.double())
    m, x, tol = _on(device, m, x)
    return m, x.contiguous(memory_format=torch.channels_last) if nhwc else x, expected, tol


def test_a_hooked_dense_block_runs_its_own_forward(device, exact_fp32):
    nf, gc = 12, 5
    block = perturbed(NewArchBlock(nf, gc), 4, 0.05)
    ref = copy.deepcopy(block).double()
    conv_patch.apply(block)
    x = _input(nf)
    expected = ref(x.double())
    block, x, tol = _on(device, block, x)
    seen = []
    block.conv3.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    own = []
    real_base = esrgan.base
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(esrgan, "base", lambda m, *a, **k: (own.append(1), real_base(m, *a, **k))[1])
        with torch.no_grad(), pack.graph_path():
            y = block(x)
    assert own and rel_err(y, expected) <= tol
    assert seen == [(1, gc, 7, 9)]


class BasicsrRRDB(nn.Module):
    """basicsr's RRDB: its dense blocks named rdb1-3."""

    def __init__(self, nf, gc):
        super().__init__()
        self.rdb1, self.rdb2, self.rdb3 = (NewArchBlock(nf, gc) for _ in range(3))

    def forward(self, x):
        out = self.rdb1(x)
        out = self.rdb2(out)
        out = self.rdb3(out)
        return out * 0.2 + x


BasicsrRRDB.__name__ = "RRDB"


@pytest.mark.parametrize("form,n,nhwc", [("esrgan", 1, False), ("basicsr", 2, False), ("esrgan", 2, True)])
def test_the_rrdb_against_its_own_forward(form, n, nhwc, device, exact_fp32, monkeypatch):
    """The residual-in-residual block: its three dense blocks on two NHWC
    buffers, never called as modules, no concatenations; its output in the
    input's layout."""
    from bench.zoo import RRDB
    m = perturbed(RRDB(12, 5) if form == "esrgan" else BasicsrRRDB(12, 5), 5, 0.05)
    m, x, expected, tol = _patched_on(m, n, nhwc, device)
    assert type(m).cp_recipe is esrgan.RRDB_RECIPE
    refuse_fallback(monkeypatch, esrgan)
    monkeypatch.setattr(type(esrgan.RESIDUAL_DENSE), "forward", lambda *a, **k: pytest.fail("a dense block ran"))
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: (cats.append(1), real_cat(*a, **k))[1])
    with torch.no_grad():
        y = m(x)
    assert not cats and rel_err(y, expected) <= tol
    assert y.stride() == x.stride()


def test_what_the_rrdb_leaves_to_its_own_forward(device, exact_fp32):
    """A dense block the recipe does not take: no match; a hook on a conv
    inside: the RRDB's own forward, its other dense blocks still fused."""
    from bench.zoo import RRDB
    m = perturbed(RRDB(12, 5), 8, 0.05)
    assert esrgan.RRDB_RECIPE.match(m)
    m.RDB2 = ResidualDenseBlock(12, 5)  # another residual scale
    assert not esrgan.RRDB_RECIPE.match(m)
    m = perturbed(RRDB(12, 5), 8, 0.05)
    ref = copy.deepcopy(m).double()
    conv_patch.apply(m)
    x = _input(12)
    expected = ref(x.double())
    m, x, tol = _on(device, m, x)
    seen = []
    m.RDB2.conv4.register_forward_hook(lambda mod, a, o: seen.append(o.shape))
    own = []
    real_base = esrgan.base
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(esrgan, "base", lambda mod, *a, **k: (own.append(type(mod).cp_base.__name__),
                                                         real_base(mod, *a, **k))[1])
        with torch.no_grad(), pack.graph_path():
            y = m(x)
    assert own == ["RRDB", "ResidualDenseBlock_5C"] and seen and rel_err(y, expected) <= tol


@pytest.mark.parametrize("block", [lambda: ResidualDenseBlock_5C(12, 5, plus=True), lambda: ResidualDenseBlock(12, 5),
                                   lambda: _swap(NewArchBlock(12, 5), "lrelu", nn.Tanh()),
                                   lambda: _swap(NewArchBlock(12, 5), "lrelu", nn.PReLU(7)),
                                   lambda: _swap(NewArchBlock(12, 5), "conv3", nn.Conv2d(22, 5, 3, 1, 2, dilation=2))],
                         ids=["plus", "scale-0.1", "tanh", "prelu-7-slopes", "dilated"])
def test_blocks_the_recipe_does_not_take(block):
    """ESRGAN+'s 1x1 paths add after the activation, another residual scale
    is not the recipe's, nor an activation the kernels do not carry (or
    slopes that do not fit), nor a conv of another geometry."""
    assert not esrgan.RESIDUAL_DENSE.match(block())


def _swap(m, name, new):
    setattr(m, name, new)
    return m


def _compact(act="prelu", num_conv=3, feat=8, upscale=4):
    from bench.zoo import SRVGGNetCompact
    net = SRVGGNetCompact(feat, num_conv, upscale)
    if act != "prelu":
        for i in range(1, len(net.body) - 1, 2):
            net.body[i] = nn.ReLU(inplace=True) if act == "relu" else nn.LeakyReLU(0.1, inplace=True)
    return perturbed(net, 9, 0.1)


@pytest.mark.parametrize("act", ["prelu", "relu", "leakyrelu"])
@pytest.mark.parametrize("upscale", [4, 2])
def test_the_compact_net_against_its_own_forward(act, upscale, device, exact_fp32, monkeypatch):
    """Real-ESRGAN's SRVGGNetCompact (spandrel's ``act_type``s, x4 and x2),
    a batch of two: every conv with its activation in the epilogue, the
    activation modules never called."""
    net = _compact(act, upscale=upscale)
    ref = copy.deepcopy(net).double()
    report = conv_patch.apply(net)
    assert report.fused[""].startswith("esrgan.SRVGGNetCompact"), report.fused
    x = _input(3, n=2)
    expected = ref(x.double())
    net, x, tol = _on(device, net, x)
    refuse_fallback(monkeypatch, esrgan)
    for cls in (nn.PReLU, nn.ReLU, nn.LeakyReLU):
        monkeypatch.setattr(cls, "forward", lambda *a: pytest.fail("an activation ran as a module"))
    with torch.no_grad(), pack.graph_path():
        y = net(x)
        again = net(x)  # the replayed plans
    assert y.shape == (2, 3, 7 * upscale, 9 * upscale) and y.is_contiguous()
    assert rel_err(y, expected) <= tol
    assert torch.equal(again, y)
    # On a GPU a conv may route to cuDNN, its activation then in the
    # epilogue pass after it (the modules above still never ran).
    assert device.type != "cpu" or all(conv_patch.last_route(c).is_kernel for c in net.body
                                       if isinstance(c, nn.Conv2d))


class _ResidualSwitch(nn.Module):
    """A compact net whose forward has a switch of its own."""

    def forward(self, x):
        out = x
        for layer in self.body:
            out = layer(out)
        out = self.upsampler(out)
        if self.learn_residual:
            out = out + torch.nn.functional.interpolate(x, scale_factor=self.upscale, mode="nearest")
        return out


def _variant(net, name):
    cls = type("SRVGGNetCompact", (_ResidualSwitch,), {})
    new = cls.__new__(cls)
    new.__dict__.update(net.__dict__)
    new.learn_residual = False
    return new


@pytest.mark.parametrize("case", ["switch", "slopes", "tanh", "stride"])
def test_compact_nets_the_recipe_does_not_take(case):
    net = _compact()
    if case == "switch":
        net = _variant(net, "SRVGGNetCompact")
    elif case == "slopes":
        net.body[3] = nn.PReLU(5)
    elif case == "tanh":
        net.body[3] = nn.Tanh()
    else:
        net.body[2] = nn.Conv2d(8, 8, 3, 2, 1)
    assert not esrgan.COMPACT.match(net)


def test_what_the_compact_net_leaves_to_its_own_forward(exact_fp32):
    """A hook on a layer, autograd through the slopes: the net's own forward."""
    net = _compact()
    ref = copy.deepcopy(net).double()
    conv_patch.apply(net)
    seen = []
    handle = net.body[3].register_forward_hook(lambda m, a, o: seen.append(o.shape))
    x = _input(3)
    with torch.no_grad(), pack.graph_path():
        assert rel_err(net(x), ref(x.double())) <= TOL[torch.float32]
    assert seen == [(1, 8, 7, 9)]
    handle.remove()
    y = net(x)
    y.sum().backward()
    assert net.body[1].weight.grad is not None


@pytest.mark.parametrize("which", ["dense-block", "rrdb"])
def test_launched_eagerly_the_upscaler_blocks_run_fused(which, device, exact_fp32, monkeypatch):
    """Launched eagerly, off the graph path, a dense block and an RRDB run
    their recipes at every call (the NHWC buffers' channel slices read in
    place: measured faster than their own forwards, docs/performance.md)."""
    from bench.zoo import RRDB
    m = perturbed(NewArchBlock(12, 5) if which == "dense-block" else RRDB(12, 5), 2, 0.05)
    ref = copy.deepcopy(m).double()
    conv_patch.apply(m)
    x = _input(12)
    expected = ref(x.double())
    m, x, tol = _on(device, m, x)
    recipe = type(esrgan.RESIDUAL_DENSE if which == "dense-block" else esrgan.RRDB_RECIPE)
    calls = []
    real = recipe.forward
    monkeypatch.setattr(recipe, "forward", lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    with torch.no_grad():
        outs = [m(x) for _ in range(3)]
    assert len(calls) == 3 and all(rel_err(y, expected) <= tol for y in outs)


def test_an_rrdb_edited_after_its_first_call_is_read_again(device, exact_fp32):
    """The RRDB keeps its dense blocks between calls; a block replaced since
    (by one of another residual scale, which the recipe does not take) is
    seen: the RRDB's own forward runs, with the new block."""
    from bench.zoo import RRDB
    m = perturbed(RRDB(12, 5), 3, 0.05)
    new = perturbed(ResidualDenseBlock(12, 5), 9, 0.05)
    ref = copy.deepcopy(m)
    ref.RDB2 = copy.deepcopy(new)
    ref = ref.double()
    conv_patch.apply(m)
    x = _input(12)
    expected = ref(x.double())
    m, x, tol = _on(device, m, x)
    with torch.no_grad():
        m(x)
        m.RDB2 = new.to(x.device, x.dtype)
        y = m(x)
    assert rel_err(y, expected) <= tol


def test_a_dense_block_edited_after_its_first_call_is_read_again(device, exact_fp32):
    """The recipe keeps the block's parts between calls (``dense_parts`` at
    every call was a tenth of its host time); a part replaced since is seen:
    with a conv the recipe does not take, the block computes its own forward
    with the new conv (a stale plan would run the old one)."""
    block = perturbed(NewArchBlock(12, 5), 6, 0.05)
    ref = copy.deepcopy(block)
    conv_patch.apply(block)
    g = torch.Generator().manual_seed(3)
    new = nn.Conv2d(22, 5, 1)
    with torch.no_grad():
        new.weight.copy_(torch.randn(new.weight.shape, generator=g) * 0.2)
    ref.conv3 = copy.deepcopy(new)
    ref = ref.double()
    x = _input(12)
    expected = ref(x.double())
    block, x, tol = _on(device, block, x)
    with torch.no_grad(), pack.graph_path():
        block(x)
        block.conv3 = new.to(x.device, x.dtype)  # 1x1: not a dense block the recipe takes
        y = block(x)
    assert rel_err(y, expected) <= tol


def test_launched_eagerly_the_compact_net_runs_fused(device, exact_fp32, monkeypatch):
    """The compact net is no graphs-only block (measured faster fused
    launched): an eager call, off the graph path, runs the recipe at every
    call, its activations never as modules."""
    net = _compact(num_conv=4)
    ref = copy.deepcopy(net).double()
    conv_patch.apply(net)
    x = _input(3, n=2)
    expected = ref(x.double())
    net, x, tol = _on(device, net, x)
    calls = []
    real = type(esrgan.COMPACT).forward
    monkeypatch.setattr(type(esrgan.COMPACT), "forward",
                        lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    for cls in (nn.PReLU, nn.ReLU, nn.LeakyReLU):
        monkeypatch.setattr(cls, "forward", lambda *a: pytest.fail("an activation ran as a module"))
    with torch.no_grad():
        outs = [net(x) for _ in range(3)]
    assert len(calls) == 3 and all(rel_err(y, expected) <= tol for y in outs)


@pytest.mark.gpu
def test_the_compact_net_under_its_cuda_graphs():
    """``PatchConfig(cuda_graphs=True)``: the capture runs the recipe, the
    replay computes the net's answer."""
    net = _compact(feat=16).to("cuda", torch.float16)
    ref = copy.deepcopy(net).double()
    conv_patch.apply(net, config=conv_patch.PatchConfig(cuda_graphs=True))
    x = _input(3).to("cuda", torch.float16)
    with torch.no_grad():
        outs = [net(x).clone() for _ in range(3)]
    expected = ref(x.double())
    assert all(rel_err(o, expected) <= TOL[torch.float16] * 5 for o in outs)


def test_a_stack_holding_dense_blocks_runs_fused_launched(device, exact_fp32, monkeypatch):
    """spandrel's RRDB (one top-level Sequential over the dense blocks):
    launched eagerly the chain's recipe runs (in NHWC), the RRDBs' recipes
    under it, their dense blocks never called as modules."""
    from bench import zoo
    from conv_patch.recipes import common
    net = perturbed(zoo.rrdb_spandrel(True)[0], 7, 0.05)
    ref = copy.deepcopy(net).double()
    report = conv_patch.apply(net)
    assert report.fused[""].startswith("sequential_chain")
    x = _input(3)
    expected = ref(x.double())
    net, x, tol = _on(device, net, x)
    calls = []
    real = common.SequentialChain.forward
    monkeypatch.setattr(common.SequentialChain, "forward",
                        lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    monkeypatch.setattr(type(esrgan.RESIDUAL_DENSE), "forward", lambda *a, **k: pytest.fail("a dense block ran"))
    with torch.no_grad():
        outs = [net(x) for _ in range(2)]
    assert calls and all(rel_err(y, expected) <= tol for y in outs)


# -- lean forwards: the blocks' own forwards through fewer Python calls ------
def _refuse_module_calls(monkeypatch, *classes):
    for cls in classes:
        monkeypatch.setattr(cls, "forward", lambda *a, _c=cls, **k: pytest.fail(f"a {_c.__name__} ran as a module"))


def _lean_copy(block, lean):
    lean_block = copy.deepcopy(block)
    lean_block.__class__ = fuse.lean_class(type(block), lean)
    return lean_block


@pytest.mark.parametrize("form", ["new", "cna"])
def test_the_lean_dense_block_is_its_own_forward(form, monkeypatch):
    """Passed through, a dense block (both forms) runs ``LeanDenseBlock``:
    bit-equal to its own forward, its convs and activations never called as
    modules; a hooked conv is called as one; autograd runs the own forward."""
    if form == "new":
        block = NewArchBlock(12, 5)
    else:  # spandrel's block, as the zoo's spandrel RRDB net builds it
        from bench import zoo
        block = next(m for m in zoo.spandrel_rrdbnet(12, 1, 5).modules() if type(m).__name__ == "ResidualDenseBlock_5C")
    block = perturbed(block, 2, 0.05)
    assert esrgan.RESIDUAL_DENSE.lean_for(type(block)) is esrgan.LeanDenseBlock
    lean = _lean_copy(block, esrgan.LeanDenseBlock)
    x = _input(12)
    with torch.no_grad():
        ref = block(x)
        with monkeypatch.context() as mp:
            _refuse_module_calls(mp, nn.Conv2d, nn.LeakyReLU, nn.Sequential, type(block))
            y = lean(x)
        assert torch.equal(y, ref) and y.stride() == ref.stride()
        seen = []
        conv2 = lean.conv2[0] if form == "cna" else lean.conv2
        handle = conv2.register_forward_hook(lambda m, a, o: seen.append(o.shape))
        assert torch.equal(lean(x), ref) and seen == [(1, 5, 7, 9)]
        handle.remove()
    x.requires_grad_(True)
    y = lean(x)
    assert y.grad_fn is not None and torch.equal(y.detach(), ref)


def test_dense_blocks_written_otherwise_have_no_lean_forward():
    """A forward that reads ESRGAN+'s 1x1 path is not the one written out."""
    assert esrgan.RESIDUAL_DENSE.lean_for(ResidualDenseBlock_5C) is None


def test_a_patched_dense_block_runs_lean_when_launched_eagerly(device, exact_fp32, monkeypatch):
    """A dense block that is the model, run unfused (a rule saying so for
    its call, as an idle block's passthrough does): launched eagerly it
    runs its own forward, through ``LeanDenseBlock`` (the class it is
    passed through as, for the call), and keeps its patched class between
    calls."""
    monkeypatch.setattr(esrgan.RESIDUAL_DENSE, "unfused", lambda m, args, kwargs: (), raising=False)
    net = perturbed(NewArchBlock(12, 5), 4, 0.05)
    ref = copy.deepcopy(net).double()
    conv_patch.apply(net)
    patched = type(net)
    x = _input(12)
    expected = ref(x.double())
    net, x, tol = _on(device, net, x)
    calls = []
    real = esrgan.LeanDenseBlock.forward
    monkeypatch.setattr(esrgan.LeanDenseBlock, "forward",
                        lambda self, *a, **k: (calls.append(type(self)), real(self, *a, **k))[1])
    outs, counts = [], []
    with torch.no_grad():
        for _ in range(4):  # (the second call is the passthrough's watched one: its own forward)
            outs.append(net(x))
            counts.append(len(calls))
    assert counts == [1, 1, 2, 3] and all(c is not patched for c in calls) and type(net) is patched
    assert all(rel_err(y, expected) <= tol for y in outs)


def test_a_lean_call_that_raises_gives_the_patched_class_back(device, monkeypatch):
    monkeypatch.setattr(esrgan.RESIDUAL_DENSE, "unfused", lambda m, args, kwargs: (), raising=False)
    net = NewArchBlock(12, 5)
    conv_patch.apply(net)
    patched = type(net)
    net, x, _ = _on(device, net, _input(12))

    def boom(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(esrgan, "_chain", boom)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        net(x)
    assert type(net) is patched
