"""The clip a video VAE's compiling pass decodes or encodes: the caller's,
cut short.

A video VAE's first patched decode (or encode) compiles its kernels ahead,
in one pass over the call (``conv_patch.warmup``, hooked by ``apply`` at the
methods ``recipes.catalog.pass_methods`` names). The pass calls the method three
times; over the whole clip that would cost three decodes of host time and
PyTorch work before the user's own, so it takes the clip's first latent
frames: enough that every distinct call the full decode makes is made (the
first frame batch or temporal tile, without cached frames; the next, with
them; one more in the steady state; the clip's last, shorter one).

How the clip is cut depends on what reaches the kernels:

* A decoder that runs over the whole clip (HunyuanVideo and LTX-Video up to
  a tile's length, Mochi unless framewise, Wan's ``post_quant_conv``) sees
  its length in every size and stride, and Triton specialises an integer
  argument on its divisibility by 16. Those are the length times a constant
  plus another, so the pass keeps the length modulo ``PASS_FRAMES_MODULUS``,
  in a clip stored as the caller's (a view would have other strides). An
  encoder over the whole clip divides the length at each temporal stage, so
  its pass keeps the clip's frames modulo ``PASS_FRAMES_MODULUS`` times the
  compression ratio, from the ``1 + 2 * ratio`` frames of three latent ones.
* A decode or encode in frame batches or temporal tiles (CogVideoX; Mochi's
  decode framewise; HunyuanVideo and LTX-Video past a tile) hands its
  decoder or encoder slices of the clip. The pass takes a view of the
  clip's first frames: its slices are the full clip's first ones, strides
  and addresses alike, and the length is kept modulo the batch or stride,
  so the last slice has the size it has.

Wan's rule is its own (``recipes.wan``: one latent frame at a time over a
whole-clip ``post_quant_conv``); this module holds the shared cut and the
rules of diffusers' CogVideoX, Mochi, HunyuanVideo and LTX-Video VAEs
(their ``decode`` and ``encode``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)

PASS_FRAMES_MODULUS = 16
# Frames of a whole-clip decode the pass keeps at least: the first latent
# frame is the causal convs' special case (padded, or up-sampled apart), so
# two more show every later one.
WHOLE_CLIP_FRAMES = 3


def pass_frames(t: int, minimum: int, period: int = 1, whole: bool = True) -> int:
    """The latent frames a pass keeps of a clip of ``t``: ``t`` where it is
    at most ``minimum``, else ``minimum`` and as many more as keep the length
    modulo ``period`` (and, for a ``whole``-clip decode,
    ``PASS_FRAMES_MODULUS``)."""
    if t <= minimum:
        return t
    return minimum + (t - minimum) % math.lcm(PASS_FRAMES_MODULUS if whole else 1, period)


def clip_argument(args: tuple, kwargs: dict) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """The call's clip ([B, C, T, H, W], the first argument or the keyword
    ``z`` / ``x``) and its keyword (None: positional); (None, None) where
    there is none."""
    if args:
        clip, name = args[0], None
    else:
        name = next((k for k in ("z", "x") if k in kwargs), None)
        clip = kwargs.get(name)
    if not isinstance(clip, torch.Tensor) or clip.dim() != 5:
        return None, None
    return clip, name


def cut_clip(args: tuple, kwargs: dict, keep: int, view: bool = False) -> tuple:
    """(args, kwargs) with the clip cut to its first ``keep`` frames: stored
    as the caller's is, or with ``view`` a view of it (module docstring);
    the call's own where it has no clip or ``keep`` is all of it."""
    clip, name = clip_argument(args, kwargs)
    if clip is None or keep >= clip.shape[2]:
        return args, kwargs
    fmt = torch.channels_last_3d if clip.is_contiguous(memory_format=torch.channels_last_3d) \
        and not clip.is_contiguous() else torch.contiguous_format
    cut = clip[:, :, :keep] if view else clip[:, :, :keep].contiguous(memory_format=fmt)
    if name is None:
        return (cut, *args[1:]), kwargs
    return args, {**kwargs, name: cut}


def _is(vae: nn.Module, names: tuple) -> bool:
    return any(k.__name__ in names for k in type(vae).__mro__)


