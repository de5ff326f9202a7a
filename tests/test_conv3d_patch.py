"""Conv3d through ``conv_patch.apply``: plain ``nn.Conv3d`` and the causal
convs of Wan-family video VAEs wrapped, planned by ``dispatch.conv3d``
(routed by ``routing.decide``),
equal to the unpatched model; the cached frames and the causal padding read
in place; what the kernels do not take (groups, padding modes, autograd,
unknown subclasses, a GPU without measured conv3d entries) left to PyTorch
with the reason said. On the CPU the kernel runs under the interpreter."""

import copy
import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conv_patch
import math

from conv_patch.ops import conv3d as conv3d_op
from conv_patch.routing.decide import decide
from conv_patch.runtime import dispatch, planner
from conv_patch.routing.registry import Route
from conv_patch.specs import CallDesc, Conv3dSpec
from conv_patch.target import Target, interpreter_enabled
from conv_patch.runtime.wrappers import PatchedCausalConv3d, PatchedConv3d
from conv_patch.runtime.state import state_of
from conv_patch.runtime.plans import KernelFailureWarning
from _util import TOL, rel_err

diffusers = pytest.importorskip("diffusers")
SM90 = Target("sm90", True, sms=132)


# These tests run the kernels on CPU tensors, which only the interpreter
# does: on a CUDA machine (no TRITON_INTERPRET) they would time PyTorch.
needs_interpreter = pytest.mark.skipif(not interpreter_enabled(),
                                       reason="runs the kernels on CPU tensors: the interpreter's (a CUDA machine)")


def _decide3d(spec, x, w, b, cache, table, target=SM90):
    """The decision of a Conv3d call on ``target`` (a GPU faked: decisions
    only, nothing runs)."""
    shape = conv3d_op.output_shape(x, w, b, cache, spec.stride, spec.pads, spec.dilation)
    return decide(spec, CallDesc.of_call(x, w, b, cache=cache, out_numel=math.prod(shape)), target, table)


def _fake_target(monkeypatch, target):
    """Every Conv3d call of a patched module on ``target``."""
    for mod in (dispatch, planner):
        monkeypatch.setattr(mod, "target_for", lambda device: target)
from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock  # noqa: E402


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(3, 5, 3, padding=1), nn.SiLU(),
        nn.Conv3d(5, 7, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 0)),
        nn.Conv3d(7, 6, 3, padding="same", dilation=(2, 1, 1)),
        nn.Conv3d(6, 6, 3, groups=2, padding=1),
        nn.Conv3d(6, 4, 1, padding=(1, 0, 0), padding_mode="reflect"),
    ).eval()


@needs_interpreter
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_apply_patches_conv3d_and_matches_the_module(layout, exact_fp32):
    net = _net()
    ref64 = copy.deepcopy(net).double()
    report = conv_patch.apply(net)
    assert set(report.patched) == {"0", "2", "3"}
    assert report.skipped == {"4": "groups=2", "5": "padding_mode='reflect'"}
    assert report.patched["2"] == "conv3d_igemm  5->7 k1x3x3 s1x2x2 p0x1x0"
    x = torch.randn(2, 3, 5, 9, 11).contiguous(memory_format=layout)
    with torch.no_grad():
        for _ in range(2):  # planned, then found again
            y = net(x)
            assert rel_err(y, ref64(x.double())) <= TOL[torch.float32]
    for i in (0, 2, 3):
        assert state_of(net[i]).last.route is Route.CONV3D_IGEMM
        assert len(state_of(net[i]).plans) == 1
    assert "route=conv3d_igemm" in repr(net[0])
    keys = set(_net().state_dict())
    assert set(net.state_dict()) == keys
    restored = conv_patch.remove(net)
    assert restored == ["0", "2", "3"] and type(net[0]) is nn.Conv3d


