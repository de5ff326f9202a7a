"""diffusers VAE blocks: ``ResnetBlock2D``, ``Upsample2D``, ``Downsample2D``,
the mid-block ``Attention``, the ``Encoder``/``Decoder`` of ``AutoencoderKL``
(SD1.5, SDXL, SD3, FLUX.1) and ``AutoencoderTinyBlock``. Matched by class
name and structure."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.ops.conv2d import output_shape
from conv_patch.runtime.state import peek
from conv_patch.specs import ConvSpec
from conv_patch.target import target_for

from .layers import Conv, Layers, NormConv, Resnet, Up, Whole, need, own_pad, plus
from .fuse import (Recipe, adds_into, attention, bare, bare_conv, base, channels_last, conv, conv_of,
                   dropout_is_identity, from_tokens, global_hooks, group_norm, hookless, inference, inline_chain,
                   inline_step, is_conv, is_group_norm, is_relu, is_silu, launched_on_gpu, like_input, matches, named,
                   norm_conv, parts, plain, register, resnet, spatial_norm_parts, sum_into, swaps_below, to_tokens,
                   upsample_conv, written_out)


class LeanResnet:
    """``ResnetBlock2D.forward`` for a block passed through
    (``Recipe.lean``): the same ops in the same order on the same values,
    without the module calls of its plain parts (bare PyTorch modules: the
    functions their forwards call), the dropout that is the identity in
    eval, the division by an ``output_scale_factor`` of 1, or new tensors
    for sums and activations that can be written in place. Only where no
    gradient is recorded (an in-place activation would hide its input from
    autograd) and for the block as diffusers builds it; any other call runs
    the class's own forward."""

    def forward(self, input_tensor, temb=None, *args, **kwargs):
        d = self.__dict__
        mods = d["_modules"]
        n1, n2, act, drop = mods.get("norm1"), mods.get("norm2"), mods.get("nonlinearity"), mods.get("dropout")
        c1, c2, sc, proj = mods.get("conv1"), mods.get("conv2"), mods.get("conv_shortcut"), mods.get("time_emb_proj")
        if (args or kwargs or torch.is_grad_enabled() or d.get("training", True) or d.get("upsample", 0) is not None
                or d.get("downsample", 0) is not None or d.get("time_embedding_norm") != "default"
                or not isinstance(input_tensor, torch.Tensor) or (proj is not None and temb is None) or global_hooks()
                or not (bare(n1, nn.GroupNorm) and bare(n2, nn.GroupNorm) and bare(act, nn.SiLU) and not act.inplace
                        and bare(drop, nn.Dropout) and not drop.training and bare_conv(c1) and bare_conv(c2)
                        and (sc is None or bare_conv(sc)) and (proj is None or bare(proj, nn.Linear)))):
            return super().forward(input_tensor, temb, *args, **kwargs)
        # Every tensor below is made here (functions, not modules that might
        # hand back one they hold), so the in-place steps touch nothing else.
        p1, p2 = n1._parameters, n2._parameters  # (``n1.weight`` goes through ``Module.__getattr__``)
        h = F.silu(F.group_norm(input_tensor, n1.num_groups, p1.get("weight"), p1.get("bias"), n1.eps), inplace=True)
        h = conv_of(c1, h)
        if proj is not None:
            p = proj._parameters
            temb = F.linear(temb if d.get("skip_time_act") else F.silu(temb), p["weight"], p["bias"])[:, :, None, None]
        if temb is not None:
            h = sum_into(h, True, temb)
        h = F.silu(F.group_norm(h, n2.num_groups, p2.get("weight"), p2.get("bias"), n2.eps), inplace=True)
        h = conv_of(c2, h)
        x = input_tensor if sc is None else conv_of(sc, input_tensor)
        # (In diffusers' order where not in place: the sum's layout follows
        # its first operand where the two differ, as on a GPU, whose
        # GroupNorm hands a channels_last input back contiguous.)
        h = h.add_(x) if adds_into(h, x) else x + h
        scale = d["output_scale_factor"]
        return h if scale == 1 else h / scale


