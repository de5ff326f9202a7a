"""The one route registry: every way a 2-D or 3-D convolution can run, with
the conv kind it serves, the name a config table gives it, the rule that
says when it cannot take a call, its launcher in ``conv_patch.kernels``, the
tuner's candidate configs, what it costs in launches and TMA descriptors,
and the text ``convpatch info`` prints. The decision (routing/decide.py),
the config tables (their ``"route"`` values), the ops that launch a route,
the tuner, the benchmarks and ``convpatch info`` all read it; a route's name
is spelled here and nowhere else.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from conv_patch.kernels.launch import TMA_ALIGN
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import Target


class Route(enum.Enum):
    CONV2D_IGEMM = "conv2d_igemm"
    CONV_TRANSPOSE2D_IGEMM = "conv_transpose2d_igemm"
    CONV2D_TMA = "conv2d_tma"
    CONV2D_TMA_PADDED = "conv2d_tma_padded"
    CONV2D_TAPS = "conv2d_taps"
    CONV2D_FLAT = "conv2d_flat"
    CONV2D_IM2COL = "conv2d_im2col"
    CONV3D_IGEMM = "conv3d_igemm"
    CONV3D_TMA = "conv3d_tma"
    CUDNN = "cudnn"
    FALLBACK = "fallback"

    def __str__(self) -> str:
        return self.value


def tma_arch(arch: str) -> bool:
    """TMA and wgmma exist from sm90 on."""
    return arch.startswith("sm") and arch[2:].isdigit() and int(arch[2:]) >= 90


def tma_problem(spec: ConvSpec, call: CallDesc, shape: tuple, target: Target) -> Optional[str]:
    """Why the Hopper TMA kernel cannot take this call, or None."""
    if spec.transposed:
        return "conv_transpose2d"
    if not (tma_arch(target.arch) or target.interpreter):
        return f"{target.arch} has no TMA"
    sh, sw = spec.stride
    if (sh, sw) != (1, 1):
        # A box of the [N, H/S, S, W/S, S*C] view (kernels/conv2d_tma.py).
        if shape[2] % sh or shape[3] % sw:
            return f"stride {spec.stride} does not divide the input's {shape[2]}x{shape[3]}"
        if spec.in_channels % 16:
            return f"stride {spec.stride} with C_in={spec.in_channels}, not a multiple of 16"
        if call.pitch:
            return f"stride {spec.stride} on a channel slice (the strided box folds columns into channels)"
    if not call.aligned16:
        return "input, weight, residual or output not 16-byte aligned"
    return tma_layout_problem(shape, call.layout, call.dtype.itemsize, spec.in_channels, call.pitch)


# The largest C_out * KH * KW (the first GEMM's N) the taps route takes:
# beyond it the implicit GEMM's column tile is no longer mostly waste.
MAX_TAP_OUTPUTS = 64


def taps_problem(spec: ConvSpec) -> Optional[str]:
    """Why the few-output-channel route cannot take this conv, or None."""
    if spec.transposed:
        return "conv_transpose2d"
    taps = spec.kernel[0] * spec.kernel[1]
    if taps == 1:
        return "1x1 (already a single GEMM)"
    if spec.out_channels * taps > MAX_TAP_OUTPUTS:
        return f"C_out*KH*KW = {spec.out_channels * taps} > {MAX_TAP_OUTPUTS}"
    return None


# The largest C_in * KH * KW the flat route takes: one or two K blocks; past
# it the per-tap reduction wastes little and reads whole pixel rows.
MAX_FLAT_REDUCTION = 64


def flat_problem(spec: ConvSpec) -> Optional[str]:
    """Why the few-input-channel route cannot take this conv, or None."""
    if spec.transposed:
        return "conv_transpose2d"
    k = spec.in_channels * spec.kernel[0] * spec.kernel[1]
    if k > MAX_FLAT_REDUCTION:
        return f"C_in*KH*KW = {k} > {MAX_FLAT_REDUCTION}"
    return None


def tma_padded_problem(spec: ConvSpec, call: CallDesc, shape: tuple, target: Target) -> Optional[str]:
    """Why the Hopper TMA kernel over a zero-bordered NHWC copy
    (kernels/conv2d_tma_padded.py) cannot take this call, or None."""
    if spec.transposed:
        return "conv_transpose2d"
    if not (tma_arch(target.arch) or target.interpreter):
        return f"{target.arch} has no TMA"
    if tuple(spec.stride) != (1, 1):
        return f"stride {spec.stride}: the padded TMA kernel takes stride 1"
    if not call.aligned16:
        return "input, weight, residual or output not 16-byte aligned"
    return tma_layout_problem(shape, call.layout, call.dtype.itemsize, spec.in_channels, call.pitch)


def im2col_problem(spec: ConvSpec, call: CallDesc, shape: tuple, target: Target) -> Optional[str]:
    """Why the im2col + TMA GEMM route (kernels/im2col.py) cannot take this
    call, or None: its column matrix [N, C_in*KH*KW, OH*OW] and the weight
    read in place as [C_out, C_in*KH*KW] are TMA boxes (16-byte aligned
    rows), and its GEMM's one-row tiles need 16 output pixels."""
    if spec.transposed:
        return "conv_transpose2d"
    if not (tma_arch(target.arch) or target.interpreter):
        return f"{target.arch} has no TMA"
    if call.dtype.itemsize != 2:
        return "the TMA route takes fp16/bf16"
    if not call.aligned16:
        return "input, weight, residual or output not 16-byte aligned"
    if not call.weight_dense:
        return "weight not dense NCHW (the route reads it in place as [C_out, C_in*KH*KW])"
    if not call.out_flat:
        return "an output whose pixel rows are not one run (the route writes it as [N, C_out, 1, OH*OW])"
    align = TMA_ALIGN // call.dtype.itemsize
    k = spec.in_channels * spec.kernel[0] * spec.kernel[1]
    if k % align:
        return f"C_in*KH*KW = {k} is not a multiple of {align}"
    oh, ow = spec.output_hw(shape[2], shape[3], spec.output_padding)
    if oh * ow % align or oh * ow < 16:
        return f"{oh}x{ow} output pixels per image: not a multiple of {align} of at least 16"
    return None