@needs_interpreter
def test_epilogue_and_cache_of_a_plain_conv3d(exact_fp32):
    """The wrapper's extended call: cached frames in front of the input, a
    residual, an activation and a scale, in the kernel's epilogue."""
    torch.manual_seed(1)
    conv = nn.Conv3d(4, 6, 3, padding=(0, 1, 1))
    net = nn.Sequential(conv)
    conv_patch.apply(net)
    m = net[0]
    x, cache = torch.randn(1, 4, 3, 6, 7), torch.randn(1, 4, 2, 6, 7)
    res = torch.randn(1, 6, 3, 6, 7)
    with torch.no_grad():
        y = m(x, cache=cache, residual=res, beta=0.5, activation="silu", out_scale=2.0)
        full = F.conv3d(torch.cat([cache, x], 2).double(), conv.weight.double(), conv.bias.double(), 1, (0, 1, 1))
    assert state_of(m).last.route is Route.CONV3D_IGEMM
    assert rel_err(y, 2.0 * F.silu(full + 0.5 * res.double())) <= TOL[torch.float32]


@needs_interpreter
def test_wan_causal_convs_read_the_cache_and_padding_in_place(monkeypatch, exact_fp32):
    """A Wan residual block run in two chunks with its feature cache: every
    causal conv patched, the answer the unpatched block's, and no F.pad or
    concatenation of the conv inputs made (the block's own cache bookkeeping
    aside)."""
    torch.manual_seed(2)
    blk = WanResidualBlock(5, 7).eval()
    twin = copy.deepcopy(blk)
    report = conv_patch.apply(blk)
    assert set(report.patched) == {"conv1", "conv2", "conv_shortcut"}
    assert isinstance(blk.conv1, PatchedCausalConv3d) and isinstance(blk.conv1, type(twin.conv1))
    chunks = [torch.randn(1, 5, 1, 6, 7), torch.randn(1, 5, 2, 6, 7), torch.randn(1, 5, 3, 6, 7)]
    pads = []
    real_pad = F.pad
    monkeypatch.setattr(torch.nn.functional, "pad", lambda *a, **k: pads.append(1) or real_pad(*a, **k))
    seen = []
    real_conv3d = dispatch.conv3d
    monkeypatch.setattr(dispatch, "conv3d", lambda m, call: seen.append(call.cache is not None)
                        or real_conv3d(m, call))
    with torch.no_grad():
        caches, caches_ref = [None] * 2, [None] * 2
        for x in chunks:
            ref = twin(x, caches_ref, [0])
            pads_ref, pads[:] = len(pads), []
            y = blk(x, caches, [0])
            assert rel_err(y, ref) <= TOL[torch.float32]
            assert pads_ref > 0 and not pads
    assert seen[3:].count(True) == 4  # conv1 and conv2 of the later chunks read their caches
    assert state_of(blk.conv1).last.route is Route.CONV3D_IGEMM
    conv_patch.remove(blk)
    assert type(blk.conv1) is type(twin.conv1)


def test_tiny_wan_vae_decode_matches(exact_fp32):
    """A whole AutoencoderKLWan decode (its causal chunked decode, resample
    time convs included) patched: every conv patched, the unpatched answer."""
    torch.manual_seed(3)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                     temperal_downsample=[True], dropout=0.0).eval()
    twin = copy.deepcopy(vae)
    report = conv_patch.apply(vae)
    assert report.patched and not report.skipped
    assert sum(v.startswith("wan.ResidualBlock") for v in report.fused.values()) == 10
    z = torch.randn(1, 4, 2, 5, 6)
    with torch.no_grad():
        y, ref = vae.decode(z).sample, twin.decode(z).sample
    assert rel_err(y, ref) <= TOL[torch.float32]


@needs_interpreter
def test_what_the_kernel_does_not_take_runs_pytorch_and_says_why(monkeypatch):
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv3d(3, 4, 3, padding=1))
    twin = copy.deepcopy(net)
    conv_patch.apply(net)
    m = net[0]
    x = torch.randn(1, 3, 3, 5, 5)
    # Autograd: the kernels compute no backward.
    y = m(x)
    assert y.requires_grad and "autograd" in state_of(m).last.reason
    y.sum().backward()
    twin(x).sum().backward()
    assert rel_err(m.weight.grad, twin[0].weight.grad) <= TOL[torch.float32]
    with torch.no_grad():
        # float64: no kernel dtype.
        net.double(), twin.double()
        assert rel_err(m(x.double()), twin(x.double())) <= 1e-12
        assert "float64" in state_of(m).last.reason
        net.float(), twin.float()
        # A GPU target whose table measured no conv3d: cuDNN's conv3d runs.
        launched = []
        from conv_patch.kernels import conv3d as kernel_module
        monkeypatch.setattr(kernel_module, "launch_conv3d", lambda *a, **k: launched.append(1))
        _fake_target(monkeypatch, Target("sm80", True, sms=108))
        dispatch.clear(m)  # (the device's decision is kept with the plans)
        assert rel_err(m(x), twin(x)) <= TOL[torch.float32]
        assert not launched and state_of(m).last.route is Route.FALLBACK
        assert state_of(m).last.reason.startswith("no measured conv3d entries for sm80")
        # One that measured others (sm90's Wan decoder shapes): this shape is not among them, and
        # the cuDNN route runs it (the padding given to cuDNN, no F.pad copy).
        _fake_target(monkeypatch, SM90)
        dispatch.clear(m)
        assert rel_err(m(x), twin(x)) <= TOL[torch.float32]
        assert not launched and state_of(m).last.route is Route.CUDNN
        assert "not measured on sm90" in state_of(m).last.reason


