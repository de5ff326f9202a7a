"""Shapes are runtime arguments of every kernel, never tl.constexpr, so a new
resolution reuses the compiled kernel (the GPU test counts compilations)."""

import inspect

import pytest
import triton.language as tl

from _util import conv_kernels

KERNELS = conv_kernels()

SWITCHES = {"HAS_BIAS", "HAS_RES", "ACT", "IDX64", "UPCAST"}
TILES = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"}
ALLOWED_CONSTEXPR = {
    "conv2d": SWITCHES | TILES | {"PRECISION"},
    "conv_transpose2d": SWITCHES | TILES | {"PRECISION"},
    "conv2d_flat": SWITCHES | TILES | {"PRECISION"},
    # HAS_CACHE: whether cached frames precede the input in time.
    "conv3d": SWITCHES | TILES | {"PRECISION", "HAS_CACHE"},
    # BLOCK_W is the TMA tile's width in pixels; STRIDED picks the 5-D
    # descriptor of stride > 1 (the stride itself, SH/SW, is a runtime value);
    # PERSISTENT the tile loop (the grid size is a runtime value); X_NCHW the
    # NCHW input boxes and the transposed GEMM (a layout, not a shape).
    "conv2d_tma": SWITCHES | TILES | {"BLOCK_W", "STRIDED", "TMA_IO", "PERSISTENT", "X_NCHW"},
    # BLOCK_W as for conv2d_tma; HAS_CACHE as for conv3d; BLOCK_N2 a second
    # block of output channels per tile, a tile size, SPLIT_N whether it is used.
    "conv3d_tma": SWITCHES | TILES | {"BLOCK_W", "HAS_CACHE", "BLOCK_N2", "SPLIT_N"},
    # BLOCK_N2 and SPLIT_N as for conv3d_tma, PERSISTENT as for conv2d_tma.
    "conv2d_tma_padded": SWITCHES | TILES | {"BLOCK_N2", "SPLIT_N", "PERSISTENT"},
}
SHAPE_ARGS = {"N", "C_in", "H", "W", "C_out", "OH", "OW", "KH", "KW", "PH", "PW",
              "DH", "DW", "son", "soc", "soh", "sow"}
# The TMA kernel reads the input through a descriptor (shape and strides are
# runtime fields of it); its conv stride is SH/SW.
POINTER_SHAPE_ARGS = {"STH", "STW", "sxn", "sxc", "sxh", "sxw"}
TMA_SHAPE_ARGS = {"SH", "SW"}
# The Conv3d kernels' time axis (the TMA one reads the input through
# descriptors too, and H and W only at stride 1).
CONV3D_ARGS = {"T", "Tc", "OD", "KT", "PT", "DT"}
# The padded TMA kernel reads a zero-bordered copy: its padded size (HP, WP)
# stands for the input's size and padding.
PADDED_SHAPE_ARGS = {"N", "C_in", "HP", "WP", "C_out", "OH", "OW", "KH", "KW", "DH", "DW", "son", "soc", "soh", "sow"}
EXTRA_SHAPE_ARGS = {"conv2d_tma": TMA_SHAPE_ARGS, "conv3d": POINTER_SHAPE_ARGS | CONV3D_ARGS | {"STT"},
                    "conv3d_tma": CONV3D_ARGS | {"ST", "sot", "srt"}}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_only_switches_and_tiles_are_constexpr(name):
    params = inspect.signature(KERNELS[name].fn).parameters
    constexpr = {n for n, p in params.items() if p.annotation is tl.constexpr}
    assert constexpr == ALLOWED_CONSTEXPR[name]
    shape_args = (PADDED_SHAPE_ARGS if name == "conv2d_tma_padded"
                  else SHAPE_ARGS | EXTRA_SHAPE_ARGS.get(name, POINTER_SHAPE_ARGS))
    assert shape_args <= set(params) and not (shape_args & constexpr)


# The extents that move with a call's batch and resolution, per kernel, that
# Triton must not specialise (kernels/common.py): each specialisation is a
# compile of its own. The channel counts and the strides stay specialised.
UNSPECIALISED = {
    "conv2d": {"N"}, "conv_transpose2d": {"N"}, "conv2d_flat": {"N"}, "conv3d": {"N"},
    "conv2d_tma": {"N", "H", "W", "OH", "OW"},
    "conv2d_tma_padded": {"N", "HP", "WP", "OH", "OW"},
    "conv3d_tma": {"N", "T", "H", "W", "Tc", "OD", "OH", "OW"},
    "pad_nhwc": {"H", "W", "HP", "WP"}, "im2col": {"L", "P8", "H", "W", "OW"},
    "attention_scores": {"R", "M"}, "attention_combine": {"R", "T"}, "attention_pv": {"R", "M", "split_steps"},
    "group_norm_stats_nhwc": {"HW", "CHUNK", "SPLITS"}, "group_norm_apply_nhwc": {"HW", "TILES"},
    "group_norm_finalize": {"S", "psn", "pss", "psc"},
    "depthwise": {"H", "W", "OH", "OW", "P_TILES"}, "grouped_pointwise": {"M"},
    "epilogue": {"HW", "W", "TILES"},
    # Along the pixels of NCHW: their divisibility vectorises the loads.
    "group_norm_stats": set(), "group_norm_apply_nchw": set(), "nchw_to_nhwc": set(),
}
OTHER_KERNELS = ("from conv_patch.kernels import attention as a, depthwise as d, group_norm as g, "
                 "grouped_pointwise as gp, im2col as ic, layout as l; "
                 "from conv_patch.kernels import epilogue as ep; "
                 "ks.update(epilogue=ep.epilogue_kernel, depthwise=d.depthwise_kernel, grouped_pointwise=gp.grouped_pointwise_kernel, pad_nhwc=l.pad_nhwc_kernel, im2col=ic.im2col_kernel, nchw_to_nhwc=l.nchw_to_nhwc_kernel, "
                 "attention_scores=a.attention_scores_kernel, attention_combine=a.attention_combine_kernel, "
                 "attention_pv=a.attention_pv_kernel, group_norm_stats=g.group_norm_stats_kernel, "
                 "group_norm_stats_nhwc=g.group_norm_stats_nhwc_kernel, "
                 "group_norm_apply_nhwc=g.group_norm_apply_nhwc_kernel, "
                 "group_norm_apply_nchw=g.group_norm_apply_nchw_kernel, "
                 "group_norm_finalize=g.group_norm_finalize_kernel); ")


def test_batch_and_size_extents_are_not_specialised():
    """Read from the compiled (not interpreted) kernels, in a process without
    the interpreter: which arguments Triton specialises on their value."""
    import json
    import os
    import subprocess
    import sys
    code = ("import json, sys; sys.path.insert(0, 'tests'); from _util import conv_kernels; ks = conv_kernels(); "
            + OTHER_KERNELS +
            "print(json.dumps({n: [p.name for p in k.params if not p.is_constexpr and p.do_not_specialize] "
            "for n, k in ks.items()}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = {n: set(v) for n, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    assert got == UNSPECIALISED