def tma_layout_problem(shape, layout: str, elem_bytes: int, c_in: int, pitch: int = 0) -> Optional[str]:
    """Why an input of this shape and layout cannot be described by a TMA
    descriptor (plus the [C_out, KH*KW, C_in] weight pack), or None. NCHW is
    staged through one NHWC copy or, for 1x1 and Kx1 convs under one-row
    tiles, boxed in place where its rows are 16-byte aligned (see
    kernels/conv2d_tma.py), so only the channel count matters; an NHWC
    channel slice (``pitch``: its pixel stride) is boxed in place where
    that stride is 16-byte aligned."""
    if elem_bytes != 2:
        return "the TMA route takes fp16/bf16"
    if layout not in ("nhwc", "nchw"):
        return f"{layout} input (TMA needs dense NCHW or NHWC)"
    if (c_in * elem_bytes) % TMA_ALIGN:
        return f"C_in={c_in} is not a multiple of {TMA_ALIGN // elem_bytes} (TMA stride alignment)"
    if (pitch * elem_bytes) % TMA_ALIGN:
        return f"a channel slice {pitch} channels apart per pixel, not a multiple of {TMA_ALIGN // elem_bytes}"
    return None


def conv3d_tma_problem(spec, call: CallDesc, shape: tuple, target: Target) -> Optional[str]:
    """Why the sm90 Conv3d kernel cannot take this call, or None: H and W at
    stride 1, fp16/bf16 (fp32 under the interpreter, where it is tested),
    the input and the cached frames dense NDHWC with 16-byte aligned
    channel rows (its TMA boxes, kernels/conv3d_tma.py)."""
    if tuple(spec.stride[1:]) != (1, 1):
        return f"stride {tuple(spec.stride)}: the TMA kernel takes H and W at stride 1"
    if call.dtype.itemsize != 2 and not target.interpreter:
        return "the TMA kernel takes fp16/bf16"
    if (call.layout != "ndhwc" or call.cache_layout not in (None, "ndhwc") or not call.aligned16
            or (shape[1] * call.dtype.itemsize) % TMA_ALIGN):
        return "input or cache not dense NDHWC with 16-byte aligned channel rows"
    return None

