"""Wan-family video VAE blocks: diffusers' ``AutoencoderKLWan`` (Wan 2.1 and
2.2) and ``AutoencoderKLQwenImage``, ComfyUI's WanVAE. Matched by class-name
suffix and structure, so the copies of these classes in each package (and
in custom nodes) are recognised alike.

* every RMS norm over channels (``*RMS_norm``) as one pass of the RMS-norm
  kernel (PyTorch runs it as about eight elementwise passes);
* the residual block (``*ResidualBlock``): RMS norm + SiLU as one pass each,
  the cached frames read in place by the causal convs (the chunk-by-chunk
  cache bookkeeping exactly as the block does it), the shortcut added in
  conv2's epilogue;
* the mid-block's per-frame attention (``AttentionBlock``);
* the decoder (``*Decoder3d``: diffusers' and ComfyUI's) in NDHWC inside:
  its input converted once, its output handed back in the caller's layout.
  In NCDHW cuDNN transposes every conv's input and output, and the sm90
  Conv3d kernel (TMA boxes of channels) takes NDHWC only;
* the up-sampling resample (``*Resample``, ``upsample3d``): the time conv's
  two output halves interleaved into frames in NDHWC (the block's own
  ``torch.stack`` hands back NCDHW, which would leave the rest of the
  decoder there);
* Wan 2.2's residual up block (diffusers' ``WanResidualUpBlock``, ComfyUI's
  ``Up_ResidualBlock``): its ``DupUp3D`` shortcut gathered straight into the
  block's output in NDHWC.

The resample blocks' nearest x2 upsampling + 3x3 conv per frame is the
``nn.Sequential`` chain recipe's (``common.py``). Convs run on conv-patch's
kernels only where ``dispatch.conv3d`` plans them there (the architecture's
table measured the kernel faster for that call); elsewhere they are
PyTorch's.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from . import video_pass
from .fuse import (Recipe, attention, base, causal_conv3d, conv, dropout_is_identity, from_tokens, inference,
                   is_conv, is_silu, parts, plain, register, rms_norm, rms_norm_params, to_tokens)
from conv_patch.buffers import persistent
from conv_patch.routing import tables
from conv_patch.runtime.state import state_of
from conv_patch.runtime.wrappers import causal_conv3d_problem
from conv_patch.specs import HALF_DTYPES, layout_of
from conv_patch.target import target_for

# The frames a block keeps from each chunk for the next one's causal convs.
CACHE_T = 2


def _cls(m):
    return getattr(type(m), "cp_base", type(m))


def _rms_3d(m) -> bool:
    """An RMS norm over the channels of [B, C, T, H, W] activations."""
    p = rms_norm_params(m)
    return p is not None and p[0].dim() == 4


def _causal(m, k=None) -> bool:
    return causal_conv3d_problem(m) is None and (k is None or tuple(m.kernel_size) == (k, k, k))


def _family_cache_t(m) -> bool:
    """The block's module keeps CACHE_T frames per chunk, as this recipe does."""
    mod = sys.modules.get(_cls(m).__module__)
    return mod is not None and getattr(mod, "CACHE_T", None) == CACHE_T


class RMSNorm(Recipe):
    """Any Wan-family RMS norm over channels, on the input it was written
    for (one axis more than its gamma)."""

    name = "wan.RMS_norm"
    what = "RMS norm kernel"
    runs_convs = False

    def match(self, m):
        return rms_norm_params(m) is not None

    def forward(self, m, x):
        p = rms_norm_params(m)
        if p is None or x.dim() != p[0].dim() + 1 or not inference(x, m):
            return base(m, x)
        return rms_norm(m, x)


def _cached_conv(conv, x, feat_cache, feat_idx, residual=None):
    """A block's causal conv step as the family writes it: the last CACHE_T
    frames of the conv's input (with the previous chunk's last frame in
    front where this chunk has one) become the conv's cache for the next
    chunk; this chunk's conv reads the cache left by the previous one. A
    slot holding the up-sampling resample's ``"Rep"`` marker (its first
    chunk ran no time conv) means no cache yet, and zeros in front."""
    if feat_cache is None:
        return causal_conv3d(conv, x, residual=residual)
    idx = feat_idx[0]
    prev = feat_cache[idx]
    rep = isinstance(prev, str)
    cache_x = x[:, :, -CACHE_T:].clone()
    if cache_x.shape[2] < 2 and prev is not None:
        front = torch.zeros_like(cache_x) if rep else prev[:, :, -1:].to(cache_x.device)
        cache_x = torch.cat([front, cache_x], dim=2)
    y = causal_conv3d(conv, x, None if rep else prev, residual=residual)
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return y