class ResnetBlock2D(Recipe):
    """GroupNorm+SiLU in one pass each (the normalised tensor is written once
    and read by the conv), ``(shortcut + conv2(h)) / output_scale_factor`` in
    conv2's epilogue, the 1x1 shortcut as its own kernel; a UNet's time
    embedding (``time_embedding_norm="default"``) added in conv1's epilogue."""

    name = "diffusers.ResnetBlock2D"
    what = "GroupNorm+SiLU, time embedding in conv1's epilogue, residual and 1/output_scale_factor in conv2's"
    lean = LeanResnet

    def match(self, m):
        return (named(m, "ResnetBlock2D") and is_group_norm(getattr(m, "norm1", None))
                and is_group_norm(getattr(m, "norm2", None)) and is_silu(getattr(m, "nonlinearity", None))
                and is_conv(getattr(m, "conv1", None), 3, 1, 1) and is_conv(getattr(m, "conv2", None), 3, 1, 1)
                and getattr(m, "upsample", 0) is None and getattr(m, "downsample", 0) is None
                # "default" and "group" (the VAE decoder's) compute the same
                # without a temb; "scale_shift" needs one.
                and getattr(m, "time_embedding_norm", None) in ("default", "group")
                and (getattr(m, "conv_shortcut", 0) is None or is_conv(m.conv_shortcut))
                and isinstance(getattr(m, "output_scale_factor", None), (int, float)))

    def unfused(self, m, args, kwargs):
        """A UNet's block (called with a time embedding) launched eagerly on
        a GPU: its own forward, the GroupNorms under it as their own
        classes. A UNet at its usual sizes is host-bound launched (its GPU
        work about half its call), so the GroupNorm kernels' launches, which
        save GPU time from 4M elements, add host time there, and the
        recipe's conv steps run PyTorch's convolutions through more Python:
        measured slower than the block's own forward
        (docs/performance.md). On the graph path, in a call its own graphs
        capture or replay (``FusedBlock``'s rule) and under torch.compile
        host time is not the cost: there
        the recipe runs, as it does on the CPU (the interpreter's tests) and
        in a VAE's blocks (no time embedding)."""
        temb = args[1] if len(args) > 1 else kwargs.get("temb")
        x = args[0] if args else kwargs.get("input_tensor")
        if (temb is None or not isinstance(x, torch.Tensor) or not launched_on_gpu(x)
                or torch.compiler.is_compiling()):
            return None
        st = peek(m)
        if st is not None and st.bands is not None:
            return None
        return swaps_below(m, tuple(m._modules.values()))

    def forward(self, m, input_tensor, temb=None, *args, **kwargs):
        norm1, norm2, conv1, conv2, sc, act, drop, proj = parts(
            m, "norm1", "norm2", "conv1", "conv2", "conv_shortcut", "nonlinearity", "dropout", "time_emb_proj")
        if (args or kwargs or input_tensor.dim() != 4 or not dropout_is_identity(drop)
                or not inference(input_tensor, norm1, norm2, conv1, conv2, sc)
                or not plain(norm1, norm2, act, drop)):
            return base(m, input_tensor, temb, *args, **kwargs)
        shift = None
        if temb is not None:
            # A UNet's block: the projected time embedding is added to
            # conv1's output per (sample, channel), in conv1's epilogue.
            if (m.time_embedding_norm != "default" or type(proj) is not nn.Linear or temb.dim() != 2
                    or temb.dtype != input_tensor.dtype or not plain(proj) or not inference(temb, proj)):
                return base(m, input_tensor, temb, *args, **kwargs)
            t = temb if m.__dict__.get("skip_time_act", False) else act(temb)
            shift = F.linear(t, proj.weight, proj.bias)[:, :, None, None]
            if shift.shape[0] != input_tensor.shape[0] or shift.shape[1] != conv1.out_channels:
                return base(m, input_tensor, temb, *args, **kwargs)
        return resnet(input_tensor, norm1, conv1, norm2, conv2, sc, 1.0 / m.output_scale_factor, shift)


def _spatial_norm_parts(m):
    """(norm_layer, conv_y, conv_b) of a ``SpatialNorm`` (MoVQ's, Kandinsky's),
    or None."""
    return spatial_norm_parts(m, "SpatialNorm", lambda c: is_conv(c, 1))