# -- tuner candidates ------------------------------------------------------------
def tile_config(route, bm, bn, bk, warps, stages, bw=None, group=8, persistent=0, bn2=0):
    """A candidate tile as the tables write it (``bn2``: the conv3d TMA
    kernel's second block of output channels, 0 for none)."""
    c = {"route": route, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
         "num_warps": warps, "num_stages": stages}
    if bn2:
        c["BLOCK_N2"] = bn2
    if bw is not None:
        c["BLOCK_W"] = bw
    if persistent:
        c["persistent"] = persistent
    return c


# The portable kernel: the three best configs of bench.portable_sweep on an H200.
IGEMM_CANDIDATES = [
    tile_config("igemm", 128, 128, 32, 4, 3), tile_config("igemm", 128, 256, 64, 8, 3),
    tile_config("igemm", 128, 64, 64, 4, 3),
]
# The TMA kernel: 128-row tiles (one or two wgmma warpgroups), the tile's
# width a 16-pixel square-ish patch (8x16), a 64-pixel row segment (2x64) or
# one 128-pixel row. A one-row tile's input box reaches wgmma straight from
# shared memory (taller boxes go through registers): on the H200 one-row
# 128x128 tiles took 0.84-0.91x the time of 8x16 ones on the FLUX decoder's
# 3x3 convs, and one-row 128x256 tiles walked by a persistent grid (one
# program per SM) 0.83-0.95x cuDNN's time on its 256- and 512-channel ones
# (bench/results/tma-tiles-h200-2026-12-01.json).
TMA_CANDIDATES = [
    tile_config("tma", 128, 128, 64, 4, 4, bw=16), tile_config("tma", 128, 128, 64, 4, 4, bw=64),
    tile_config("tma", 128, 256, 64, 8, 3, bw=16), tile_config("tma", 128, 256, 64, 8, 3, bw=64),
    tile_config("tma", 128, 64, 64, 4, 4, bw=32), tile_config("tma", 64, 128, 64, 4, 4, bw=64),
    tile_config("tma", 128, 256, 64, 8, 4, bw=64),
    tile_config("tma", 128, 128, 64, 4, 3, bw=128), tile_config("tma", 128, 128, 64, 4, 4, bw=128),
    tile_config("tma", 128, 256, 64, 8, 3, bw=128, persistent=1),
]
# The padded TMA kernel: any BLOCK_M whatever the image width (its boxes
# are rows of the flat [pixels, C] copy), 64-row tiles where 128-row ones
# leave SMs idle, and output channels in two blocks (BLOCK_N2) so that a
# tile covers 160 (128 + 32) or 320 (256 + 64): a UNet's 320, 640 and 1280
# channels in whole tiles.
TMA_PADDED_CANDIDATES = [
    tile_config("tma_padded", 128, 128, 64, 4, 4), tile_config("tma_padded", 128, 256, 64, 8, 3),
    tile_config("tma_padded", 128, 64, 64, 4, 4), tile_config("tma_padded", 64, 128, 64, 4, 4),
    tile_config("tma_padded", 64, 256, 64, 4, 3),
    tile_config("tma_padded", 128, 128, 64, 4, 4, bn2=32), tile_config("tma_padded", 64, 128, 64, 4, 4, bn2=32),
    tile_config("tma_padded", 128, 256, 64, 8, 3, bn2=64), tile_config("tma_padded", 128, 128, 64, 8, 4, bn2=32),
    tile_config("tma_padded", 128, 256, 64, 8, 3, persistent=1),
    tile_config("tma_padded", 128, 128, 64, 4, 4, persistent=2),
]
# The im2col route's GEMM: one-row tiles of the column matrix (BLOCK_W =
# BLOCK_M, set by the launcher), the best tiles of a sweep over the UNets'
# NCHW 3x3 convs on an H100 (docs/performance.md, forty-second session).
IM2COL_CANDIDATES = [
    tile_config("im2col", 128, 128, 64, 4, 4), tile_config("im2col", 128, 128, 64, 4, 3),
    tile_config("im2col", 128, 256, 64, 8, 3), tile_config("im2col", 64, 128, 64, 4, 4),
    tile_config("im2col", 64, 64, 64, 4, 4),
]
# The few-output-channel route: tiles of its first stage, a 1x1 GEMM with
# N = C_out*KH*KW <= 64 and K = C_in (memory-bound: wide row tiles).
TAPS_CANDIDATES = [
    tile_config("taps", 128, 32, 64, 4, 3), tile_config("taps", 256, 32, 64, 8, 3),
    tile_config("taps", 128, 64, 128, 4, 3),
]
# The few-input-channel route: its reduction (C_in*KH*KW <= 64) is one or two
# K blocks, so the tile's rows and columns decide; memory-bound on the output.
FLAT_CANDIDATES = [
    tile_config("flat", 128, 128, 32, 4, 2), tile_config("flat", 128, 64, 32, 4, 2),
    tile_config("flat", 256, 64, 32, 8, 2),
    tile_config("flat", 64, 128, 64, 4, 2),
]
# Under the interpreter (the tuner's own tests): two of each, tiles sized for it.
# The Conv3d kernel's tiles (its "igemm" table route): the 2-D portable
# kernel's shapes, plus 8 warps on the wide tile.
CONV3D_CANDIDATES = [
    tile_config("igemm", 128, 64, 64, 4, 3), tile_config("igemm", 128, 128, 32, 4, 3),
    tile_config("igemm", 128, 128, 64, 8, 3),
    tile_config("igemm", 64, 128, 64, 4, 4),
]
# The sm90 Conv3d kernel: the 2-D TMA kernel's tile shapes that a Wan
# decoder's frames (60x104 to 480x832 pixels) fill; 32-deep K steps (96 and
# 192 input channels are 1.5 and 3 64-deep blocks, a quarter of the MMA work
# padding at 96); and output channels split in two blocks (BLOCK_N2) so that
# one tile covers 96 (64 + 32) or 192 (128 + 64) channels with no padding.
CONV3D_TMA_CANDIDATES = [
    tile_config("tma", 128, 128, 64, 4, 4, bw=64), tile_config("tma", 128, 128, 64, 4, 3, bw=128),
    tile_config("tma", 128, 256, 64, 8, 3, bw=128), tile_config("tma", 128, 64, 64, 4, 4, bw=32),
    tile_config("tma", 128, 128, 32, 4, 4, bw=64), tile_config("tma", 128, 128, 32, 4, 6, bw=64),
    tile_config("tma", 128, 64, 32, 4, 5, bw=64, bn2=32), tile_config("tma", 256, 64, 32, 8, 4, bw=64, bn2=32),
    tile_config("tma", 128, 128, 64, 8, 3, bw=64, bn2=64), tile_config("tma", 128, 128, 32, 8, 5, bw=64, bn2=64),
]
CONV3D_INTERPRETER_CANDIDATES = [
    tile_config("igemm", 1024, 128, 128, 4, 1), tile_config("tma", 256, 64, 64, 4, 1, bw=16),
]
INTERPRETER_CANDIDATES = [
    tile_config("igemm", 1024, 128, 128, 4, 1), tile_config("igemm", 64, 64, 32, 4, 1),
    tile_config("tma", 256, 64, 64, 4, 1, bw=16), tile_config("tma", 64, 32, 32, 4, 1, bw=64, persistent=1),
    tile_config("tma_padded", 64, 32, 32, 4, 1, bn2=16), tile_config("tma_padded", 128, 32, 32, 4, 1, persistent=1),
    tile_config("taps", 256, 32, 64, 4, 1), tile_config("flat", 256, 32, 32, 4, 1),
    tile_config("im2col", 64, 32, 32, 4, 1),
]