@needs_interpreter
def test_a_kernel_that_fails_to_build_falls_back_once(monkeypatch, exact_fp32):
    from triton.runtime.errors import OutOfResources
    calls = []

    def no_room(*a, **k):
        calls.append(1)
        raise OutOfResources(262144, 232448, "shared memory")

    net = nn.Sequential(nn.Conv3d(3, 4, 3, padding=1))
    twin = copy.deepcopy(net)
    conv_patch.apply(net)
    from conv_patch.kernels import conv3d as kernel_module
    monkeypatch.setattr(kernel_module, "launch_conv3d", no_room)
    x = torch.randn(1, 3, 3, 5, 5)
    with torch.no_grad(), pytest.warns(KernelFailureWarning, match="OutOfResources"):
        y = net(x)
    with torch.no_grad():
        y2 = net(x)  # the plan remembers: no second attempt
    assert len(calls) == 1 and "OutOfResources" in state_of(net[0]).last.reason
    assert rel_err(y, twin(x)) <= TOL[torch.float32] and rel_err(y2, twin(x)) <= TOL[torch.float32]


class CausalConv3d(nn.Conv3d):
    """ComfyUI's Wan-VAE causal conv, the same contract under another name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._padding = (self.padding[2], self.padding[2], self.padding[1], self.padding[1], 2 * self.padding[0], 0)
        self.padding = (0, 0, 0)

    def forward(self, x, cache_x=None):
        padding = list(self._padding)
        if cache_x is not None and self._padding[4] > 0:
            x = torch.cat([cache_x, x], dim=2)
            padding[4] -= cache_x.shape[2]
        return super().forward(F.pad(x, padding))


class TimeShiftConv3d(nn.Conv3d):
    def forward(self, x, shift=0):
        return super().forward(torch.roll(x, shift, 2))


def test_causal_convs_recognised_by_structure_and_others_skipped(exact_fp32):
    torch.manual_seed(5)
    net = nn.ModuleDict({"causal": CausalConv3d(3, 4, 3, padding=1), "other": TimeShiftConv3d(3, 4, 1)})
    twin = copy.deepcopy(net)
    report = conv_patch.apply(net)
    assert list(report.patched) == ["causal"]
    assert "TimeShiftConv3d" in report.skipped["other"] and "contract is unknown" in report.skipped["other"]
    x, cache = torch.randn(1, 3, 2, 5, 6), torch.randn(1, 3, 1, 5, 6)
    with torch.no_grad():
        for c in (None, cache):
            assert rel_err(net["causal"](x, c), twin["causal"](x, c)) <= TOL[torch.float32]
        # More cached frames than padding: F.pad crops them; the module's own forward does that.
        long = torch.randn(1, 3, 3, 5, 6)
        assert rel_err(net["causal"](x, long), twin["causal"](x, long)) <= TOL[torch.float32]
    # Pickled and deep-copied like any wrapper (plans are this process's).
    clone = pickle.loads(pickle.dumps(net))
    assert isinstance(clone["causal"], PatchedConv3d) and state_of(clone["causal"]).plans is None
    with torch.no_grad():
        assert rel_err(clone["causal"](x, cache), twin["causal"](x, cache)) <= TOL[torch.float32]


class ShiftedSafeConv3d(nn.Conv3d):
    """Named like a time-chunked conv, but its forward takes another argument."""

    def forward(self, input, shift=0):
        return super().forward(torch.roll(input, shift, 2))


def test_time_chunked_convs_are_patched_by_their_contract(monkeypatch, exact_fp32):
    """CogVideoX's and Mochi's convs (``CogVideoXSafeConv3d``: nn.Conv3d's
    forward in chunks of frames above 2 GiB, inside ``CogVideoXCausalConv3d``
    with its time padding and ``conv_cache``) are patched and answer as the
    classes' own forwards on odd frame counts, with cached frames handed
    from call to call and with replicate padding; above the chunking size
    the class's own chunked forward runs. A look-alike whose forward takes
    more than the input stays skipped, with the reason."""
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d, CogVideoXSafeConv3d
    from conv_patch.runtime.wrappers import PatchedSafeConv3d
    torch.manual_seed(11)
    net = nn.ModuleDict({"causal": CogVideoXCausalConv3d(3, 5, 3), "rep": CogVideoXCausalConv3d(5, 4, 3, pad_mode="replicate"),
                         "safe": CogVideoXSafeConv3d(5, 6, (3, 1, 3), padding=(1, 0, 1)),
                         "other": ShiftedSafeConv3d(3, 4, 1)})
    twin = copy.deepcopy(net)
    report = conv_patch.apply(net)
    assert sorted(report.patched) == ["causal.conv", "rep.conv", "safe"], report
    assert "ShiftedSafeConv3d" in report.skipped["other"] and "contract is unknown" in report.skipped["other"]
    assert all(isinstance(net[k].conv, PatchedSafeConv3d) for k in ("causal", "rep"))
    x = torch.randn(1, 3, 5, 7, 9)
    with torch.no_grad():
        cache = ref_cache = None
        for frames in (5, 3, 1):  # the first chunk, then chunks after cached frames
            x = torch.randn(1, 3, frames, 7, 9)
            (y, cache), (r, ref_cache) = net["causal"](x, cache), twin["causal"](x, ref_cache)
            assert rel_err(y, r) <= TOL[torch.float32] and torch.equal(cache, ref_cache)
            assert rel_err(net["rep"](y)[0], twin["rep"](r)[0]) <= TOL[torch.float32]
            assert rel_err(net["safe"](y), twin["safe"](r)) <= TOL[torch.float32]
        if interpreter_enabled():
            assert state_of(net["safe"]).last.is_kernel, state_of(net["safe"]).last
        # Above the chunking size (made tiny here): the class's own chunked forward.
        monkeypatch.setattr(PatchedSafeConv3d, "CHUNKED_GIB", 1e-9)
        monkeypatch.setattr(dispatch, "conv3d", lambda *a, **k: pytest.fail("routed a chunked call"))
        assert rel_err(net["safe"](y), twin["safe"](r)) <= TOL[torch.float32]


@pytest.mark.parametrize("family", ["AutoencoderKLCogVideoX", "AutoencoderKLMochi"])
def test_cogvideox_and_mochi_decoders_patch_every_conv3d(family, exact_fp32):
    """Tiny CogVideoX and Mochi VAEs: every Conv3d patched (their
    time-chunked convs included), nothing skipped, and the decode of a latent
    with an odd frame count unchanged (the Conv3d kernel under the
    interpreter on the CPU)."""
    torch.manual_seed(2)
    cfg = (dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, norm_num_groups=4, layers_per_block=1)
           if family.endswith("CogVideoX") else
           dict(encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4, latent_channels=4,
                layers_per_block=(1,) * 5))
    vae = getattr(diffusers, family)(**cfg).eval()
    twin = copy.deepcopy(vae)
    report = conv_patch.apply(vae)
    convs = [n for n, m in twin.named_modules() if isinstance(m, nn.Conv3d)]
    assert convs and all(n in report.patched for n in convs) and not report.skipped, report
    # Their resnets fused (recipes/cogvideox.py, recipes/mochi.py).
    resnets = [n for n, m in twin.named_modules() if type(m).__name__.endswith("ResnetBlock3D")]
    assert resnets and all(report.fused[n].startswith(("cogvideox.", "mochi.")) for n in resnets)
    # (Mochi's decoder expands time 12x and space 8x: a smaller latent.)
    z = torch.randn((1, 4, 3, 2, 3) if family.endswith("CogVideoX") else (1, 4, 1, 2, 3))
    with torch.no_grad():
        assert rel_err(vae.decode(z).sample, twin.decode(z).sample) <= TOL[torch.float32]


@needs_interpreter
def test_a_gpu_takes_the_kernel_only_for_shapes_its_table_measured_faster(monkeypatch, exact_fp32):
    """On a GPU target the Conv3d kernel runs exactly the calls whose exact
    shape the table measured faster than the module's forward as called, with
    the measured tile; a shape measured slower (or a chunk of the same GEMM
    with its cached and padded frames traded), a shape never measured and a
    table without conv3d entries run PyTorch, each saying why."""
    from conv_patch.routing import tables as config_tables
    from conv_patch.api.patcher import PatchConfig
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
    _fake_target(monkeypatch, SM90)
    torch.manual_seed(6)
    conv = WanCausalConv3d(4, 6, 3, padding=1).eval()
    spec = Conv3dSpec.from_module(conv, ((2, 0), (1, 1), (1, 1)))
    x, cache = torch.randn(1, 4, 2, 5, 6), torch.randn(1, 4, 2, 5, 6)
    key = config_tables.conv3d_shape_key
    tile = {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 1}
    covered = dataclasses.replace(spec, pads=((0, 0), (1, 1), (1, 1)))  # two cached frames: no time padding
    table = {"schema": 1, "arch": "sm90", "conv3d": {"exact": {
        key(spec, (1, 4, 2, 5, 6), 0, "ncdhw", torch.float32): dict(tile, ours_ms=1.0, cudnn_ms=2.0),
        key(covered, (1, 4, 2, 5, 6), 2, "ncdhw", torch.float32): {"route": "cudnn", "ours_ms": 3.0, "cudnn_ms": 2.0},
    }}}
    twin = copy.deepcopy(conv)
    net = nn.ModuleDict({"c": conv})
    conv_patch.apply(net, config=PatchConfig(table=table))
    conv = net["c"]
    seen = []
    from conv_patch.kernels import conv3d as kernel_module
    real = kernel_module.launch_conv3d
    monkeypatch.setattr(kernel_module, "launch_conv3d", lambda *a, **k: seen.append(k["config"]) or real(*a, **k))
    with torch.no_grad():
        assert rel_err(conv(x), twin(x)) <= TOL[torch.float32]
        assert state_of(conv).last.route is Route.CONV3D_IGEMM and state_of(conv).last.tier == "exact"
        assert seen and seen[0]["BLOCK_M"] == 64
        assert rel_err(conv(x, cache), twin(x, cache)) <= TOL[torch.float32]
        assert state_of(conv).last.route is Route.CUDNN and "cuDNN measured faster" in state_of(conv).last.reason
        # One cached frame and one of padding: the same GEMM as two cached frames.
        assert rel_err(conv(x, cache[:, :, :1]), twin(x, cache[:, :, :1])) <= TOL[torch.float32]
        assert state_of(conv).last.route is Route.CUDNN and "cuDNN measured faster" in state_of(conv).last.reason
        narrow, narrow_cache = x[..., :5].contiguous(), cache[..., :5].contiguous()
        assert rel_err(conv(narrow, narrow_cache), twin(narrow, narrow_cache)) <= TOL[torch.float32]
        assert state_of(conv).last.route is Route.CUDNN and "not measured on sm90" in state_of(conv).last.reason
    assert len(seen) == 1
    # A table without conv3d entries: decided by the device alone.
    bare = nn.ModuleDict({"c": copy.deepcopy(twin)})
    conv_patch.apply(bare, config=PatchConfig(table={"schema": 1, "arch": "sm90"}))
    with torch.no_grad():
        bare["c"](x, cache)
    assert "no measured conv3d entries for sm90" in state_of(bare["c"]).last.reason


def test_conv3d_entries_weigh_the_kernel_against_the_cudnn_route(monkeypatch):
    """tune.measure_conv3d times the kernel's tiles against what the dispatch
    core runs where it does not take the kernel (conv3d.cudnn_conv3d), not
    against the module's slower own forward (timed beside it): a tile
    between the two is not the table's route."""
    from conv_patch.routing import registry as routes
    from conv_patch.tools import tune
    from conv_patch.target import target_for
    conv = nn.Conv3d(8, 8, 3, padding=(0, 1, 1))
    spec = Conv3dSpec.from_module(conv, ((2, 0), (1, 1), (1, 1)))
    x, cache = torch.randn(1, 8, 2, 5, 6), torch.randn(1, 8, 2, 5, 6)
    real_route = conv3d_op.cudnn_conv3d
    timed = []

    def route(*a, **k):
        timed.append("route")
        return real_route(*a, **k)

    def module_forward():
        timed.append("module")
        return conv3d_op.torch_conv3d(x, conv.weight, conv.bias, cache, spec.pads, spec.stride, spec.dilation)

    monkeypatch.setattr(conv3d_op, "cudnn_conv3d", route)

    def timer(fn):
        timed.clear()
        fn()
        return {"route": 1.0, "module": 3.0}.get(timed[-1] if timed else "", 2.0)

    cands = routes.tuner_candidates(target_for(x.device), "conv3d")[:1]
    with torch.no_grad():
        m = tune.measure_conv3d(spec, x, cache, conv.weight.detach(), conv.bias.detach(), module_forward, cands,
                                timer=timer)
    assert (m.cudnn_ms, m.module_ms) == (1.0, 3.0) and list(m.times.values()) == [2.0]
    assert tune.conv3d_entry(m)["route"] == "cudnn"