def spatial_norm(sn: tuple, f: torch.Tensor, zq: torch.Tensor, activation: str = "none") -> torch.Tensor:
    """``act(m(f, zq))`` for a ``SpatialNorm`` of parts ``sn``: its
    modulation (the two 1x1 convs of ``zq`` resized to ``f``'s pixels) and
    the activation in the GroupNorm's pass, so that neither the normalised
    tensor nor the product is written."""
    gn, conv_y, conv_b = sn
    z = F.interpolate(zq, size=f.shape[-2:], mode="nearest")
    if not f.is_contiguous() and f.is_contiguous(memory_format=torch.channels_last):
        # The modulation in the norm's layout (the convs' outputs follow
        # their input's), which its kernels need: a few channels to copy.
        z = z.contiguous(memory_format=torch.channels_last)
    return group_norm(gn, f, activation, modulation=(conv(conv_y, z), conv(conv_b, z)))


def _spatial_norm_ok(m, sn: tuple, f, zq) -> bool:
    """A call the fused spatial norm ``m`` (parts ``sn``) takes: 4-D tensors
    of one batch, nothing recording a gradient, no hook on its parts."""
    return (isinstance(zq, torch.Tensor) and f.dim() == 4 and zq.dim() == 4 and zq.shape[0] == f.shape[0]
            and inference(f, *sn) and not (torch.is_grad_enabled() and zq.requires_grad) and plain(m, *sn))


class SpatialNorm(Recipe):
    """``GroupNorm(f) * conv_y(zq) + conv_b(zq)`` as one GroupNorm pass with
    the modulation in it (MoVQ's decoder: its output norm and its attention
    blocks' norms)."""

    name = "diffusers.SpatialNorm"
    what = "GroupNorm with the spatial modulation in its pass"

    def match(self, m):
        return _spatial_norm_parts(m) is not None

    def forward(self, m, f, zq, *args, **kwargs):
        sn = _spatial_norm_parts(m)
        if args or kwargs or not isinstance(f, torch.Tensor) or not _spatial_norm_ok(m, sn, f, zq):
            return base(m, f, zq, *args, **kwargs)
        return spatial_norm(sn, f, zq)


class ResnetBlockCondNorm2D(Recipe):
    """MoVQ's resnet block (``time_embedding_norm="spatial"``, its norms
    ``SpatialNorm``s of the quantised latent): each norm with its modulation
    and the SiLU in one GroupNorm pass, ``(shortcut + conv2(h)) /
    output_scale_factor`` in conv2's epilogue."""

    name = "diffusers.ResnetBlockCondNorm2D"
    what = ("spatial norm (modulation in the GroupNorm pass)+SiLU, residual and 1/output_scale_factor in conv2's "
            "epilogue")

    def match(self, m):
        return (named(m, "ResnetBlockCondNorm2D") and getattr(m, "time_embedding_norm", None) == "spatial"
                and _spatial_norm_parts(getattr(m, "norm1", None)) is not None
                and _spatial_norm_parts(getattr(m, "norm2", None)) is not None
                and is_silu(getattr(m, "nonlinearity", None))
                and is_conv(getattr(m, "conv1", None), 3, 1, 1) and is_conv(getattr(m, "conv2", None), 3, 1, 1)
                and getattr(m, "upsample", 0) is None and getattr(m, "downsample", 0) is None
                and (getattr(m, "conv_shortcut", 0) is None or is_conv(m.conv_shortcut))
                and isinstance(getattr(m, "output_scale_factor", None), (int, float)))

    def forward(self, m, input_tensor, temb=None, *args, **kwargs):
        norm1, norm2, conv1, conv2, sc, act, drop = parts(
            m, "norm1", "norm2", "conv1", "conv2", "conv_shortcut", "nonlinearity", "dropout")
        sn1, sn2 = _spatial_norm_parts(norm1), _spatial_norm_parts(norm2)
        if (args or kwargs or not isinstance(input_tensor, torch.Tensor) or not dropout_is_identity(drop)
                or not _spatial_norm_ok(norm1, sn1, input_tensor, temb)
                or not _spatial_norm_ok(norm2, sn2, input_tensor, temb)
                or not inference(input_tensor, conv1, conv2, sc) or not plain(act, drop, conv1, conv2, sc)):
            return base(m, input_tensor, temb, *args, **kwargs)
        h = conv(conv1, spatial_norm(sn1, input_tensor, temb, "silu"))
        h = spatial_norm(sn2, h, temb, "silu")
        x = input_tensor if sc is None else conv(sc, input_tensor)
        return like_input(conv(conv2, h, residual=x, out_scale=1.0 / m.output_scale_factor), input_tensor)


