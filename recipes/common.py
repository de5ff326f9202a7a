"""Recipes that are not tied to one model family: every GroupNorm, and the
conv/activation/upsample chains of plain ``nn.Sequential`` stacks (the TAESD
decoders and encoders are such stacks)."""

from __future__ import annotations

import torch
from torch import nn

from conv_patch.runtime import dispatch, pack, passthrough
from conv_patch.runtime.state import peek, state_of
from conv_patch.routing.costs import group_norm_pays

from .fuse import (Recipe, base, channels_last, conv, epilogue_activation, group_norm, inference, is_conv,
                   is_fused, is_group_norm, like_input, norm_is_eager, plain, register, swaps_below, upsample_conv)


class GroupNormRecipe(Recipe):
    """Any ``nn.GroupNorm`` on 4-D inputs, and on dense 5-D ones (a video
    VAE's, as their 4-D view: ``ops.group_norm.as_4d``): PyTorch's kernel
    spends 45 of an 86 ms FLUX decode on GroupNorm's moments; this one reads
    the input twice (split fp32 statistics, then normalise) in its own
    layout."""

    name = "group_norm"
    what = "GroupNorm kernel"
    runs_convs = False

    def match(self, m):
        return is_group_norm(m)

    def forward(self, m, x):
        if (x.dim() not in (4, 5) or (x.is_cuda and not group_norm_pays(x.numel(), x.shape[0] * m.num_groups))
                or not inference(x, m)):
            # Small on a GPU: PyTorch's own GroupNorm is faster.
            return dispatch.own_group_norm(m, x)
        return group_norm(m, x)


def _act(m):
    """The activations a Sequential chain takes into its convs' epilogues:
    ReLU and SiLU (the TAESD stacks'); a LeakyReLU or PReLU chain (spandrel's
    whole ESRGAN nets are such Sequentials) is left to the model's own
    layers, its NHWC run unmeasured."""
    act = epilogue_activation(m)
    return act if act in ("relu", "silu") else None


# nn.Upsample subclasses that upsample an fp32 copy and cast back (the
# Wan-family VAEs'): nearest upsampling copies values, so the same result.
UPCASTING_UPSAMPLES = ("WanUpsample", "QwenImageUpsample")


def _upsample2x(m) -> bool:
    """Nearest x2 upsampling; "nearest-exact" picks the same source pixels
    at exactly 2x (floor((i + 0.5) / 2) == floor(i / 2))."""
    return ((type(m) is nn.Upsample or (isinstance(m, nn.Upsample) and type(m).__name__ in UPCASTING_UPSAMPLES))
            and m.mode in ("nearest", "nearest-exact") and m.size is None
            and m.scale_factor in (2, 2.0, (2, 2), (2.0, 2.0)) and not m.recompute_scale_factor)


def chain_plan(children):
    """(kind, modules) steps: ("conv", conv, act_name|None) for a conv and the
    activation after it, ("upconv", conv, act) for nearest x2 upsampling, a
    3x3 conv and its activation, ("module", m) for anything else."""
    steps, i = [], 0
    while i < len(children):
        m = children[i]
        nxt = children[i + 1] if i + 1 < len(children) else None
        if _upsample2x(m) and is_conv(nxt, 3, 1, 1):
            after = children[i + 2] if i + 2 < len(children) else None
            act = _act(after)
            steps.append(("upconv", nxt, act))
            i += 3 if act else 2
        elif is_conv(m) and _act(nxt):
            steps.append(("conv", m, _act(nxt)))
            i += 2
        else:
            steps.append(("module", m, None))
            i += 1
    return steps


def _group_norm_channels(m) -> tuple:
    """(channels, groups) of the GroupNorm below ``m`` with the fewest
    channels per group, the one PyTorch's kernel is likeliest to take
    (``costs.group_norm_pays``); (0, 0): none."""
    fewest = (0, 0)
    for c in m.modules():  # (a loop: torch.compile traces this at the stack's first call)
        if isinstance(c, nn.GroupNorm) and (fewest[0] == 0 or c.num_channels * fewest[1] < fewest[0] * c.num_groups):
            fewest = (c.num_channels, c.num_groups)
    return fewest


