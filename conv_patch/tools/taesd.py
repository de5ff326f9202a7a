"""TAESD-format tiny autoencoders as plain ``nn.Sequential`` modules.

Their state-dict keys are the Sequential indices (``1.weight``,
``3.conv.0.weight``, ``3.pool.0.weight``), so the published
``taesd*/taef*_{encoder,decoder}.safetensors`` files load directly. The
package builds the embedded default model of ``convpatch verify`` from these.
"""

from __future__ import annotations

import torch
from torch import nn


def conv3(n_in: int, n_out: int, **kw) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, **kw)


class Clamp(nn.Module):
    """Soft latent clamp ``tanh(x / 3) * 3``."""

    def forward(self, x):
        return torch.tanh(x / 3) * 3


class Block(nn.Module):
    """``ReLU(conv(x) + skip(x))``, after ``x = x + pool(x)`` when ``pool``."""

    def __init__(self, n_in: int, n_out: int, pool: bool = False):
        super().__init__()
        self.conv = nn.Sequential(conv3(n_in, n_out), nn.ReLU(), conv3(n_out, n_out), nn.ReLU(),
                                  conv3(n_out, n_out))
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()
        self.pool = nn.Sequential(
            nn.Conv2d(n_in, 4 * n_in, 1, bias=False), nn.GroupNorm(4, 4 * n_in), nn.ReLU(),
            nn.Conv2d(4 * n_in, n_in, 1, bias=False)) if pool else None
        self.fuse = nn.ReLU()

    def forward(self, x):
        if self.pool is not None:
            x = x + self.pool(x)
        return self.fuse(self.conv(x) + self.skip(x))


def decoder(latent_channels: int = 32, channels: int = 64, pool: bool = True) -> nn.Sequential:
    """8x upsampling decoder (TAEF2 layout when pool=True, TAESD when False)."""
    c = channels
    return nn.Sequential(
        Clamp(), conv3(latent_channels, c), nn.ReLU(),
        Block(c, c, pool), Block(c, c, pool), Block(c, c, pool),
        nn.Upsample(scale_factor=2), conv3(c, c, bias=False),
        Block(c, c), Block(c, c), Block(c, c),
        nn.Upsample(scale_factor=2), conv3(c, c, bias=False),
        Block(c, c), Block(c, c), Block(c, c),
        nn.Upsample(scale_factor=2), conv3(c, c, bias=False),
        Block(c, c), conv3(c, 3),
    )


def encoder(latent_channels: int = 32, channels: int = 64, pool: bool = True) -> nn.Sequential:
    """8x downsampling encoder (TAEF2 layout when pool=True)."""
    c = channels
    return nn.Sequential(
        conv3(3, c), Block(c, c),
        conv3(c, c, stride=2, bias=False), Block(c, c), Block(c, c), Block(c, c),
        conv3(c, c, stride=2, bias=False), Block(c, c), Block(c, c), Block(c, c),
        conv3(c, c, stride=2, bias=False), Block(c, c, pool), Block(c, c, pool), Block(c, c, pool),
        conv3(c, latent_channels),
    )


def from_plan(plan) -> nn.Sequential:
    """A Sequential from a layer list as conv_patch.tools.formats.taesd_plan reads
    one off a checkpoint: ("conv", c_in, c_out, k, stride, bias),
    ("block", c_in, c_out, pool), ("clamp",), ("relu",), ("upsample",)."""
    layers = []
    for p in plan:
        if p[0] == "conv":
            _, c_in, c_out, k, stride, bias = p
            layers.append(nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=bias))
        elif p[0] == "block":
            layers.append(Block(p[1], p[2], p[3]))
        elif p[0] == "clamp":
            layers.append(Clamp())
        elif p[0] == "relu":
            layers.append(nn.ReLU())
        elif p[0] == "upsample":
            layers.append(nn.Upsample(scale_factor=2))
        else:
            raise ValueError(f"unknown TAESD layer {p!r}")
    return nn.Sequential(*layers)


def seeded_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter with seeded values of a trained net's scale
    (fan-in scaled normals), so the embedded default computes something
    non-trivial without shipping weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / fan_in) ** 0.5)
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        for m in model.modules():
            if isinstance(m, nn.PReLU):
                # A PReLU's weight is its negative slope, not a scale: near
                # 1 the net is almost linear and He-scaled convs grow its
                # activations ~1.4x a layer (fp16 overflows within 30).
                m.weight.copy_(0.25 + 0.05 * torch.randn(m.weight.shape, generator=g))
    return model