@dataclass(frozen=True)
class RouteEntry:
    """One route. ``kind``: the conv kind it serves ("conv2d",
    "conv_transpose2d", "conv3d"; None: PyTorch's routes, any kind);
    ``table``: the name a table config's ``"route"`` gives it (None: no
    table names it); ``launcher``: ``"module.function"`` of
    ``conv_patch.kernels`` that runs it (``launcher_of``); ``problem(spec,
    call, shape, target)``: why it cannot take a call, beyond its kind (None:
    never); ``exact_only``: a table may name it for measured shapes only;
    ``candidates``: the tuner's configs (``interpreter``: under the
    interpreter); ``launches(call)`` and ``descriptors``: what one call
    costs on it, for the cost model; ``hopper``: it needs sm90 or newer."""

    route: Route
    kind: Optional[str]
    table: Optional[str]
    info: str
    launcher: Optional[str] = None
    problem: Optional[Callable] = None
    exact_only: bool = False
    candidates: Tuple[dict, ...] = ()
    interpreter: Tuple[dict, ...] = ()
    launches: Callable = lambda call: 1
    descriptors: int = 0
    hopper: bool = False  # TMA and wgmma: sm90 and newer only (and the interpreter)
    splits_n: bool = False  # its tiles may split their output channels in two blocks (BLOCK_N2)
    repacks: bool = False  # the launcher repacks a module's weight at every call (a PyTorch copy)
    weight_in_place: bool = False  # reads the module's own (dense) weight: no pack, nothing refreshed
    # Taken launched eagerly too; False: on the graph path only (GPU time
    # alone), where its host time was measured to cost a launched model more
    # than its GPU time saves (docs/performance.md).
    launched: bool = True

    @property
    def is_kernel(self) -> bool:
        return self.launcher is not None