def _residual(x, norm1, conv1, norm2, conv2, shortcut, feat_cache, feat_idx):
    h = x if shortcut is None else causal_conv3d(shortcut, x)
    y = _cached_conv(conv1, rms_norm(norm1, x, "silu"), feat_cache, feat_idx)
    return _cached_conv(conv2, rms_norm(norm2, y, "silu"), feat_cache, feat_idx, residual=h)


def _shortcut(m):
    """None for an identity shortcut, the 1x1 causal conv, or False (what
    ``match`` checks; a call takes ``_identity_or``, which reads no
    signature)."""
    if isinstance(m, nn.Identity):
        return None
    return m if _causal(m, 1) else False


def _identity_or(m):
    return None if isinstance(m, nn.Identity) else m


def _own_args(x, feat_cache, feat_idx) -> tuple:
    """The residual blocks' call as made, for their own forward: an argument
    left out stays out (``feat_idx`` defaults to a list the block keeps)."""
    return (x,) if feat_cache is None and feat_idx is None else (x, feat_cache) if feat_idx is None \
        else (x, feat_cache, feat_idx)


class ResidualBlock(Recipe):
    """diffusers' ``WanResidualBlock`` / ``QwenImageResidualBlock``:
    ``forward(x, feat_cache=None, feat_idx=[0])``."""

    name = "wan.ResidualBlock"
    what = "RMS norm+SiLU passes, cached frames read in place, shortcut in conv2's epilogue"

    def match(self, m):
        norm1, conv1, norm2, conv2, sc, act, drop = parts(
            m, "norm1", "conv1", "norm2", "conv2", "conv_shortcut", "nonlinearity", "dropout")
        return (_cls(m).__name__.endswith("ResidualBlock") and _family_cache_t(m) and _rms_3d(norm1)
                and _rms_3d(norm2) and _causal(conv1, 3) and _causal(conv2, 3) and is_silu(act)
                and isinstance(drop, nn.Dropout) and _shortcut(sc) is not False)

    def forward(self, m, x, feat_cache=None, feat_idx=None):
        norm1, conv1, norm2, conv2, sc, act, drop = parts(
            m, "norm1", "conv1", "norm2", "conv2", "conv_shortcut", "nonlinearity", "dropout")
        own = _own_args(x, feat_cache, feat_idx)
        if ((feat_cache is not None and feat_idx is None) or x.dim() != 5 or not dropout_is_identity(drop)
                or not inference(x, norm1, conv1, norm2, conv2, sc) or not plain(norm1, act, norm2, drop, sc)):
            return base(m, *own)
        return _residual(x, norm1, conv1, norm2, conv2, _identity_or(sc), feat_cache, feat_idx)


class ComfyResidualBlock(Recipe):
    """ComfyUI's WanVAE ``ResidualBlock``: ``residual`` an ``nn.Sequential``
    of (RMS norm, SiLU, causal conv, RMS norm, SiLU, dropout, causal conv),
    ``shortcut`` beside it."""

    name = "wan.comfy.ResidualBlock"
    what = ResidualBlock.what

    def match(self, m):
        res, sc = parts(m, "residual", "shortcut")
        if not (_cls(m).__name__ == "ResidualBlock" and _family_cache_t(m) and type(res) is nn.Sequential
                and len(res) == 7):
            return False
        n1, a1, c1, n2, a2, drop, c2 = res
        return (_rms_3d(n1) and is_silu(a1) and _causal(c1, 3) and _rms_3d(n2) and is_silu(a2)
                and isinstance(drop, nn.Dropout) and _causal(c2, 3) and _shortcut(sc) is not False)

    def forward(self, m, x, feat_cache=None, feat_idx=None):
        res, sc = parts(m, "residual", "shortcut")
        own = _own_args(x, feat_cache, feat_idx)
        children = tuple(res.__dict__["_modules"].values())
        if ((feat_cache is not None and feat_idx is None) or x.dim() != 5 or len(children) != 7
                or not dropout_is_identity(children[5]) or not inference(x, *children, sc)
                or not plain(res, *children[:2], *children[3:6], sc)):
            return base(m, *own)
        n1, _, c1, n2, _, _, c2 = children
        return _residual(x, n1, c1, n2, c2, _identity_or(sc), feat_cache, feat_idx)


