"""ESRGAN's residual dense block (recipes/esrgan.py) against the block's own
forward in float64: its new-arch form (the zoo's, basicsr's) and the
old-arch "CNA" form spandrel (and so ComfyUI) builds, one image in NCHW
through one buffer's channel prefixes, with the block's own forward made
to fail; a batch, an NHWC input, hooks, ESRGAN+'s ``plus`` paths and
another residual scale stay the block's own."""

import copy

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.recipes import esrgan
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


def _input(nf, n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, nf, 7, 9, generator=g) + 3.0  # a large mean
    x[0, 1, 3, 4] = 40.0  # and an outlier
    return x


@pytest.mark.parametrize("form", ["new-arch", "old-arch"])
def test_the_dense_block_against_its_own_forward(form, exact_fp32, monkeypatch):
    nf, gc = 12, 5  # channels no multiple of 8
    block = perturbed(NewArchBlock(nf, gc) if form == "new-arch" else ResidualDenseBlock_5C(nf, gc), 3, 0.05)
    ref = copy.deepcopy(block).double()
    report = conv_patch.apply(block)
    assert report.fused[""].startswith("esrgan.ResidualDenseBlock"), report.fused
    refuse_fallback(monkeypatch, esrgan)
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: (cats.append(1), real_cat(*a, **k))[1])
    x = _input(nf)
    with torch.no_grad():
        y = block(x)
    assert not cats  # the channel prefixes were read in place
    assert rel_err(y, ref(x.double())) <= TOL[torch.float32]


@pytest.mark.parametrize("case", ["batch", "nhwc", "hook"])
def test_what_the_dense_block_leaves_to_its_own_forward(case, exact_fp32):
    nf, gc = 12, 5
    block = perturbed(NewArchBlock(nf, gc), 4, 0.05)
    ref = copy.deepcopy(block).double()
    conv_patch.apply(block)
    x = _input(nf, n=2 if case == "batch" else 1)
    if case == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    seen = []
    if case == "hook":
        block.conv3.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    own = []
    real_base = esrgan.base
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(esrgan, "base", lambda m, *a, **k: (own.append(1), real_base(m, *a, **k))[1])
        with torch.no_grad():
            y = block(x)
    assert own and rel_err(y, ref(x.double())) <= TOL[torch.float32]
    assert case != "hook" or seen == [(1, gc, 7, 9)]


@pytest.mark.parametrize("block", [lambda: ResidualDenseBlock_5C(12, 5, plus=True), lambda: ResidualDenseBlock(12, 5),
                                   lambda: _swap(NewArchBlock(12, 5), "lrelu", nn.SiLU()),
                                   lambda: _swap(NewArchBlock(12, 5), "conv3", nn.Conv2d(22, 5, 3, 1, 2, dilation=2))],
                         ids=["plus", "scale-0.1", "silu", "dilated"])
def test_blocks_the_recipe_does_not_take(block):
    """ESRGAN+'s 1x1 paths add after the activation, another residual scale
    is not the recipe's, nor an activation the kernels do not carry, nor a
    conv of another geometry."""
    assert not esrgan.RESIDUAL_DENSE.match(block())


def _swap(m, name, new):
    setattr(m, name, new)
    return m
