"""Every cache conv-patch keeps on a module or in the process (weight packs,
the folded upsample's weights, GroupNorm and Conv3d plans, band staging
buffers, CUDA graphs) serves calls in any mix of ``torch.inference_mode()``,
``torch.no_grad()`` and grad-enabled calls, in any order: each call computes
what the unpatched model computes, and the kept tensors are normal tensors
reused from call to call (a tensor made inside inference mode is one that a
later call outside it cannot refresh in place; ComfyUI decodes under
inference mode, a diffusers script under no_grad)."""

import contextlib
import copy
import itertools

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.runtime.state import state_of
from conv_patch.runtime.dispatch import subpixel_pays
from _util import rel_err

# "frozen": grad enabled, no parameter requiring grad (the kernels run);
# "grad": grad enabled and the parameters requiring it (the module's own
# forward runs, autograd records it).
MODES = ("inference", "no_grad", "frozen", "grad")


def de_bruijn(k: int, n: int = 2) -> list:
    """A cyclic sequence over range(k) holding every length-n word once."""
    a, seq = [0] * k * n, []

    def db(t, p):
        if t > n:
            if n % p == 0:
                seq.extend(a[1:p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, k):
                a[t] = j
                db(t + 1, t)
    db(1, 1)
    return seq


def every_transition(modes) -> list:
    """Modes in an order that passes from each mode to each (itself too)."""
    seq = de_bruijn(len(modes))
    return [modes[i] for i in seq + seq[:1]]


def test_the_order_holds_every_transition():
    order = every_transition(MODES)
    assert {(a, b) for a, b in zip(order, order[1:])} == set(itertools.product(MODES, MODES))


@contextlib.contextmanager
def mode(name, model):
    for p in model.parameters():
        p.requires_grad_(name == "grad")
    if name == "inference":
        with torch.inference_mode():
            yield
    elif name == "no_grad":
        with torch.no_grad():
            yield
    else:
        with torch.enable_grad():
            yield


# A user's table routing every 2-D conv to the portable kernel: on a GPU the
# packaged table and the cost model keep these small convs on cuDNN, which
# caches nothing (a user's table is the user's choice, not weighed).
KERNELS = conv_patch.PatchConfig(table={"conv2d": {"any": {"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16}}})


def run_every_mode(model, x, call, kept, modes=MODES, tol=1e-5, config=None):
    """``call(model, x)`` in every order of ``modes``, each result against
    the unpatched model's; ``kept(model)`` returns the tensors conv-patch
    keeps (checked to be normal tensors and the same objects every time),
    None for a kind that keeps none (its caller checks its plans)."""
    plain = copy.deepcopy(model)
    with torch.no_grad():
        ref = call(plain, x)
    conv_patch.apply(model, config=config)
    first = None
    for name in every_transition(modes):
        with mode(name, model):
            y = call(model, x)
        assert rel_err(y, ref) <= tol, name
        tensors = kept(model)
        if name != "grad" and tensors is not None:  # (autograd runs the module's own forward)
            assert tensors and all(isinstance(t, torch.Tensor) and not t.is_inference() for t in tensors), name
            if first is None:
                first = [t.data_ptr() for t in tensors]
            # Reused, never rebuilt: a refresh in place worked in this mode.
            assert [t.data_ptr() for t in tensors] == first, name
    return model


def _pack_of(m):
    entry = state_of(m).pack
    return [] if entry is None else [entry.buf]


def test_a_conv_weight_pack(exact_fp32, device):
    net = nn.Sequential(nn.Conv2d(5, 7, 3, padding=1)).to(device).eval()  # an NCHW weight: packed
    run_every_mode(net, torch.randn(2, 5, 9, 7, device=device), lambda m, x: m(x), lambda m: _pack_of(m[0]),
                   config=KERNELS)


def test_the_folded_upsample_weights(exact_fp32, device):
    # On a GPU the fold is taken from 4e9 multiply-adds a tap (costs.subpixel_pays).
    c, (h, w) = (8, (6, 5)) if device.type == "cpu" else (512, (128, 128))
    net = nn.Sequential(nn.Conv2d(4, c, 3, padding=1), nn.ReLU(), nn.Upsample(scale_factor=2),
                        nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 3, 3, padding=1)).to(device).eval()

    def kept(m):
        held = state_of(m[3]).subpixel
        return [] if held is None else [held[1]]
    x = torch.randn(1, 4, h, w, device=device)
    assert subpixel_pays(x, net[3].weight)
    run_every_mode(net, x, lambda m, t: m(t), kept, config=KERNELS)


def test_group_norm_plans(exact_fp32, device):
    # On a GPU the kernels take a GroupNorm from 4M elements (costs.group_norm_pays).
    groups, shape = (3, (2, 6, 5, 7)) if device.type == "cpu" else (8, (1, 64, 256, 257))
    net = nn.Sequential(nn.GroupNorm(groups, shape[1])).to(device).eval()
    norm = net[0]
    x = torch.randn(*shape, device=device) * 3 + 1
    plans = []

    def kept(m):
        p = state_of(norm).plans or {}
        plans.append([id(v) for v in p.values() if v.kernel])
        return None  # (a plan keeps no tensor: its recorded launches allocate afresh at each replay)
    from conv_patch.recipes import common
    assert not x.is_cuda or common.group_norm_pays(x.numel())
    run_every_mode(net, x, lambda m, t: m(t), kept)
    kernel_plans = [p for p in plans if p]
    assert kernel_plans and all(p == kernel_plans[0] for p in kernel_plans)  # one plan, reused in every mode


def test_conv3d_plans(exact_fp32, device):
    from conv_patch.routing import tables
    from conv_patch.specs import Conv3dSpec
    net = nn.Sequential(nn.Conv3d(3, 5, 3, padding=1)).to(device).eval()
    x = torch.randn(1, 3, 4, 6, 5, device=device)
    # On a GPU a Conv3d takes the kernel only where its table measured it
    # faster: a user's table that says so for this call.
    key = tables.conv3d_keys(Conv3dSpec.from_module(net[0]), tuple(x.shape), 0, "ncdhw", torch.float32)[0]
    tile = {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 1, "ours_ms": 1.0, "cudnn_ms": 2.0}
    config = conv_patch.PatchConfig(table={"schema": 1, "arch": "any", "conv3d": {"exact": {key: tile}}})
    plans = []

    def kept(m):
        p = state_of(m[0]).plans or {}
        plans.append(sorted(id(v) for v in p.values() if v.decision.is_kernel))
        return None
    run_every_mode(net, x, lambda m, t: m(t), kept, config=config)
    kernel_plans = [p for p in plans if p]
    assert kernel_plans and all(p == kernel_plans[0] for p in kernel_plans)


def test_bands_and_their_staging_buffers(exact_fp32, device):
    """A patched decode in two bands, the finished bands staged to host
    memory: the staging pool's buffers, kept for the next decode, stay
    usable in any mode (and the decode is the whole image's)."""
    diffusers = pytest.importorskip("diffusers")
    from conv_patch import parallel
    from conv_patch.parallel import staging
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
                                  norm_num_groups=4).to(device).eval()
    plain = copy.deepcopy(vae)
    z = torch.randn(1, 4, 4, 3, device=device)
    with torch.no_grad():
        ref = plain.decode(z).sample
    conv_patch.apply(vae)
    staging.release_host_staging()
    held = None
    for name in every_transition(("inference", "no_grad", "frozen")):
        with mode(name, vae):
            y, report = parallel.decode_in_bands(vae, z, bands=2, staged=True, return_report=True)
        assert rel_err(y, ref) <= 1e-5, name
        assert report.bands == 2 and report.staged, report
        pool = staging.pool_for(z.device)  # (cuda:0, as the bands' tensors say, not cuda)
        assert pool._all and not any(b.is_inference() for b in pool._all), name
        held = pool.held_bytes if held is None else held
        assert pool.held_bytes == held, name  # the buffers of the first decode, reused
    staging.release_host_staging()


@pytest.mark.gpu
def test_cuda_graphs_in_every_mode(exact_fp32):
    """CUDA graphs are captured per mode (the key holds it) and replayed in
    any order of calls."""
    from conv_patch.runtime import graphs
    from conv_patch.tools import taesd
    dec = taesd.seeded_(taesd.decoder()).cuda().eval().half()
    plain = copy.deepcopy(dec)
    z = torch.randn(1, 32, 16, 16, device="cuda", dtype=torch.half)
    with torch.no_grad():
        ref = plain(z)
    conv_patch.apply(dec, config=conv_patch.PatchConfig(cuda_graphs=True))
    for name in every_transition(("inference", "no_grad", "frozen")) * 2:
        with mode(name, dec):
            y = dec(z)
        assert rel_err(y, ref) <= 2e-2, name
    cache = graphs.cache_of(dec)
    assert cache.stats["replays"] > 0 and all(not s.is_inference() for g in cache.graphs.values()
                                               if g is not graphs._EAGER for s in g.static)