class AttentionBlock(Recipe):
    """The mid-block's per-frame single-head attention (diffusers'
    ``WanAttentionBlock`` / ``QwenImageAttentionBlock``; ComfyUI's has its own
    attention call and is not taken): the frames made once as NHWC tokens
    (the block's permute copy), the RMS norm as one pass, the 1x1
    projections over the token views, the attention through
    ``ops.attention`` (a 384-wide head, which PyTorch's fused kernels do not
    take), the residual added in the output projection's epilogue."""

    name = "wan.AttentionBlock"
    what = "RMS norm pass, NHWC frame tokens, attention for wide heads, residual in proj's epilogue"

    def match(self, m):
        norm, qkv, proj = parts(m, "norm", "to_qkv", "proj")
        p = rms_norm_params(norm)
        return (_cls(m).__name__ in ("WanAttentionBlock", "QwenImageAttentionBlock") and p is not None
                and p[0].dim() == 3 and is_conv(qkv, 1) and is_conv(proj, 1) and qkv.padding == (0, 0)
                and proj.padding == (0, 0) and qkv.out_channels == 3 * qkv.in_channels
                and proj.in_channels == proj.out_channels == qkv.in_channels == p[0].shape[0])

    def forward(self, m, x):
        norm, qkv, proj = parts(m, "norm", "to_qkv", "proj")
        if x.dim() != 5 or x.shape[1] != qkv.in_channels or not inference(x, norm, qkv, proj) or not plain(norm):
            return base(m, x)
        b, c, t, h, w = x.shape
        # [B*T, C, H, W] frames in NHWC: one copy of an NCDHW input (the
        # block's own permute makes one too), a view of an NDHWC one.
        frames = x.permute(0, 2, 3, 4, 1).reshape(b * t, h, w, c).permute(0, 3, 1, 2)
        tok = to_tokens(conv(qkv, rms_norm(norm, frames)))
        q, k, v = (tok[:, None, :, i * c:(i + 1) * c] for i in range(3))
        a = attention(q, k, v)[:, 0]
        y = conv(proj, from_tokens(a, h, w), residual=frames)
        y = y.permute(0, 2, 3, 1).reshape(b, t, h, w, c).permute(0, 4, 1, 2, 3)
        # The caller's layout: the block's own ``x + identity`` follows its input's.
        return y.contiguous() if x.is_contiguous() else y


def ndhwc(x: torch.Tensor) -> torch.Tensor:
    """[N, C, T, H, W] ``x`` as dense NDHWC (channels_last_3d)."""
    return x if x.is_contiguous(memory_format=torch.channels_last_3d) else \
        x.contiguous(memory_format=torch.channels_last_3d)


