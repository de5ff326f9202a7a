"""diffusers VAE blocks: ``ResnetBlock2D``, ``Upsample2D``, ``Downsample2D``,
the ``Encoder``/``Decoder`` of ``AutoencoderKL`` (SD1.5, SDXL, SD3, FLUX.1)
and ``AutoencoderTinyBlock``. Matched by class name and structure."""

from __future__ import annotations

import torch

from conv_patch.target import target_for

from ._fuse import (Recipe, base, channels_last, conv, dropout_is_identity, group_norm, inference,
                    is_conv, is_group_norm, is_relu, is_silu, like_input, plain, register,
                    upsample_conv)


def _named(m, name: str) -> bool:
    return getattr(type(m), "_cp_base", type(m)).__name__ == name


class ResnetBlock2D(Recipe):
    """GroupNorm+SiLU in one pass each (the normalised tensor is written once
    and read by the conv), ``(shortcut + conv2(h)) / output_scale_factor`` in
    conv2's epilogue, the 1x1 shortcut as its own kernel."""

    name = "diffusers.ResnetBlock2D"
    what = "GroupNorm+SiLU, residual and 1/output_scale_factor in conv2's epilogue"

    def match(self, m):
        return (_named(m, "ResnetBlock2D") and is_group_norm(getattr(m, "norm1", None))
                and is_group_norm(getattr(m, "norm2", None)) and is_silu(getattr(m, "nonlinearity", None))
                and is_conv(getattr(m, "conv1", None), 3, 1, 1) and is_conv(getattr(m, "conv2", None), 3, 1, 1)
                and getattr(m, "upsample", 0) is None and getattr(m, "downsample", 0) is None
                # "default" and "group" (the VAE decoder's) compute the same
                # without a temb; "scale_shift" needs one.
                and getattr(m, "time_embedding_norm", None) in ("default", "group")
                and (getattr(m, "conv_shortcut", 0) is None or is_conv(m.conv_shortcut))
                and isinstance(getattr(m, "output_scale_factor", None), (int, float)))

    def forward(self, m, input_tensor, temb=None, *args, **kwargs):
        if (temb is not None or args or kwargs or input_tensor.dim() != 4 or not dropout_is_identity(m.dropout)
                or not inference(input_tensor, m.norm1, m.norm2, m.conv1, m.conv2, m.conv_shortcut)
                or not plain(m.norm1, m.norm2, m.nonlinearity, m.dropout)):
            return base(m, input_tensor, temb, *args, **kwargs)
        h = group_norm(m.norm1, input_tensor, "silu")
        h = conv(m.conv1, h)
        h = group_norm(m.norm2, h, "silu")
        shortcut = input_tensor if m.conv_shortcut is None else conv(m.conv_shortcut, input_tensor)
        return conv(m.conv2, h, residual=shortcut, out_scale=1.0 / m.output_scale_factor)


def _up_conv(m):
    return m.conv if getattr(m, "name", "conv") == "conv" else getattr(m, "Conv2d_0", None)


class Upsample2D(Recipe):
    """Nearest x2 then 3x3 conv as four 2x2 convs of the small input."""

    name = "diffusers.Upsample2D"
    what = "upsample folded into the conv"

    def match(self, m):
        return (_named(m, "Upsample2D") and getattr(m, "use_conv", False) and not getattr(m, "use_conv_transpose", True)
                and getattr(m, "interpolate", False) and getattr(m, "norm", 0) is None
                and is_conv(_up_conv(m), 3, 1, 1))

    def forward(self, m, hidden_states, output_size=None, *args, **kwargs):
        if output_size is not None or args or kwargs or hidden_states.dim() != 4:
            return base(m, hidden_states, output_size, *args, **kwargs)
        return upsample_conv(_up_conv(m), hidden_states)


class Downsample2D(Recipe):
    """``F.pad(x, (0, 1, 0, 1))`` then the stride-2 conv: the pad folded into
    the conv's bounds, no padded copy."""

    name = "diffusers.Downsample2D"
    what = "asymmetric pad folded into the stride-2 conv"

    def match(self, m):
        return (_named(m, "Downsample2D") and getattr(m, "use_conv", False) and getattr(m, "padding", 1) == 0
                and getattr(m, "norm", 0) is None and is_conv(getattr(m, "conv", None), 3, 2, 0))

    def forward(self, m, hidden_states, *args, **kwargs):
        if args or kwargs or hidden_states.dim() != 4:
            return base(m, hidden_states, *args, **kwargs)
        return conv(m.conv, hidden_states, padding=(0, 1, 0, 1))


