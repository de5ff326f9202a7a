"""Decode and encode in bands: in sequence on one device (``decode_in_bands``,
``encode_in_bands``, and ``PatchConfig(max_activation_gib=...)`` through
``BandHook``), or one band per rank of a ``torch.distributed`` group
(``decode``, ``encode``)."""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch
from torch import nn

from conv_patch.parallel import budget as bd
from conv_patch.runtime.state import peek, state_of
from conv_patch.parallel.comm import DistComm, LocalComm
from conv_patch.parallel.geometry import Level, check_bands, split_rows
from conv_patch.parallel.walker import Program, blocked_reason, program_of, run
from conv_patch.recipes.layers import Conv, UnsupportedModel


def _parts(vae, encode: bool):
    """(the Decoder/Encoder, the 1x1 conv after/before it or None): an
    AutoencoderKL's (anything with ``encoder``/``decoder`` modules), or the
    module itself."""
    if encode and isinstance(getattr(vae, "encoder", None), nn.Module):
        return vae.encoder, getattr(vae, "quant_conv", None)
    if not encode and isinstance(getattr(vae, "decoder", None), nn.Module):
        return vae.decoder, getattr(vae, "post_quant_conv", None)
    if isinstance(vae, nn.Module):
        return vae, None
    raise TypeError(f"expected an AutoencoderKL or a VAE Decoder/Encoder module, got {type(vae).__name__}")


def first_level(program: Program, height: int, bands: int) -> Level:
    """The band edges of the program's input: cut in latent rows (the
    decoder's input, the encoder's output) and scaled to the input."""
    if program.kind == "decoder":
        check_bands(height, bands)
        return Level(tuple(split_rows(height, bands)))
    latent = program.heights(height)[-1]
    check_bands(latent, bands)
    downs = sum(isinstance(s, Conv) and tuple(s.m.stride) == (2, 2) for s in program.steps)
    return Level(tuple(split_rows(latent, bands))).scaled(2 ** downs, height)


def _latent_height(program: Program, height: int) -> int:
    return height if program.kind == "decoder" else program.heights(height)[-1]


def _like_input(y, x):
    if x.is_contiguous() and not y.is_contiguous():
        return y.contiguous()
    return y


def _wrap_encode(moments, vae):
    """A diffusers AutoencoderKL's ``latent_dist`` from its moments; any
    other model's moments as they are."""
    if moments is None or not type(vae).__module__.startswith("diffusers"):
        return moments
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    return DiagonalGaussianDistribution(moments)


def _banded(core: nn.Module, x: torch.Tensor, *, bands, max_activation_gib, staged):
    """(output, report) of ``core`` on ``x`` in sequential bands."""
    reason = blocked_reason(core, x)
    if reason is not None:
        return core(x), bd.BandReport("plain", 1, fallback=reason)
    program = program_of(core)
    budget = (max_activation_gib * bd.GIB if max_activation_gib is not None
              else bd.auto_budget(x.device) if bands is None else None)
    report = bd.plan(program, tuple(x.shape), x.element_size(), _latent_height(program, x.shape[2]), budget,
                     bands=bands, staged=staged)
    if report.bands == 1:
        with torch.no_grad():
            return core(x), report
    first = first_level(program, x.shape[2], report.bands)
    report.rows = _latent_rows(program, x.shape[2], report.bands)
    comm = LocalComm(report.bands, x.device, staged=report.staged, keep_bytes=bd.keep_bytes(budget))
    with torch.no_grad():
        y = comm.output(run(program, x, comm, first), "all")
    bd.record_staging(report, comm)
    return _like_input(y, x), report


def _latent_rows(program: Program, height: int, bands: int):
    """Latent rows of each band (the report's ``rows``)."""
    edges = split_rows(_latent_height(program, height), bands)
    return tuple(b - a for a, b in zip(edges[:-1], edges[1:]))