def like_input_3d(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` as the unpatched decoder hands it back for ``x``: NDHWC for an
    NDHWC input, dense NCDHW for anything else (a chunk sliced out of an
    NCDHW latent included)."""
    return y if layout_of(x) == "ndhwc" else y.contiguous()


def _ndhwc_pays(x) -> bool:
    """NDHWC inside only where it was measured to pay: fp16/bf16 on a GPU
    whose table has measured Conv3d calls (the H200's: cuDNN itself faster
    on NDHWC, and the sm90 kernel reads only NDHWC), and under the
    interpreter (where it is tested). Elsewhere (a CPU model, fp32, a GPU
    nobody measured) the decoder keeps its caller's layout."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or torch.compiler.is_compiling():
        return False
    target = target_for(x.device)
    if not target.kernels:
        return False
    if target.interpreter:
        return True
    return x.dtype in HALF_DTYPES and tables.packaged_table(target.arch).has_conv3d


class Decoder3d(Recipe):
    """diffusers' ``WanDecoder3d`` / ``QwenImageDecoder3d`` and ComfyUI's
    WanVAE ``Decoder3d`` (Wan 2.1's and 2.2's) in NDHWC inside: its own
    forward on an NDHWC chunk (the blocks' recipes, the RMS norm
    kernel, the causal caches and the convs all keep NDHWC), the output in
    the caller's layout."""

    name = "wan.Decoder3d"
    what = "NDHWC inside, caller's layout at the boundary"

    def match(self, m):
        if not (_cls(m).__name__.endswith("Decoder3d") and _family_cache_t(m)):
            return False
        conv_in, conv_out, ups = parts(m, "conv_in", "conv_out", "up_blocks")
        if ups is not None and conv_in is not None and _causal(conv_in) and conv_out is not None \
                and _causal(conv_out):
            return True
        # ComfyUI's WanVAE decoders (Wan 2.1's and 2.2's): conv1, upsamples, a head ending in the conv.
        conv1, head, ups = parts(m, "conv1", "head", "upsamples")
        return (conv1 is not None and _causal(conv1) and isinstance(ups, nn.Sequential)
                and isinstance(head, nn.Sequential) and len(head) > 0 and _causal(head[-1]))

    def forward(self, m, x, *args, **kwargs):
        if not _ndhwc_pays(x):
            return base(m, x, *args, **kwargs)
        # The block's own forward, fed NDHWC: not a fallback.
        return like_input_3d(m.cp_own_forward(ndhwc(x), *args, **kwargs), x)


def interleave_frames(y: torch.Tensor) -> torch.Tensor:
    """[B, 2C, T, H, W] -> [B, C, 2T, H, W], frame 2t+j taking channels
    j*C..(j+1)*C of frame t (the upsampling time conv's two output halves,
    what the block's reshape + ``torch.stack`` compute), in NDHWC: one copy,
    as the block's stack makes one."""
    b, c2, t, h, w = y.shape
    c = c2 // 2
    z = ndhwc(y).permute(0, 2, 3, 4, 1).reshape(b, t, h, w, 2, c).permute(0, 1, 4, 2, 3, 5)
    # (.contiguous: with one frame the reshape is a view, frames interleaved
    # within each pixel, which no kernel reads as NDHWC.)
    return z.reshape(b, 2 * t, h, w, c).contiguous().permute(0, 4, 1, 2, 3)


class Resample(Recipe):
    """diffusers' ``WanResample`` / ``QwenImageResample`` in ``upsample3d``
    mode on an NDHWC input: the time conv's cache bookkeeping exactly as the
    block does it (its ``"Rep"`` marker on the first chunk included), the
    cached frames read in place, the two output halves interleaved in NDHWC
    (``interleave_frames``), then the per-frame resample chain on NHWC frame
    views. Any other input runs the block's own forward."""

    name = "wan.Resample"
    what = "time up-sampling in NDHWC, cached frames read in place"

    def match(self, m):
        mode, tconv, res = parts(m, "mode", "time_conv", "resample")
        return (_cls(m).__name__.endswith("Resample") and _family_cache_t(m) and mode == "upsample3d"
                and tconv is not None and _causal(tconv) and tuple(tconv.kernel_size) == (3, 1, 1)
                and tuple(tconv.stride) == (1, 1, 1) and tconv.out_channels == 2 * tconv.in_channels
                and isinstance(res, nn.Module))

    def forward(self, m, x, feat_cache=None, feat_idx=None):
        tconv, res = parts(m, "time_conv", "resample")
        own = _own_args(x, feat_cache, feat_idx)
        if (feat_cache is None or feat_idx is None or not isinstance(x, torch.Tensor) or x.dim() != 5
                or layout_of(x) != "ndhwc" or x.shape[1] != tconv.in_channels
                or not inference(x, tconv) or not plain(tconv)):
            return base(m, *own)
        b, c, t, h, w = x.shape
        if feat_cache[feat_idx[0]] is None:
            # The first chunk: no time conv, the marker for the second.
            feat_cache[feat_idx[0]] = "Rep"
            feat_idx[0] += 1
        else:
            x = interleave_frames(_cached_conv(tconv, x, feat_cache, feat_idx))
            t = x.shape[2]
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)  # NHWC frame views of an NDHWC x
        f = res(frames)
        return f.view(b, t, f.shape[1], f.shape[2], f.shape[3]).permute(0, 2, 1, 3, 4)


def _dup_up(m) -> bool:
    """diffusers' ``DupUp3D`` (Wan 2.2's up-block shortcut): channels
    repeated, then spread over ``factor_t`` frames and ``factor_s`` x
    ``factor_s`` pixels."""
    d = getattr(m, "__dict__", {})
    return (_cls(m).__name__ == "DupUp3D" and all(isinstance(d.get(k), int) for k in
                                                     ("factor_t", "factor_s", "repeats", "out_channels"))
            and d["out_channels"] * d["factor_t"] * d["factor_s"] ** 2 == d["repeats"] * d.get("in_channels", -1))


def add_dup_up(y: torch.Tensor, x: torch.Tensor, dup, first_chunk: bool) -> torch.Tensor:
    """``y += dup(x, first_chunk)`` in place, ``y`` and ``x`` NDHWC, as one
    gather per sub-position: output frame ``t*ft + i`` (less ``ft - 1`` in
    the first chunk), pixel ``(h*fs + j, w*fs + k)``, channel ``o`` takes
    input channel ``(o*F + i*fs*fs + j*fs + k) // repeats`` of frame ``t``,
    pixel ``(h, w)`` (``F = ft*fs*fs``: what ``repeat_interleave`` and the
    8-D permute compute). The block's own way makes the repeated tensor,
    its permuted copy and an add of NDHWC to NCDHW (PyTorch's slow
    non-vectorised path). Returns None where the shapes are not the ones
    this expects (the caller adds the module's own output)."""
    ft, fs, cout = dup.factor_t, dup.factor_s, dup.out_channels
    b, c, t, h, w = x.shape
    off = ft - 1 if first_chunk else 0
    if y.shape != (b, cout, t * ft - off, h * fs, w * fs):
        return None
    xm, ym = x.permute(0, 2, 3, 4, 1), y.permute(0, 2, 3, 4, 1)  # [B, T, H, W, C] views
    index = dup_index(dup, x.device)
    for i in range(ft):
        t0 = max(0, -(-(off - i) // ft))  # the first input frame whose sub-frame i is kept
        yt = ym[:, t0 * ft + i - off::ft]
        xt = xm[:, t0:t0 + yt.shape[1]]
        for j in range(fs):
            for k in range(fs):
                yt[:, :, j::fs, k::fs].add_(xt.index_select(4, index[(i * fs + j) * fs + k]))
    return y


def dup_index(dup, device) -> torch.Tensor:
    """[F, out_channels]: the input channel each output channel of
    sub-position ``(i*fs + j)*fs + k`` repeats, kept with the module per
    device (a dozen small index ops per call otherwise)."""
    st = state_of(dup)
    held = st.dup_index
    if held is None or held.device != device:
        f = dup.factor_t * dup.factor_s * dup.factor_s
        o = torch.arange(dup.out_channels) * f
        held = persistent(lambda: ((o[None, :] + torch.arange(f)[:, None]) // dup.repeats).to(device))
        st.dup_index = held
    return held


def _up_steps(m) -> Optional[list]:
    """The main path of a Wan 2.2 residual up block, in order: diffusers'
    ``WanResidualUpBlock`` (``resnets``, then ``upsampler``), ComfyUI's
    ``Up_ResidualBlock`` (``upsamples``); None for anything else."""
    name = _cls(m).__name__
    if name == "WanResidualUpBlock":
        resnets, up = parts(m, "resnets", "upsampler")
        if isinstance(resnets, nn.ModuleList):
            return list(resnets) + ([] if up is None else [up])
    elif name == "Up_ResidualBlock":
        ups = parts(m, "upsamples")[0]
        if isinstance(ups, nn.Sequential):
            return list(ups)
    return None


class ResidualUpBlock(Recipe):
    """Wan 2.2's residual up block (diffusers' ``WanResidualUpBlock``,
    ComfyUI's ``Up_ResidualBlock``) on an NDHWC input: its resnets and
    upsampler called as the block calls them (their own recipes), then the
    ``DupUp3D`` shortcut, where the level has one, added into the
    upsampler's output in place by ``add_dup_up`` (diffusers' ``clone()`` of
    the block input is not needed: no step writes into it). Anything else
    runs the block's own forward."""

    name = "wan.ResidualUpBlock"
    what = "DupUp3D shortcut gathered into the output in place, NDHWC"

    def match(self, m):
        dup = parts(m, "avg_shortcut")[0]
        return _up_steps(m) is not None and (dup is None or _dup_up(dup))

    def forward(self, m, x, feat_cache=None, feat_idx=None, first_chunk=False):
        dup = parts(m, "avg_shortcut")[0]
        own = _own_args(x, feat_cache, feat_idx)
        if ((feat_cache is not None and feat_idx is None) or not isinstance(x, torch.Tensor) or x.dim() != 5
                or layout_of(x) != "ndhwc" or not plain(dup) or not inference(x, *m.modules())):
            return base(m, *own, first_chunk=first_chunk)
        y = x
        for step in _up_steps(m):
            y = step(y) if feat_cache is None else step(y, feat_cache, feat_idx)
        if dup is None:
            return y  # (a level without up-sampling: diffusers' clone of the input was all it added)
        out = (add_dup_up(y, x, dup, first_chunk) if y is not x and layout_of(y) == "ndhwc"
               else None)
        return y + dup(x, first_chunk=first_chunk) if out is None else out


RMS_NORM = register(RMSNorm())
ATTENTION = register(AttentionBlock())
RESIDUAL = register(ResidualBlock())
COMFY_RESIDUAL = register(ComfyResidualBlock())
DECODER = register(Decoder3d())
RESAMPLE = register(Resample())
RESIDUAL_UP = register(ResidualUpBlock())


# -- the compiling pass at a Wan VAE's first decode / encode ---------------------
# A Wan VAE decodes a clip one latent frame at a time (the first with
# ``first_chunk``), and encodes its first frame alone, then four at a time,
# carrying the causal caches in its own lists: the first frame or chunk runs
# without cached frames, the second with one (its predecessor had one frame),
# and every later one as the third, with two. So the pass that compiles a
# call's kernels ahead (``conv_patch.warmup``) launches all of them on the
# clip's first PASS_LATENT_FRAMES latent frames, or a few more, as
# ``video_pass`` cuts every video family's clip: the convs over the whole
# clip (``post_quant_conv``) take its length, kept modulo 16. A decode pass
# costs a few frames' host time, not the whole clip's.
PASS_LATENT_FRAMES = 3
TIME_DOWN = 4  # frames per latent frame after the first


def pass_latent_frames(t: int) -> int:
    """The latent frames a pass keeps of a clip of ``t``."""
    return video_pass.pass_frames(t, PASS_LATENT_FRAMES)


def is_wan_vae(vae: nn.Module) -> bool:
    """diffusers' ``AutoencoderKLWan`` / ``AutoencoderKLQwenImage`` or
    ComfyUI's ``WanVAE``: a module whose ``decoder`` is a Wan decoder."""
    dec = vae._modules.get("decoder") if isinstance(vae, nn.Module) else None
    return isinstance(dec, nn.Module) and _cls(dec).__name__.endswith("Decoder3d") and _family_cache_t(dec)


def pass_methods(vae: nn.Module) -> tuple:
    """The methods of a Wan VAE that compile ahead at their first call."""
    if not is_wan_vae(vae):
        return ()
    return tuple(name for name in ("decode", "encode") if callable(getattr(type(vae), name, None)))


def pass_inputs(vae: nn.Module, method: str, args: tuple, kwargs: dict) -> tuple:
    """(args, kwargs) for the pass of ``vae.<method>(*args, **kwargs)``: the
    clip cut to its first ``pass_latent_frames`` latent frames (to encode:
    the frames that encode to them; ``video_pass.cut_clip``)."""
    clip, _ = video_pass.clip_argument(args, kwargs)
    if clip is None:
        return args, kwargs
    t = clip.shape[2]
    keep = pass_latent_frames(t) if method == "decode" else \
        1 + TIME_DOWN * (pass_latent_frames(1 + (t - 1) // TIME_DOWN) - 1)
    return video_pass.cut_clip(args, kwargs, keep)