REGISTRY: Tuple[RouteEntry, ...] = (
    RouteEntry(Route.CONV2D_IGEMM, "conv2d", "igemm", "portable implicit-GEMM conv2d: any kernel size, stride, padding (per axis, 'same'/'valid'), dilation; groups=1, zero padding; NCHW, NHWC or strided input read in place; fp16/bf16 (fp32 accumulate), fp32 (TF32 when PyTorch allows it); fused bias, residual*beta, activation, scale",
               "conv2d.launch_conv2d", candidates=tuple(IGEMM_CANDIDATES),
               interpreter=tuple(c for c in INTERPRETER_CANDIDATES if c["route"] == "igemm")),
    RouteEntry(Route.CONV_TRANSPOSE2D_IGEMM, "conv_transpose2d", "igemm",
               'portable implicit-GEMM conv_transpose2d (gather form, split by output phase): stride, padding, output_padding, dilation; groups=1, zero padding; same layouts, dtypes and epilogue as conv2d',
               "conv_transpose2d.launch_conv_transpose2d"),
    RouteEntry(Route.CONV2D_TMA, "conv2d", "tma", 'Hopper (sm90+) conv2d: TMA tensor descriptors (their zero fill is the padding) feeding wgmma, multi-stage pipeline; stride 1, kernels larger than 1x1, any padding and dilation; fp16/bf16; C_in a multiple of 8; NHWC read in place, NCHW through one NHWC staging copy (output written NCHW directly), except 1x1 and Kx1 convs without column padding under one-pixel-row tiles, whose NCHW input is read in place (the dense NCHW plane of a 1x1 conv as one row); same fused epilogue as the portable kernels',
               "conv2d_tma.launch_conv2d_tma", tma_problem, candidates=tuple(TMA_CANDIDATES),
               interpreter=tuple(c for c in INTERPRETER_CANDIDATES if c["route"] == "tma"),
               # The NHWC staging copy, except where NCHW is read in place.
               launches=lambda call: 1 if call.layout == "nhwc" else 2, descriptors=3, hopper=True),
    RouteEntry(Route.CONV2D_TMA_PADDED, "conv2d", "tma_padded", "Hopper (sm90+) conv2d over a zero-bordered NHWC copy of the input (one staging pass from NCHW or NHWC, the border written as zeros), described as one [pixels, C] matrix: every tap's operand is one 2-D TMA box straight into wgmma, any tile height whatever the image width (the border rows computed and not stored); a tile's output channels in one block or two (BLOCK_N2: 160 = 128 + 32); stride 1, any kernel size, padding and dilation; fp16/bf16, C_in a multiple of 8; output written in the caller's layout; same fused epilogue",
               "conv2d_tma_padded.launch_conv2d_tma_padded", tma_padded_problem,
               candidates=tuple(TMA_PADDED_CANDIDATES),
               interpreter=tuple(c for c in INTERPRETER_CANDIDATES if c["route"] == "tma_padded"),
               launches=lambda call: 2, descriptors=3, hopper=True, splits_n=True),
    RouteEntry(Route.CONV2D_TAPS, "conv2d", "taps", "few output channels (C_out*KH*KW <= 64, e.g. a VAE's conv_out): the input read once by a 1x1 GEMM against every tap's weights (fp32 partials), then each output pixel's taps summed; any stride, padding, dilation; same layouts, dtypes and fused epilogue as conv2d",
               "conv2d_taps.launch_conv2d_taps", lambda spec, call, shape, target: taps_problem(spec),
               candidates=tuple(TAPS_CANDIDATES),
               interpreter=tuple(c for c in INTERPRETER_CANDIDATES if c["route"] == "taps"),
               launches=lambda call: 2),
    RouteEntry(Route.CONV2D_FLAT, "conv2d", "flat", "few input channels (C_in*KH*KW <= 64, e.g. a VAE encoder's conv_in on an RGB image): the implicit GEMM with its reduction over (c_in, kh, kw) flattened into one dimension, so 3x3x3 is one K = 32 block instead of nine of K = 16; any stride, padding, dilation; same layouts, dtypes and fused epilogue as conv2d",
               "conv2d_flat.launch_conv2d_flat", lambda spec, call, shape, target: flat_problem(spec),
               candidates=tuple(FLAT_CANDIDATES),
               interpreter=tuple(c for c in INTERPRETER_CANDIDATES if c["route"] == "flat")),
    RouteEntry(Route.CONV2D_IM2COL, "conv2d", "im2col", "Hopper (sm90+) conv2d as im2col + TMA GEMM: the input unfolded into a column matrix [N, C_in*KH*KW, OH*OW] (any stride, padding, dilation; one pass), then the GEMM against the module's dense NCHW weight read in place as [C_out, C_in*KH*KW] (no weight pack, nothing refreshed per call), the output written in the caller's layout; fp16/bf16, C_in*KH*KW and OH*OW multiples of 8; same fused epilogue. For small images under large weights (a UNet's deep convs)",
               "im2col.launch_conv2d_im2col", im2col_problem, candidates=tuple(IM2COL_CANDIDATES),
               interpreter=tuple(c for c in INTERPRETER_CANDIDATES if c["route"] == "im2col"),
               launches=lambda call: 2, descriptors=3, hopper=True, weight_in_place=True, launched=False),
    RouteEntry(Route.CONV3D_IGEMM, "conv3d", "igemm", "portable implicit-GEMM conv3d: any kernel size, stride, padding (front and back per axis) and dilation; groups=1, zero padding; NCDHW or NDHWC read in place; a causal conv's cached frames read in place in front of the input (no concatenation written); same dtypes and fused epilogue as conv2d. Taken under the interpreter; on a GPU only for shapes an architecture's table measured faster than cuDNN as called (conv3d.exact: bench.video --layers --write-table), PyTorch's conv3d everywhere else",
               "conv3d.launch_conv3d", candidates=tuple(CONV3D_CANDIDATES),
               interpreter=tuple(c for c in CONV3D_INTERPRETER_CANDIDATES if c["route"] == "igemm")),
    RouteEntry(Route.CONV3D_TMA, "conv3d", "tma", "Hopper (sm90+) conv3d: TMA tensor descriptors over the dense NDHWC input and its cached frames (their zero fill is the padding, in time too) feeding wgmma, one pipelined loop over the cached frames' taps and one over the input's, a tile's output channels in one block or two (BLOCK_N2: 96 = 64 + 32); any kernel size, time stride and dilation, H and W at stride 1; fp16/bf16, C_in a multiple of 8; the weight repacked to channels_last_3d per call; same fused epilogue. On a GPU only for shapes a table measured faster than cuDNN as called (diffusers' Wan-family decoders run NDHWC inside in fp16/bf16 to reach it)",
               "conv3d_tma.launch_conv3d_tma", conv3d_tma_problem, candidates=tuple(CONV3D_TMA_CANDIDATES),
               interpreter=tuple(c for c in CONV3D_INTERPRETER_CANDIDATES if c["route"] == "tma"), hopper=True,
               repacks=True, splits_n=True),
    RouteEntry(Route.CUDNN, None, "cudnn", "the original module, chosen because the architecture's table records cuDNN measured faster for this exact shape (convpatch tune) or the cost model predicts PyTorch faster as called: cuDNN computes the convolution, then bias and the fused epilogue run as one pass (conv_patch.ops.epilogue) on NHWC outputs, as PyTorch ops otherwise. A Conv3d call the kernels do not take on a GPU with measured conv3d entries runs it too (ops.conv3d.cudnn_conv3d): the time padding, the cached frames and the input in one concatenation, the symmetric padding passed to cuDNN instead of an F.pad copy, and on NDHWC outputs the bias and epilogue as one pass", exact_only=True),
    RouteEntry(Route.FALLBACK, None, None, 'the original PyTorch module (cuDNN/ATen): every case the kernels do not take'),
)