def test_merged_conv3d_entries_keep_the_table_and_say_they_extend_it():
    """``--write-table`` into an architecture's table: its other entries
    and its conv2d section stay, and the one-line source
    says this run extended an earlier table (it once replaced the line,
    leaving the H200 runs unsaid)."""
    from conv_patch.tools import tune
    entry = {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "ours_ms": 1.0, "cudnn_ms": 2.0}
    conv2d = {"exact": {"k2": dict(entry, ours_ms=3.0)}, "buckets": []}
    table = {"schema": 1, "arch": "sm90", "source": "earlier runs", "conv2d": conv2d,
             "conv3d": {"exact": {"old": entry}}}
    out = tune.merge_conv3d(table, [], "bench.video --layers, on an H100")
    assert out["source"] == "bench.video --layers, on an H100 Extends an earlier table of this GPU."
    assert out["conv3d"]["exact"] == {"old": entry} and out["conv2d"] == conv2d
    assert tune.merge_conv3d(dict(table, source=None), [], "first")["source"] == "first"


def test_conv3d_table_entries_are_validated():
    from conv_patch.routing import tables as config_tables
    good = {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "ours_ms": 1.0, "cudnn_ms": 2.0}
    config_tables.validate_table({"conv3d": {"exact": {"k": good}}}, "t")
    for bad, why in (({"conv3d": {"exact": {"k": dict(good, route="taps")}}}, "route must be one of igemm, tma, cudnn"),
                     ({"conv3d": {"exact": {"k": dict(good, ours_ms=None)}}}, "needs the measured ours_ms"),
                     ({"conv3d": {"any": good}}, "only an exact section"),
                     ({"conv3d": {"exact": {"k": dict(good, BLOCK_M=48)}}}, "BLOCK_M must be a power of two"),
                     ({"conv3d": {"exact": {"k": dict(good, BLOCK_N2=32)}}}, "BLOCK_N2 splits the output channels of"),
                     ({"conv3d": {"exact": {"k": dict(good, route="tma", BLOCK_N2=24)}}},
                      "BLOCK_N2 must be 0 or a power of two"),
                     ({"conv2d": {"any": dict(good, route="tma", BLOCK_N2=32)}}, "BLOCK_N2 splits the output channels of")):
        with pytest.raises(config_tables.TableError, match=why):
            config_tables.validate_table(bad, "t")
    config_tables.validate_table({"conv3d": {"exact": {"k": dict(good, route="tma", BLOCK_N2=32)}}}, "t")