def decode_in_bands(vae, latents: torch.Tensor, *, bands: Optional[int] = None,
                    max_activation_gib: Optional[float] = None, staged: Optional[bool] = None,
                    return_report: bool = False):
    """``vae``'s decode of ``latents`` (an AutoencoderKL: its post_quant_conv
    then its decoder, tiling ignored; or a bare Decoder) computed in row
    bands one after the other, equal to the unbanded decode up to rounding.

    ``bands``: that many (ValueError where a band would be thinner than its
    halo: more bands than latent rows). Else ``max_activation_gib`` (default:
    on CUDA derived from free memory; on the CPU no banding) picks the fewest
    bands whose estimate fits, on the device where they fit, else staged to
    (pinned) host memory; ``staged`` forces either. Returns the image tensor,
    or ``(image, BandReport)`` with ``return_report``. Hooks on the decoder's
    modules or autograd run the plain decode, and the report says so;
    a decoder of another structure raises ``UnsupportedModel``."""
    core, pre = _parts(vae, encode=False)
    z = latents
    if pre is not None:
        z = pre(z)
    y, report = _banded(core, z, bands=bands, max_activation_gib=max_activation_gib, staged=staged)
    return (y, report) if return_report else y


def encode_in_bands(vae, images: torch.Tensor, *, bands: Optional[int] = None,
                    max_activation_gib: Optional[float] = None, staged: Optional[bool] = None,
                    return_report: bool = False):
    """``encode`` in sequential bands (see ``decode_in_bands``). For an
    AutoencoderKL: what ``vae.encode(images).latent_dist`` is (a
    ``DiagonalGaussianDistribution`` of the quant_conv's moments); for a
    bare Encoder its output tensor."""
    core, post = _parts(vae, encode=True)
    y, report = _banded(core, images, bands=bands, max_activation_gib=max_activation_gib, staged=staged)
    if post is not None:
        with torch.no_grad() if blocked_reason(post, y) is None else contextlib.nullcontext():
            y = post(y)
    out = _wrap_encode(y, vae)
    return (out, report) if return_report else out


# -- across processes --------------------------------------------------------------
def _world(group) -> int:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _distributed(core: nn.Module, x: torch.Tensor, group, gather):
    """(output or None, report) of ``core`` on ``x`` (every rank holds all of
    ``x``), one band per rank of ``group``."""
    import torch.distributed as dist
    if gather != "all" and not (isinstance(gather, int) and not isinstance(gather, bool)):
        raise ValueError(f"gather must be 'all' or a rank of the group, got {gather!r}")
    world = _world(group)
    rank = dist.get_rank(group) if world > 1 else 0
    if isinstance(gather, int) and not 0 <= gather < world:
        raise ValueError(f"gather={gather}: the group has ranks 0..{world - 1}")
    mine = gather == "all" or rank == gather
    if world == 1:
        with torch.no_grad() if blocked_reason(core, x) is None else contextlib.nullcontext():
            return core(x), bd.BandReport("plain", 1)
    reason = blocked_reason(core, x)
    if reason is not None:
        # Every rank computes the whole; the ranks outside ``gather`` drop it.
        y = core(x)
        return (y if mine else None), bd.BandReport("plain", 1, world_size=world, fallback=reason)
    program = program_of(core)
    first = first_level(program, x.shape[2], world)
    comm = DistComm(group, x.device)
    with torch.no_grad():
        y = comm.output(run(program, x, comm, first), gather)
    report = bd.BandReport("distributed", world, rows=_latent_rows(program, x.shape[2], world), world_size=world,
                           sent_bytes=comm.sent_bytes)
    return (None if y is None else _like_input(y, x)), report


def decode(vae, latents: torch.Tensor, group=None, gather: Union[str, int] = "all", *, return_report=False):
    """Decode ``latents`` with one band of rows per rank of ``group`` (the
    default group when None): every rank passes the same ``latents`` and
    model, halo rows travel between neighbouring ranks, GroupNorm
    statistics are merged exactly across ranks, the mid-block attention sees
    every token. ``gather="all"``: every rank gets the image; an int: that
    rank does, the others get None. One process (or no initialised process
    group): the ordinary decode."""
    core, pre = _parts(vae, encode=False)
    z = latents
    if pre is not None:
        with torch.no_grad() if blocked_reason(pre, z) is None else contextlib.nullcontext():
            z = pre(z)
    y, report = _distributed(core, z, group, gather)
    return (y, report) if return_report else y