class NHWCInside(Recipe):
    """The VAE encoder/decoder runs in NHWC (the kernels' native layout:
    in NCHW every conv would pay a staging copy, and cuDNN pays its own
    transposes); the input is converted once and the output handed back in
    the caller's layout."""

    what = "NHWC inside, caller's layout at the boundary"

    def __init__(self, name, cls_name, parts):
        self.name, self.cls_name, self.parts = name, cls_name, parts

    def match(self, m):
        return _named(m, self.cls_name) and all(hasattr(m, p) for p in self.parts)

    def forward(self, m, sample, *args, **kwargs):
        if not hasattr(sample, "dim") or sample.dim() != 4 or (
                not torch.compiler.is_compiling() and not target_for(sample.device).kernels):
            # Where no kernel can run (a CPU model), NHWC would only add copies.
            return base(m, sample, *args, **kwargs)
        # The block's own forward, fed NHWC: not a fallback.
        return like_input(m._cp_base.forward(m, channels_last(sample), *args, **kwargs), sample)


class TinyBlock(Recipe):
    """``fuse(conv(x) + skip(x))`` of AutoencoderTiny / TAESD: conv, act,
    conv, act, conv with the activations in the epilogues and the skip added
    and the final ReLU applied in the last conv's epilogue. TAEF2's
    ``x = x + pool(x)`` (1x1 conv, GroupNorm, ReLU, 1x1 conv) adds through
    the second 1x1 conv's epilogue."""

    what = "conv+activation epilogues, skip and ReLU in the last conv's epilogue"

    def __init__(self, name, cls_names):
        self.name, self.cls_names = name, cls_names

    def match(self, m):
        seq = getattr(m, "conv", None)
        if not any(_named(m, n) for n in self.cls_names) or seq is None or len(seq) != 5:
            return False
        c0, a0, c1, a1, c2 = list(seq)
        acts_ok = (is_relu(a0) or is_silu(a0)) and (is_relu(a1) or is_silu(a1))
        skip = getattr(m, "skip", None)
        skip_ok = type(skip).__name__ == "Identity" or is_conv(skip, 1, 1, 0)
        pool = getattr(m, "pool", None)
        pool_ok = pool is None or (len(pool) == 4 and is_conv(pool[0], 1, 1, 0) and is_group_norm(pool[1])
                                   and is_relu(pool[2]) and is_conv(pool[3], 1, 1, 0))
        return (acts_ok and skip_ok and pool_ok and is_relu(getattr(m, "fuse", None))
                and all(is_conv(c, 3, 1, 1) for c in (c0, c1, c2)))

    def forward(self, m, x):
        c0, a0, c1, a1, c2 = list(m.conv)
        pool = getattr(m, "pool", None)
        parts = [m.conv, a0, a1, m.fuse, m.skip] + (list(pool) + [pool] if pool is not None else [])
        if x.dim() != 4 or not plain(*parts) or not inference(x, c0, c1, c2, m.skip):
            return base(m, x)
        if pool is not None:
            p = conv(pool[0], x)
            p = group_norm(pool[1], p, "relu")
            x = conv(pool[3], p, residual=x)
        skip = x if type(m.skip).__name__ == "Identity" else conv(m.skip, x)
        h = conv(c0, x, activation="relu" if is_relu(a0) else "silu")
        h = conv(c1, h, activation="relu" if is_relu(a1) else "silu")
        return conv(c2, h, residual=skip, activation="relu")


RESNET = register(ResnetBlock2D())
UPSAMPLE = register(Upsample2D())
DOWNSAMPLE = register(Downsample2D())
DECODER = register(NHWCInside("diffusers.Decoder", "Decoder", ("conv_in", "mid_block", "up_blocks", "conv_out")))
ENCODER = register(NHWCInside("diffusers.Encoder", "Encoder", ("conv_in", "mid_block", "down_blocks", "conv_out")))
TINY_BLOCK = register(TinyBlock("tiny.Block", ("AutoencoderTinyBlock", "Block")))