def _has_convs(m, n: int) -> bool:
    """At least ``n`` convolutions anywhere below ``m``; stops at the n-th
    (this runs at every call of a fused Sequential)."""
    found = 0
    for c in m.modules():
        found += isinstance(c, nn.Conv2d)
        if found >= n:
            return True
    return False


def _norms_eager(x: torch.Tensor, gn: tuple) -> bool:
    """Whether a stack's GroupNorms (``gn``: ``_group_norm_channels``) run
    as PyTorch's on a stack input ``x``, judged at its resolution."""
    channels, groups = gn
    return bool(channels) and norm_is_eager(x, x.numel() // max(x.shape[1], 1) * channels, groups)


class SequentialChain(Recipe):
    """``nn.Sequential`` stacks: each conv with the ReLU/SiLU after it is one
    kernel with the activation in its epilogue; nearest x2 upsampling followed
    by a 3x3 conv becomes four 2x2 convs of the un-upsampled input. A stack
    with 3 or more convolutions runs in NHWC inside (the kernels' native
    layout) and returns its output in the input's layout. Where a GroupNorm
    inside it would run as PyTorch's (``norm_is_eager``, judged on its
    channels at the stack's input resolution: TAEF2's pooled blocks at
    256^2 and 512^2), the call is host-bound and the recipes measured slower
    than none: the stack then runs unfused (``unfused``); on the graph path
    and inside torch.compile, where host time is not the cost, it runs its
    recipes in NCHW there (PyTorch's GroupNorm hands an NHWC input back in
    NCHW: the layouts would change back and forth inside;
    docs/performance.md)."""

    name = "sequential_chain"
    what = "conv+activation epilogues, upsample folded into the conv"

    def match(self, m):
        return type(m) is nn.Sequential and any(k != "module" for k, _, _ in chain_plan(list(m)))

    def forward(self, m, x):
        children = tuple(m.__dict__["_modules"].values())
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not plain(*children):
            return base(m, x)
        # The plan and the layout choice are the children's: kept until one
        # is replaced, added or removed (the upsample steps' conv geometry,
        # which the fold relies on, is checked again at every call).
        st = state_of(m)
        held = st.chain
        if held is None or held[0] != children:
            held = st.chain = (children, chain_plan(list(children)), _has_convs(m, 3), _group_norm_channels(m))
        _, steps, many_convs, gn_channels = held
        if any(kind == "upconv" and not is_conv(mod, 3, 1, 1) for kind, mod, _ in steps):
            return base(m, x)
        nhwc = many_convs and not _norms_eager(x, gn_channels)
        y = channels_last(x) if nhwc else x
        for kind, mod, act in steps:
            if kind == "conv":
                y = conv(mod, y, activation=act)
            elif kind == "upconv":
                y = upsample_conv(mod, y, activation=act or "none")
            else:
                y = mod(y)
        return like_input(y, x)

    def unfused(self, m, args, kwargs):
        """Where the stack's GroupNorms run as PyTorch's, the whole stack as
        its own class, with the fused blocks under it as theirs: measured
        faster on TAEF2's 256^2 and 512^2 decodes than the stack run in NCHW
        with its recipes (docs/performance.md). Not on the graph path nor
        inside torch.compile, where host time is not the cost, nor before
        the stack's first call has made its plan (nor, ``FusedBlock``'s
        rule, for a call its CUDA graphs capture or replay)."""
        st = peek(m)
        held = None if st is None else st.chain
        if held is None or kwargs or len(args) != 1 or pack.GRAPH_PATH:
            return None
        x = args[0]
        if (not isinstance(x, torch.Tensor) or x.dim() != 4 or not _norms_eager(x, held[3])
                or st.bands is not None or torch.compiler.is_compiling()):
            return None
        return swaps_below(m, held)

    def upsample_convs(self, m):
        return tuple(mod for kind, mod, _ in chain_plan(list(m)) if kind == "upconv")

    def auto_graphs(self, m):
        """A stack of host-bound blocks (a TAESD decoder, AutoencoderTiny's
        decoder ``layers``) is host-bound itself."""
        return any(getattr(getattr(c, "cp_recipe", None), "host_bound", False)
                   for c in m.__dict__["_modules"].values())


GROUP_NORM = register(GroupNormRecipe())
SEQUENTIAL = register(SequentialChain())