# Derived views, all from REGISTRY.
BY_ROUTE: Dict[Route, RouteEntry] = {e.route: e for e in REGISTRY}
# What each route accepts; printed by `convpatch info`.
ROUTE_INFO: Dict[Route, str] = {e.route: e.info for e in REGISTRY}
# Table "route" values and the kernel-family routes they name, per conv kind.
TABLE_ROUTES: Dict[Tuple[str, str], Route] = {(e.kind, e.table): e.route for e in REGISTRY if e.kind and e.table}
# Every "route" value a table may hold, the default first.
TABLE_NAMES: Tuple[str, ...] = tuple(dict.fromkeys(e.table for e in REGISTRY if e.table))
# The table name of the portable kernel, which every conv takes (the
# default of a config without a "route"), and of PyTorch's measured route.
DEFAULT_TABLE_ROUTE = BY_ROUTE[Route.CONV2D_IGEMM].table
CUDNN_TABLE_ROUTE = BY_ROUTE[Route.CUDNN].table


def table_names(kind: str) -> Tuple[str, ...]:
    """The "route" values a table entry of ``kind`` may hold: its kernel
    routes and PyTorch's measured one."""
    return tuple(e.table for e in REGISTRY if e.kind == kind and e.table) + (CUDNN_TABLE_ROUTE,)