def test_a_measured_tma_entry_takes_ndhwc_calls_it_can(monkeypatch):
    """(Decisions only: on the fake sm90 target the kernel is not run; the
    TMA kernel's answers are test_conv3d's.)"""
    from conv_patch.routing import tables as config_tables
    tile = {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_W": 8, "num_warps": 4,
            "num_stages": 1, "ours_ms": 1.0, "cudnn_ms": 2.0}
    for c_in, want in ((8, Route.CONV3D_TMA), (4, Route.CUDNN)):  # 4 fp16 channels: 8-byte rows
        spec = Conv3dSpec(c_in, 4, (3, 3, 3), (1, 1, 1), (1, 1, 1), ((2, 0), (1, 1), (1, 1)), 1, "zeros", True)
        x = torch.randn(1, c_in, 2, 5, 6, dtype=torch.float16).contiguous(memory_format=torch.channels_last_3d)
        w, b = torch.randn(4, c_in, 3, 3, 3, dtype=torch.float16), torch.randn(4, dtype=torch.float16)
        key = config_tables.conv3d_shape_key(spec, tuple(x.shape), 0, "ndhwc", torch.float16)
        table = config_tables.Table(config_tables.validate_table({"conv3d": {"exact": {key: tile}}}, "t"), "t")
        decision = _decide3d(spec, x, w, b, None, table)
        assert decision.route is want, decision
        if want is Route.CONV3D_TMA:
            assert decision.config["route"] == "tma" and decision.config["BLOCK_W"] == 8
        else:
            assert "cannot take this call" in decision.reason