def _int(vae: nn.Module, name: str) -> Optional[int]:
    v = getattr(vae, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


# A rule: (minimum, period, whole) of ``pass_frames`` for a clip's length,
# or None (no cut).
Rule = Optional[Tuple[int, int, bool]]


def _frame_batches(vae: nn.Module, t: int, size: str = "num_latent_frames_batch_size") -> Rule:
    """CogVideoX, Mochi framewise: batches of ``size`` frames (latent ones
    to decode, the clip's to encode), each with the cached frames of the one
    before (CogVideoX adds the remainder to its first, Mochi leaves it
    last): three batches and the remainder."""
    b = _int(vae, size)
    return None if b is None else (3 * b + t % b, b, False)


def _whole_clip(vae: nn.Module, t: int, encode: bool) -> Rule:
    """A whole-clip call: three latent frames, or to encode the
    ``1 + 2 * ratio`` frames that encode to them, with the length kept
    modulo 16 at every temporal stage of the encoder (modulo ``16 * ratio``
    in the clip's frames)."""
    if not encode:
        return WHOLE_CLIP_FRAMES, 1, True
    cr = _int(vae, "temporal_compression_ratio")
    return None if cr is None else (1 + (WHOLE_CLIP_FRAMES - 1) * cr, PASS_FRAMES_MODULUS * cr, True)


def _temporal_tiles(vae: nn.Module, t: int, encode: bool = False, flag: Optional[str] = None) -> Rule:
    """HunyuanVideo, LTX-Video: whole clips up to a tile's length, else
    (the ``flag``: ``use_framewise_decoding`` / ``_encoding``) overlapping
    tiles of that length plus one frame, a stride apart: the first, two
    more, then the clip's last ones, shorter (the length modulo the stride).
    A decode's tiles are of latent frames, an encode's of the clip's."""
    cr = _int(vae, "temporal_compression_ratio")
    tile, stride = (_int(vae, k) for k in ("tile_sample_min_num_frames", "tile_sample_stride_num_frames"))
    if None in (cr, tile, stride) or stride < cr:
        return None  # (a stride of no latent frame: the decode's own loop would not move)
    if not encode:
        tile, stride = tile // cr, stride // cr
    flag = flag or ("use_framewise_encoding" if encode else "use_framewise_decoding")
    if getattr(vae, flag, False) and t > tile:
        return tile + 1 + 2 * stride, stride, False
    return _whole_clip(vae, t, encode)


def _cogvideox(vae: nn.Module, t: int, encode: bool) -> Rule:
    return _frame_batches(vae, t, "num_sample_frames_batch_size" if encode else "num_latent_frames_batch_size")


def _mochi(vae: nn.Module, t: int, encode: bool) -> Rule:
    # (Its encode has no framewise path: diffusers raises there.)
    if getattr(vae, "use_framewise_decoding", False) and not encode:
        return _frame_batches(vae, t)
    return _whole_clip(vae, t, encode)


def _ltx(vae: nn.Module, t: int, encode: bool) -> Rule:
    # (diffusers' LTX-Video encode tiles in time by the decoding flag.)
    return _temporal_tiles(vae, t, encode, "use_framewise_decoding")


@dataclass(frozen=True)
class ClipPass:
    """The pass of one family's ``decode`` and ``encode``: its classes
    (diffusers' names, matched along the MRO) and its rule for a clip of
    ``t`` frames (``Rule``; ``frames(vae, t, encode)``: latent frames to
    decode, the clip's to encode)."""
    classes: tuple
    frames: Callable

    def pass_methods(self, vae: nn.Module) -> tuple:
        if not _is(vae, self.classes):
            return ()
        return tuple(m for m in ("decode", "encode") if callable(getattr(type(vae), m, None)))

    def pass_inputs(self, vae: nn.Module, method: str, args: tuple, kwargs: dict) -> tuple:
        clip, _ = clip_argument(args, kwargs)
        if clip is None or method not in ("decode", "encode"):
            return args, kwargs
        t = clip.shape[2]
        rule = self.frames(vae, t, method == "encode")
        if rule is None:
            return args, kwargs
        minimum, period, whole = rule
        return cut_clip(args, kwargs, pass_frames(t, minimum, period, whole), view=not whole)


COGVIDEOX = ClipPass(("AutoencoderKLCogVideoX",), _cogvideox)
MOCHI = ClipPass(("AutoencoderKLMochi",), _mochi)
HUNYUAN_VIDEO = ClipPass(("AutoencoderKLHunyuanVideo",), _temporal_tiles)
LTX_VIDEO = ClipPass(("AutoencoderKLLTXVideo",), _ltx)
FAMILIES = (COGVIDEOX, MOCHI, HUNYUAN_VIDEO, LTX_VIDEO)