def _up_conv(m):
    return m.conv if getattr(m, "name", "conv") == "conv" else getattr(m, "Conv2d_0", None)


class Upsample2D(Recipe):
    """Nearest x2 then 3x3 conv as four 2x2 convs of the small input."""

    name = "diffusers.Upsample2D"
    what = "upsample folded into the conv"

    def match(self, m):
        return (named(m, "Upsample2D") and getattr(m, "use_conv", False) and not getattr(m, "use_conv_transpose", True)
                and getattr(m, "interpolate", False) and getattr(m, "norm", 0) is None
                and is_conv(_up_conv(m), 3, 1, 1))

    def forward(self, m, hidden_states, output_size=None, *args, **kwargs):
        if output_size is not None or args or kwargs or hidden_states.dim() != 4:
            return base(m, hidden_states, output_size, *args, **kwargs)
        return upsample_conv(_up_conv(m), hidden_states)

    def upsample_convs(self, m):
        return (_up_conv(m),)


class Downsample2D(Recipe):
    """``F.pad(x, (0, 1, 0, 1))`` then the stride-2 conv: the pad folded into
    the conv's bounds, no padded copy."""

    name = "diffusers.Downsample2D"
    what = "asymmetric pad folded into the stride-2 conv"

    def match(self, m):
        return (named(m, "Downsample2D") and getattr(m, "use_conv", False) and getattr(m, "padding", 1) == 0
                and getattr(m, "norm", 0) is None and is_conv(getattr(m, "conv", None), 3, 2, 0))

    def forward(self, m, hidden_states, *args, **kwargs):
        if args or kwargs or hidden_states.dim() != 4:
            return base(m, hidden_states, *args, **kwargs)
        return conv(m.conv, hidden_states, padding=(0, 1, 0, 1))