def test_conv3d_cost_rule_counts_host_time_where_launched():
    from conv_patch.routing import costs
    # GPU-bound: the measured times decide, launched or replayed.
    assert costs.conv3d_choice(1.0, 2.0, 0, False).kernel and costs.conv3d_choice(1.0, 2.0, 0, True).kernel
    assert not costs.conv3d_choice(2.0, 2.0, 0, False).kernel
    # Host-bound: the module's forward is three launches (cat, pad, conv)
    # against the kernel's one, so a kernel slower on the GPU still wins
    # launched, and loses in a graph.
    assert costs.conv3d_choice(0.02, 0.012, 0, False).kernel
    assert not costs.conv3d_choice(0.02, 0.012, 0, True).kernel
    # The weight repack of the TMA route is host time too.
    cal = costs.default_calibration().with_host(unplanned=55.0)
    assert costs.conv3d_choice(0.02, 0.012, 0, False, cal=cal).kernel
    assert not costs.conv3d_choice(0.02, 0.012, 0, False, cal=cal, repack=True).kernel


def test_the_packaged_sm90_table_routes_a_wan_decoders_conv3d_as_measured(monkeypatch):
    """The H200's measured entries (bench.video --layers): a 1x1x1 shortcut
    and the few-channel first conv take the kernel, a wide 3x3x3 conv stays
    on cuDNN, an unmeasured shape runs PyTorch. (Decisions only: the fake
    sm90 target runs nothing.)"""
    from conv_patch.routing import tables as config_tables
    table = config_tables.packaged_table("sm90")
    causal = ((2, 0), (1, 1), (1, 1))
    cases = [  # (c_in, c_out, kernel, pads, (T, H, W), want)
        (192, 384, (1, 1, 1), ((0, 0),) * 3, (1, 120, 208), Route.CONV3D_IGEMM),
        (16, 384, (3, 3, 3), causal, (1, 60, 104), Route.CONV3D_IGEMM),
        (384, 384, (3, 3, 3), causal, (1, 60, 104), Route.CUDNN),
        (384, 384, (3, 3, 3), causal, (1, 60, 100), Route.CUDNN),  # not measured
    ]
    for c_in, c_out, k, pads, (t, h, w), want in cases:
        spec = Conv3dSpec(c_in, c_out, k, (1, 1, 1), (1, 1, 1), pads, 1, "zeros", True)
        x = torch.zeros(1, c_in, t, h, w, dtype=torch.bfloat16)
        wt, b = torch.zeros(c_out, c_in, *k, dtype=torch.bfloat16), torch.zeros(c_out, dtype=torch.bfloat16)
        decision = _decide3d(spec, x, wt, b, None, table)
        assert decision.route is want, (c_in, c_out, k, h, w, decision)
        if want is Route.CONV3D_IGEMM:
            assert decision.tier == "exact" and decision.config["route"] == "igemm"
        elif w == 104:
            assert "cuDNN measured faster" in decision.reason
        else:
            assert "not measured on sm90" in decision.reason