def route_of_table(kind: str, name: str) -> Route:
    """The route a table's ``"route"`` value names for a conv of ``kind``."""
    if name == CUDNN_TABLE_ROUTE:
        return Route.CUDNN
    return TABLE_ROUTES[(kind, name)]


def kernel_routes(kind: str) -> Tuple[RouteEntry, ...]:
    """The kernel routes of a conv kind, the default first."""
    return tuple(e for e in REGISTRY if e.kind == kind and e.is_kernel)


def route_problem(route: str, spec, call: CallDesc, shape: tuple, target: Target) -> Optional[str]:
    """Why the table route ``route`` cannot take this call, or None; the one
    place the decision, a given config and the tuner ask."""
    entry = BY_ROUTE.get(TABLE_ROUTES.get((spec.kind, route)))
    if entry is None or entry.problem is None:
        return None
    return entry.problem(spec, call, shape, target)


def exact_only_routes() -> Tuple[str, ...]:
    """Table routes a table may name for measured shapes only."""
    return tuple(e.table for e in REGISTRY if e.exact_only)


_LAUNCHERS: Dict[Route, tuple] = {}


def launcher_of(route: Route) -> Callable:
    """The launcher of a kernel route, its module imported on the first use
    (importing the kernels imports Triton) and held."""
    held = _LAUNCHERS.get(route)
    if held is None:
        module, name = BY_ROUTE[route].launcher.rsplit(".", 1)
        held = _LAUNCHERS[route] = (importlib.import_module(f"conv_patch.kernels.{module}"), name)
    return getattr(held[0], held[1])


def tuner_candidates(target: Target, kind: str = "conv2d") -> list:
    """The configs ``convpatch tune`` (``kind`` "conv2d") and the conv3d
    layer tuner (``kind`` "conv3d") measure on ``target``: the kind's kernel
    routes' own, the TMA ones from sm90 only; under the interpreter, their
    interpreter candidates (tiles sized for it)."""
    out = []
    for e in kernel_routes(kind):
        if e.hopper and not (target.interpreter or tma_arch(target.arch)):
            continue
        out += e.interpreter if target.interpreter else e.candidates
    return [dict(c) for c in out]
