"""Shapes are runtime arguments of every kernel, never tl.constexpr, so a new
resolution reuses the compiled kernel (the GPU test counts compilations)."""

import inspect

import pytest
import triton.language as tl

from conv_patch.kernels import KERNELS

ALLOWED_CONSTEXPR = {"HAS_BIAS", "HAS_RES", "ACT", "IDX64", "UPCAST", "PRECISION",
                     "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"}
SHAPE_ARGS = {"N", "C_in", "H", "W", "C_out", "OH", "OW", "KH", "KW", "STH", "STW", "PH", "PW",
              "DH", "DW", "sxn", "sxc", "sxh", "sxw", "son", "soc", "soh", "sow"}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_only_switches_and_tiles_are_constexpr(name):
    params = inspect.signature(KERNELS[name].fn).parameters
    constexpr = {n for n, p in params.items() if p.annotation is tl.constexpr}
    assert constexpr == ALLOWED_CONSTEXPR
    assert SHAPE_ARGS <= set(params) and not (SHAPE_ARGS & constexpr)