def encode(vae, images: torch.Tensor, group=None, gather: Union[str, int] = "all", *, return_report=False):
    """``decode``'s counterpart: for an AutoencoderKL what
    ``vae.encode(images).latent_dist`` is (a ``DiagonalGaussianDistribution``
    of the moments), for a bare Encoder its output tensor; None on the ranks
    outside ``gather``."""
    core, post = _parts(vae, encode=True)
    y, report = _distributed(core, images, group, gather)
    if y is not None and post is not None:
        with torch.no_grad() if blocked_reason(post, y) is None else contextlib.nullcontext():
            y = post(y)
    out = _wrap_encode(y, vae)
    return (out, report) if return_report else out


# -- PatchConfig(max_activation_gib=...) ------------------------------------------------
class BandHook:
    """Installed by ``apply`` on a fused VAE Decoder/Encoder: before the
    block's forward, where the plain forward's activations would not fit the
    budget (``max_activation_gib``; None: derived from free memory on CUDA,
    never on the CPU), the call runs in bands instead, and the block's
    state's ``band_report`` says what happened. Returns None to let the block's
    own forward run."""

    # Plain-forward estimates kept per input signature: the per-call check
    # is then one dict lookup and the free-memory query (a decode replayed
    # from a CUDA graph takes ~8 ms; walking its modules would add ~2%).
    MAX_KEYS = 16

    def __init__(self, max_activation_gib: Optional[float] = None):
        self.max_activation_gib = max_activation_gib
        self._plain = {}

    def __getstate__(self):
        return {"max_activation_gib": self.max_activation_gib, "_plain": {}}

    def __call__(self, module, args, kwargs):
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() != 4:
            return None
        x = args[0]
        if torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        if self.max_activation_gib is None and not x.is_cuda:
            return None
        key = (tuple(x.shape), x.dtype, id(module))
        plain = self._plain.get(key)
        if plain is not None and self.max_activation_gib is None and bd.fits_free(x.device, plain):
            return None  # (the report of the call that measured it stands)
        budget = (self.max_activation_gib * bd.GIB if self.max_activation_gib is not None
                  else bd.auto_budget(x.device))
        if plain is not None and plain <= budget:
            return None
        try:
            program = program_of(module)
        except UnsupportedModel:
            return None
        if len(self._plain) >= self.MAX_KEYS:
            self._plain.clear()
        self._plain[key] = bd.plain_peak(program, tuple(x.shape), x.element_size())
        report = bd.plan(program, tuple(x.shape), x.element_size(), _latent_height(program, x.shape[2]), budget)
        reason = blocked_reason(module, x) if report.bands > 1 else None
        if reason is not None:
            report = bd.BandReport("plain", 1, budget_gib=report.budget_gib, fallback=reason)
        state_of(module).band_report = report
        if report.bands == 1:
            return None
        first = first_level(program, x.shape[2], report.bands)
        report.rows = _latent_rows(program, x.shape[2], report.bands)
        comm = LocalComm(report.bands, x.device, staged=report.staged, keep_bytes=bd.keep_bytes(budget))
        with torch.no_grad():
            y = _like_input(comm.output(run(program, x, comm, first), "all"), x)
        bd.record_staging(report, comm)
        return y


def last_report(module: nn.Module) -> Optional[bd.BandReport]:
    """The ``BandReport`` of ``module``'s (a VAE, or its Decoder/Encoder)
    last call through ``PatchConfig(max_activation_gib=...)``'s hook."""
    for m in (module, getattr(module, "decoder", None), getattr(module, "encoder", None)):
        st = None if m is None else peek(m)
        if st is not None and st.band_report is not None:
            return st.band_report
    return None