def test_a_steady_state_chunk_is_routed_by_the_measured_chunk_of_the_same_gemm(monkeypatch):
    """A causal conv's later chunks read two cached frames and no padding;
    the tuner's short clip measured the first chunk (two frames of padding)
    and the second (one cached, one padding): the same GEMM, so the
    measurement of those routes it. Keys with another sum of cached and
    padded frames are not looked at."""
    from conv_patch.routing import tables as config_tables
    table = config_tables.packaged_table("sm90")
    steady = ((0, 0), (1, 1), (1, 1))
    spec = Conv3dSpec(16, 384, (3, 3, 3), (1, 1, 1), (1, 1, 1), steady, 1, "zeros", True)
    keys = config_tables.conv3d_keys(spec, (1, 16, 1, 60, 104), 2, "ncdhw", torch.bfloat16)
    assert [k.split(".")[8:11] for k in keys] == [["p0x1x1", "d1x1x1", "cache2"], ["p1/0x1x1", "d1x1x1", "cache1"],
                                                 ["p2/0x1x1", "d1x1x1", "cache0"]]
    assert table.conv3d_exact(keys[0]) is None
    for c_in, want in ((16, Route.CONV3D_IGEMM), (384, Route.CUDNN)):
        spec = Conv3dSpec(c_in, 384, (3, 3, 3), (1, 1, 1), (1, 1, 1), steady, 1, "zeros", True)
        x = torch.zeros(1, c_in, 1, 60, 104, dtype=torch.bfloat16)
        cache = torch.zeros(1, c_in, 2, 60, 104, dtype=torch.bfloat16)
        wt, b = torch.zeros(384, c_in, 3, 3, 3, dtype=torch.bfloat16), torch.zeros(384, dtype=torch.bfloat16)
        decision = _decide3d(spec, x, wt, b, cache, table)
        assert decision.route is want, (c_in, decision)
        if want is Route.CUDNN:
            assert "cuDNN measured faster" in decision.reason
    # Three cached frames and no padding: no measured chunk reads three.
    x = torch.zeros(1, 16, 1, 60, 104, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 3, 60, 104, dtype=torch.bfloat16)
    wt, b = torch.zeros(384, 16, 3, 3, 3, dtype=torch.bfloat16), torch.zeros(384, dtype=torch.bfloat16)
    spec = Conv3dSpec(16, 384, (3, 3, 3), (1, 1, 1), (1, 1, 1), steady, 1, "zeros", True)
    decision = _decide3d(spec, x, wt, b, cache, table)
    assert decision.route is Route.CUDNN and "not measured on sm90" in decision.reason