class Attention(Recipe):
    """The VAE mid-block's self-attention (``Attention`` with
    ``AttnProcessor2_0``, no cross-attention, no mask): GroupNorm by the
    kernel, the projections over the NHWC activation read as tokens without
    a copy, the attention through ``ops.attention`` (one 512-wide head,
    which PyTorch's fused kernels do not take), the residual added to the
    output projection in place."""

    name = "diffusers.Attention"
    what = "GroupNorm kernel, token views, blocked attention for wide heads"

    def match(self, m):
        out = getattr(m, "to_out", None)
        return (named(m, "Attention") and getattr(m, "spatial_norm", 0) is None
                and getattr(m, "norm_q", 0) is None and getattr(m, "norm_k", 0) is None
                and not getattr(m, "is_cross_attention", True)
                # The VAE's spatial form; a UNet's token attention has neither.
                and is_group_norm(m.group_norm) and m.residual_connection is True
                and all(type(getattr(m, p, None)) is nn.Linear for p in ("to_q", "to_k", "to_v"))
                and out is not None and len(out) == 2 and type(out[0]) is nn.Linear
                and out[0].out_features == m.to_q.in_features
                and isinstance(getattr(m, "rescale_output_factor", None), (int, float)))

    def forward(self, m, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        x = hidden_states
        parts = (m.group_norm, m.to_q, m.to_k, m.to_v, m.to_out[0])
        # The processor can be swapped at any time (set_attn_processor);
        # only the stock one computes what this forward does.
        if (encoder_hidden_states is not None or attention_mask is not None or kwargs.get("temb") is not None
                or set(kwargs) - {"temb"} or type(m.processor).__name__ != "AttnProcessor2_0"
                or x.dim() != 4 or m.residual_connection is not True or not dropout_is_identity(m.to_out[1])
                or not inference(x, *parts) or not plain(*parts, m.to_out[1])):
            return base(m, hidden_states, encoder_hidden_states, attention_mask, **kwargs)
        b, c, h, w = x.shape
        t = to_tokens(group_norm(m.group_norm, x))
        q, k, v = (F.linear(t, p.weight, p.bias) for p in (m.to_q, m.to_k, m.to_v))
        heads, d = m.heads, k.shape[-1] // m.heads
        q, k, v = (y.view(b, -1, heads, d).transpose(1, 2) for y in (q, k, v))
        o = attention(q, k, v).transpose(1, 2).reshape(b, -1, heads * d)
        y = F.linear(o, m.to_out[0].weight, m.to_out[0].bias)
        y += to_tokens(x)  # residual_connection
        if m.rescale_output_factor != 1:
            y /= m.rescale_output_factor
        return like_input(from_tokens(y, h, w), x)


class NHWCInside(Recipe):
    """The VAE encoder/decoder runs in NHWC (the kernels' native layout:
    in NCHW every conv would pay a staging copy, and cuDNN pays its own
    transposes); the input is converted once and the output handed back in
    the caller's layout."""

    what = "NHWC inside, caller's layout at the boundary"

    def __init__(self, name, cls_name, parts):
        self.name, self.cls_name, self.parts = name, cls_name, parts

    def match(self, m):
        return named(m, self.cls_name) and all(hasattr(m, p) for p in self.parts)

    def forward(self, m, sample, *args, **kwargs):
        if not hasattr(sample, "dim") or sample.dim() != 4 or (
                not torch.compiler.is_compiling() and not target_for(sample.device).kernels):
            # Where no kernel can run (a CPU model), NHWC would only add copies.
            return base(m, sample, *args, **kwargs)
        # The block's own forward, fed NHWC: not a fallback.
        return like_input(m.cp_own_forward(channels_last(sample), *args, **kwargs), sample)


def _resnet_layer(r) -> Resnet:
    need(matches(RESNET, r), f"{type(r).__name__} is not a VAE ResnetBlock2D")
    return Resnet(r.norm1, r.conv1, r.norm2, r.conv2, r.conv_shortcut, 1.0 / r.output_scale_factor)


def _mid_layers(mid) -> list:
    need(named(mid, "UNetMidBlock2D"), "the mid block is not UNetMidBlock2D")
    out = [_resnet_layer(mid.resnets[0])]
    for attn, r in zip(mid.attentions, mid.resnets[1:]):
        if attn is not None:
            out.append(Whole(attn))
        out.append(_resnet_layer(r))
    return out


def tail_layer(norm, conv_out, act_ok: bool) -> NormConv:
    """GroupNorm, SiLU, conv_out: the tail of a VAE half, as a band layer."""
    need(is_group_norm(norm) and act_ok and is_conv(conv_out, 3, 1, 1), "unknown tail")
    return NormConv(norm, conv_out)


class Decoder(NHWCInside):
    """``Decoder`` of AutoencoderKL in NHWC, its up blocks walked here
    rather than through each ``UpDecoderBlock2D.forward``: a block's own
    forward keeps its input alive until it returns, so in a 2048^2 decode
    the 2 GiB input of the last up block would stay next to the 1 GiB
    tensors of its second and third resnets. The tail, GroupNorm → SiLU →
    conv_out, is one ``norm_conv`` step."""

    # A latent of 128^2 (a 1024^2 image) and more: compiled, one op (see
    # ``Recipe.whole_from``; measured at 1024^2 in docs/performance.md).
    whole_from = 128 * 128

    def match(self, m):
        ups = getattr(m, "up_blocks", None)
        return (super().match(m) and ups is not None and len(ups) > 0
                and all(named(u, "UpDecoderBlock2D") and hasattr(u, "resnets") and hasattr(u, "upsamplers")
                        for u in ups)
                and is_group_norm(getattr(m, "conv_norm_out", None)) and is_silu(getattr(m, "conv_act", None))
                and is_conv(getattr(m, "conv_out", None), 3, 1, 1))

    def forward(self, m, sample, latent_embeds=None, *args, **kwargs):
        if (latent_embeds is not None or args or kwargs or not hasattr(sample, "dim") or sample.dim() != 4
                or (torch.is_grad_enabled() and getattr(m, "gradient_checkpointing", False))
                or not plain(*m.up_blocks, m.conv_norm_out, m.conv_act)
                or not (torch.compiler.is_compiling() or target_for(sample.device).kernels)):
            return super().forward(m, sample, latent_embeds, *args, **kwargs)
        x = m.conv_in(channels_last(sample))
        x = m.mid_block(x, None)
        for up in m.up_blocks:
            for r in up.resnets:
                x = r(x, temb=None)
            for u in up.upsamplers or ():
                x = u(x)
        return like_input(norm_conv(m.conv_norm_out, m.conv_out, x, "silu"), sample)

    def bands(self, m) -> Layers:
        need(is_conv(m.conv_in, 3, 1, 1), "conv_in is not a 3x3 conv")
        steps = [Conv(m.conv_in, own_pad(m.conv_in))] + _mid_layers(m.mid_block)
        for up in m.up_blocks:
            steps += [_resnet_layer(r) for r in up.resnets]
            for u in up.upsamplers or ():
                need(matches(UPSAMPLE, u), "an upsampler is not a nearest-x2 Upsample2D with a conv")
                steps.append(Up(_up_conv(u)))
        steps.append(tail_layer(m.conv_norm_out, m.conv_out, is_silu(m.conv_act)))
        return Layers("decoder", steps)


class Encoder(NHWCInside):
    """``Encoder`` of AutoencoderKL in NHWC, entered through ``conv_in``
    itself: the image (3 channels) is read in the caller's layout and
    conv_in writes NHWC, so the image is never converted. (On the tap-wise
    implicit GEMM a 3-channel NHWC image cost conv_in 0.53 ms at 1024^2 on
    the H200 against 0.35 reading NCHW; on the few-input-channel route it
    now takes, 0.23 and 0.25.) The tail, GroupNorm → SiLU → conv_out, is
    one ``norm_conv`` step."""

    # A 1024^2 image and more (as the decoder's 128^2 latent).
    whole_from = 1024 * 1024

    def match(self, m):
        return (super().match(m) and is_group_norm(getattr(m, "conv_norm_out", None))
                and is_silu(getattr(m, "conv_act", None)) and is_conv(getattr(m, "conv_out", None), 3, 1, 1)
                and isinstance(getattr(m, "conv_in", None), nn.Conv2d))

    def forward(self, m, sample, *args, **kwargs):
        if (args or kwargs or not hasattr(sample, "dim") or sample.dim() != 4
                or (torch.is_grad_enabled() and getattr(m, "gradient_checkpointing", False))
                or not plain(m.conv_in, m.conv_norm_out, m.conv_act)
                or torch.compiler.is_compiling() or not target_for(sample.device).kernels):
            return super().forward(m, sample, *args, **kwargs)
        shape = output_shape(ConvSpec.from_module(m.conv_in), tuple(sample.shape))
        out = torch.empty(shape, dtype=sample.dtype, device=sample.device, memory_format=torch.channels_last)
        x = conv(m.conv_in, sample, out=out)
        for d in m.down_blocks:
            x = d(x)
        x = m.mid_block(x)
        return like_input(norm_conv(m.conv_norm_out, m.conv_out, x, "silu"), sample)

    def bands(self, m) -> Layers:
        need(is_conv(m.conv_in, 3, 1, 1), "conv_in is not a 3x3 conv")
        steps = [Conv(m.conv_in, own_pad(m.conv_in))]
        for d in m.down_blocks:
            need(named(d, "DownEncoderBlock2D"), "a down block is not DownEncoderBlock2D")
            steps += [_resnet_layer(r) for r in d.resnets]
            for s in d.downsamplers or ():
                need(matches(DOWNSAMPLE, s), "a downsampler is not Downsample2D(padding=0)")
                steps.append(Conv(s.conv, plus(own_pad(s.conv), (0, 1, 0, 1))))
        steps += _mid_layers(m.mid_block)
        steps.append(tail_layer(m.conv_norm_out, m.conv_out, is_silu(m.conv_act)))
        return Layers("encoder", steps)


class LeanTinyBlock:
    """``fuse(conv(x) + skip(x))`` (after ``x = x + pool(x)`` where the block
    has a pool) of AutoencoderTiny's and TAESD's blocks, for a block passed
    through (``Recipe.lean``): the same ops in the same order on the same
    values, the bare convs and activations as the functions their forwards
    call (any other part called as a module), the activations and the sum
    in place on tensors made here. Where no gradient is recorded and no
    global hook is set; otherwise the class's own forward."""

    def forward(self, x, *args, **kwargs):
        d = self.__dict__
        mods = d["_modules"]
        seq, skip, fuse = mods.get("conv"), mods.get("skip"), mods.get("fuse")
        pool = mods["pool"] if "pool" in mods else d.get("pool")
        if (args or kwargs or not isinstance(x, torch.Tensor) or torch.is_grad_enabled() or global_hooks()
                or type(seq) is not nn.Sequential or not plain(seq) or skip is None or fuse is None):
            return super().forward(x, *args, **kwargs)
        if type(pool) is nn.Sequential and hookless(pool):
            x = x + inline_chain(pool.__dict__["_modules"].values(), x, False)[0]
        elif pool is not None:
            x = x + pool(x)
        h, mine = inline_chain(seq.__dict__["_modules"].values(), x, False)
        if bare(skip, nn.Identity):
            s = x
        else:
            s = inline_step(skip, x, False)[0]
        h = sum_into(h, mine, s)
        return inline_step(fuse, h, True)[0]


# The block classes ``LeanTinyBlock`` was written from: (module, class name).
_TINY_LEAN = (("diffusers.", "AutoencoderTinyBlock"), ("conv_patch.tools.taesd", "Block"))


class TinyBlock(Recipe):
    """``fuse(conv(x) + skip(x))`` of AutoencoderTiny / TAESD: conv, act,
    conv, act, conv with the activations in the epilogues and the skip added
    and the final ReLU applied in the last conv's epilogue. TAEF2's
    ``x = x + pool(x)`` (1x1 conv, GroupNorm, ReLU, 1x1 conv) adds through
    the second 1x1 conv's epilogue."""

    what = "conv+activation epilogues, skip and ReLU in the last conv's epilogue"

    def __init__(self, name, cls_names):
        self.name, self.cls_names = name, cls_names

    # 64 channels or fewer at a preview's or a decode's sizes (TAEF2 at
    # 512^2: 1.2 ms of kernels in a 3.3 ms launched call; docs/performance.md).
    host_bound = True

    def lean_for(self, cls):
        """``LeanTinyBlock`` for diffusers' ``AutoencoderTinyBlock`` and
        conv-patch's TAESD ``Block`` (other copies run as themselves: their
        forwards were not read)."""
        for module, name in _TINY_LEAN:
            if cls.__name__ == name and written_out(cls, "forward", ("self", "x"), module):
                return LeanTinyBlock
        return None

    def match(self, m):
        seq = getattr(m, "conv", None)
        if not any(named(m, n) for n in self.cls_names) or seq is None or len(seq) != 5:
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
        seq, fuse, skip, pool = parts(m, "conv", "fuse", "skip", "pool")
        chain = tuple(seq.__dict__["_modules"].values())
        pooled = () if pool is None else tuple(pool.__dict__["_modules"].values())
        if len(chain) != 5 or len(pooled) not in (0, 4):  # edited since apply(): its own forward
            return base(m, x)
        c0, a0, c1, a1, c2 = chain
        around = (seq, a0, a1, fuse, skip) + ((*pooled, pool) if pool is not None else ())
        if x.dim() != 4 or not plain(*around) or not inference(x, c0, c1, c2, skip):
            return base(m, x)
        if pool is not None:
            p0, p1, _, p3 = pooled
            p = conv(p0, x)
            p = group_norm(p1, p, "relu")
            x = conv(p3, p, residual=x)
        skip = x if type(skip).__name__ == "Identity" else conv(skip, x)
        h = conv(c0, x, activation="relu" if is_relu(a0) else "silu")
        h = conv(c1, h, activation="relu" if is_relu(a1) else "silu")
        return conv(c2, h, residual=skip, activation="relu")


RESNET = register(ResnetBlock2D())
COND_NORM_RESNET = register(ResnetBlockCondNorm2D())
SPATIAL_NORM = register(SpatialNorm())
UPSAMPLE = register(Upsample2D())
DOWNSAMPLE = register(Downsample2D())
ATTENTION = register(Attention())
DECODER = register(Decoder("diffusers.Decoder", "Decoder", ("conv_in", "mid_block", "up_blocks", "conv_out")))
ENCODER = register(Encoder("diffusers.Encoder", "Encoder", ("conv_in", "mid_block", "down_blocks", "conv_out")))
TINY_BLOCK = register(TinyBlock("tiny.Block", ("AutoencoderTinyBlock", "Block")))