@needs_interpreter
@pytest.mark.parametrize("family", ["AutoencoderKLHunyuanVideo", "AutoencoderKLCogVideoX"])
def test_video_vaes_group_norms_run_the_kernels(family, exact_fp32, monkeypatch):
    """HunyuanVideo's resnets and CogVideoX's (its decoder's spatial norm
    included) apply nn.GroupNorm to [N, C, T, H, W]: each runs the GroupNorm
    kernels on the 4-D view of its input, and the decode is unchanged."""
    from conv_patch.ops import group_norm as group_norm_op
    torch.manual_seed(3)
    cfg = dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, norm_num_groups=4, layers_per_block=1)
    if family.endswith("HunyuanVideo"):
        cfg.update(down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4)
    vae = getattr(diffusers, family)(**cfg).eval()
    twin = copy.deepcopy(vae)
    conv_patch.apply(vae)
    norms = {id(m) for m in vae.decoder.modules() if isinstance(m, nn.GroupNorm)}
    seen, launched = set(), []
    for m in vae.decoder.modules():
        if isinstance(m, nn.GroupNorm):
            m.register_forward_pre_hook(lambda mod, args: seen.add((id(mod), args[0].dim())))
    real = group_norm_op.kernels().launch_group_norm
    monkeypatch.setattr(group_norm_op.kernels(), "launch_group_norm",
                        lambda x, *a, **k: (launched.append(x.dim()), real(x, *a, **k))[1])
    z = torch.randn(1, 4, 3, 2, 3)
    with torch.no_grad():
        assert rel_err(vae.decode(z).sample, twin.decode(z).sample) <= TOL[torch.float32]
    five_d = [i for i, d in seen if d == 5]
    assert norms and five_d and len(launched) >= len(five_d) and set(launched) == {4}
