"""Kernel configuration tables: ``configs/<arch>.json`` and ``configs/default.json``.

Lookup tiers, first hit wins: the exact shape key, then the first M-bucket
(output pixels N*OH*OW) that matches, then ``any``. An architecture without a
table uses ``default.json``. Values are chosen offline; nothing here times
anything.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from importlib import resources
from typing import Optional, Tuple

import torch

from conv_patch.routing.calibration import Calibration
from conv_patch.routing.registry import DEFAULT_TABLE_ROUTE, REGISTRY, TABLE_NAMES, exact_only_routes, table_names
from conv_patch.specs import ConvSpec, dtype_name, layout_of

TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
KINDS = ("conv2d", "conv_transpose2d")
# "route" of a config (conv_patch/routing/registry.py): the portable implicit
# GEMM (the default), the Hopper TMA kernel, the few-output-channel taps route
# (its tiles are those of its first stage, a portable 1x1 GEMM), the
# few-input-channel flat route, or cuDNN (exact entries only, where the tuner
# measured it faster).
ROUTES = TABLE_NAMES
ALL_ROUTES = frozenset(ROUTES)
# Exact keys of one 16-bit dtype serve the other: same element size, same
# tensor-core rate, so the same tile wins (the tuner runs bf16).
SHARED_EXACT_DTYPE = {"float16": "bfloat16"}


class TableError(ValueError):
    pass


def shape_key(spec: ConvSpec, shape: tuple, layout: str, dtype: torch.dtype) -> str:
    """The exact-tier key, e.g.
    ``n1.c256.h1024.w1024.o256.k3x3.s1x1.p1x1.d1x1.nhwc.bfloat16``
    (transposed convs add ``.op<h>x<w>``; asymmetric padding ``/b<h>x<w>``)."""
    n, c, h, w = shape
    k, s, p, d = spec.kernel, spec.stride, spec.pad_begin, spec.dilation
    key = f"n{n}.c{c}.h{h}.w{w}.o{spec.out_channels}.k{k[0]}x{k[1]}.s{s[0]}x{s[1]}.p{p[0]}x{p[1]}"
    if spec.pad_end != spec.pad_begin:
        key += f"/b{spec.pad_end[0]}x{spec.pad_end[1]}"
    key += f".d{d[0]}x{d[1]}"
    if spec.transposed:
        key += f".op{spec.output_padding[0]}x{spec.output_padding[1]}"
    return f"{key}.{layout}.{dtype_name(dtype)}"


def conv3d_shape_key(spec, shape: tuple, cache_frames: int, layout: str, dtype: torch.dtype) -> str:
    """The conv3d exact-tier key of a ``conv3d.Conv3dSpec`` call on input
    ``shape`` [N, C, T, H, W] after ``cache_frames`` cached frames, e.g.
    ``n1.c384.t2.h60.w104.o384.k3x3x3.s1x1x1.p2/0x1x1.d1x1x1.cache2.ncdhw.bfloat16``
    (padding per axis, front/back where they differ)."""
    n, c, t, h, w = shape
    k, s, d = spec.kernel, spec.stride, spec.dilation
    pads = "x".join(str(f) if f == b else f"{f}/{b}" for f, b in spec.pads)
    return (f"n{n}.c{c}.t{t}.h{h}.w{w}.o{spec.out_channels}.k{k[0]}x{k[1]}x{k[2]}.s{s[0]}x{s[1]}x{s[2]}"
            f".p{pads}.d{d[0]}x{d[1]}x{d[2]}.cache{cache_frames}.{layout}.{dtype_name(dtype)}")


def conv3d_keys(spec, shape: tuple, cache_frames: int, layout: str, dtype: torch.dtype) -> list:
    """The call's ``conv3d_shape_key`` first, then the keys of the same
    GEMM with its cached frames and front time padding traded (their sum
    kept): a causal conv's chunk reads that many frames before its own, and
    whether they are cached frames or the zero fill changes no arithmetic,
    only where they are read from. A clip's steady-state chunks (two cached
    frames, no padding) are found where the tuner measured its second chunk
    (one cached frame and one of padding) or its first (padding only)."""
    keys = [conv3d_shape_key(spec, shape, cache_frames, layout, dtype)]
    (front, back), rest = spec.pads[0], spec.pads[1:]
    for cached in range(cache_frames + front, -1, -1):
        if cached != cache_frames:
            other = dataclasses.replace(spec, pads=((cache_frames + front - cached, back),) + tuple(rest))
            keys.append(conv3d_shape_key(other, shape, cached, layout, dtype))
    return keys


def conv3d_call_key(spec, x: torch.Tensor, cache: Optional[torch.Tensor]) -> str:
    """``conv3d_shape_key`` of a call: input ``x`` after ``cache``'s frames."""
    return conv3d_shape_key(spec, tuple(x.shape), 0 if cache is None else cache.shape[2], layout_of(x), x.dtype)


def _check_config(cfg, where: str, exact: bool = False, conv3d: bool = False) -> dict:
    if not isinstance(cfg, dict):
        raise TableError(f"{where}: a config must be an object")
    route = route_of(cfg)
    if route not in ROUTES:
        raise TableError(f"{where}: route must be one of {', '.join(ROUTES)}, got {route!r}")
    if route in exact_only_routes():
        if not exact:
            raise TableError(f"{where}: route {route!r} is only allowed for an exact shape (where it was measured)")
        return cfg
    for k in TILE_KEYS:
        v = cfg.get(k)
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise TableError(f"{where}: {k} must be a power of two >= 16, got {v!r}")
    for k in ("GROUP_M", "num_warps", "num_stages"):
        if k in cfg and (not isinstance(cfg[k], int) or cfg[k] < 1):
            raise TableError(f"{where}: {k} must be a positive integer, got {cfg[k]!r}")
    # The Hopper routes' tiles: a width in pixels (BLOCK_W), a persistent
    # grid, and for the conv3d kernel a second block of output channels.
    hopper = any(e.hopper for e in REGISTRY if e.table == route)
    bn2 = cfg.get("BLOCK_N2", 0)
    splits = [e.route.value for e in REGISTRY if e.splits_n]
    if bn2 and not any(e.splits_n for e in REGISTRY if e.table == route and (e.kind == "conv3d") == conv3d):
        raise TableError(f"{where}: BLOCK_N2 splits the output channels of the {' and '.join(splits)} kernels only")
    if not isinstance(bn2, int) or isinstance(bn2, bool) or (bn2 and (bn2 < 16 or bn2 & (bn2 - 1))):
        raise TableError(f"{where}: BLOCK_N2 must be 0 or a power of two >= 16, got {bn2!r}")
    if hopper:
        bw = cfg.get("BLOCK_W", 16)
        if not isinstance(bw, int) or bw < 1 or bw & (bw - 1) or bw > cfg["BLOCK_M"]:
            raise TableError(f"{where}: BLOCK_W must be a power of two <= BLOCK_M, got {bw!r}")
        for flag in ("tma_io", "nchw_in_place"):
            if not isinstance(cfg.get(flag, True), bool):
                raise TableError(f"{where}: {flag} must be true or false, got {cfg[flag]!r}")
        per_sm = cfg.get("persistent", 0)
        if not isinstance(per_sm, int) or isinstance(per_sm, bool) or per_sm < 0:
            raise TableError(f"{where}: persistent must be a number of programs per SM (0: off), got {per_sm!r}")
        if cfg["BLOCK_M"] < 64 or cfg.get("num_warps", 4) % 4:
            # wgmma: a warpgroup is 4 warps and its M tile is 64.
            raise TableError(f"{where}: the {route} route needs BLOCK_M >= 64 and num_warps a multiple of 4")
    return cfg


def validate_table(table, name: str) -> dict:
    """Raise TableError naming ``name`` and the bad entry; return the table."""
    if not isinstance(table, dict):
        raise TableError(f"{name}: the table must be a JSON object")
    for kind in KINDS:
        sec = table.get(kind)
        if sec is None:
            continue
        if not isinstance(sec, dict):
            raise TableError(f"{name}: {kind} must be an object")
        for key, cfg in (sec.get("exact") or {}).items():
            _check_config(cfg, f"{name}: {kind}.exact[{key!r}]", exact=True)
        for i, b in enumerate(sec.get("buckets") or []):
            where = f"{name}: {kind}.buckets[{i}]"
            if not isinstance(b, dict) or "config" not in b:
                raise TableError(f"{where}: needs a config")
            if b.get("max_m") is not None and not isinstance(b["max_m"], int):
                raise TableError(f"{where}: max_m must be an integer or null")
            lo = b.get("min_m")
            if lo is not None and (not isinstance(lo, int) or lo < 0
                                   or (b.get("max_m") is not None and lo >= b["max_m"])):
                raise TableError(f"{where}: min_m must be a non-negative integer below max_m")
            _check_config(b["config"], where)
        if "any" in sec:
            _check_config(sec["any"], f"{name}: {kind}.any")
    sec = table.get("conv3d")
    if sec is not None:
        # Measured shapes only: nothing says the kernel beats cuDNN elsewhere.
        if not isinstance(sec, dict) or set(sec) - {"exact"}:
            raise TableError(f"{name}: conv3d must be an object with only an exact section (measured shapes)")
        for key, cfg in (sec.get("exact") or {}).items():
            where = f"{name}: conv3d.exact[{key!r}]"
            _check_config(cfg, where, exact=True, conv3d=True)
            if route_of(cfg) not in table_names("conv3d"):
                raise TableError(f"{where}: route must be one of {', '.join(table_names('conv3d'))}, "
                                 f"got {route_of(cfg)!r}")
            for t in ("ours_ms", "cudnn_ms"):
                if not (isinstance(cfg.get(t), (int, float)) and cfg[t] > 0):
                    raise TableError(f"{where}: needs the measured {t} (a positive number)")
    if "calibration" in table:
        try:
            Calibration.of(table["calibration"], f"{name}: calibration")
        except ValueError as e:
            raise TableError(str(e)) from None
    source = table.get("source")
    if source is not None and (not isinstance(source, str) or "\n" in source or len(source) > SOURCE_MAX):
        raise TableError(f"{name}: source must be one line of at most {SOURCE_MAX} characters (a table's "
                         "history belongs in docs/tuning-log.md)")
    return table


def _read_packaged(name: str) -> Optional[dict]:
    res = resources.files("conv_patch.configs").joinpath(f"{name}.json")
    if not res.is_file():
        return None
    return validate_table(json.loads(res.read_text()), f"configs/{name}.json")


# A table's ``source``: one line saying what it was measured from.
SOURCE_MAX = 600


class Table:
    """A validated table and its name; remembers its lookups, so the
    per-call cost after the first call of a shape is one dict access."""

    def __init__(self, data: dict, name: str):
        self.data = data
        self.name = name
        self._memo = {}
        self._calibration = None

    @property
    def calibration(self) -> Calibration:
        """The cost model's facts of this machine: the table's own
        ``"calibration"``, else the curated default's."""
        if self._calibration is None:
            own = self.data.get("calibration")
            self._calibration = (Calibration.of(own) if own is not None
                                 else packaged_table("default").calibration)
        return self._calibration

    def lookup(self, spec: ConvSpec, shape: tuple, layout: str, dtype: torch.dtype,
               m: int, routes: frozenset = ALL_ROUTES) -> Tuple[dict, str]:
        key = (spec, shape, layout, dtype, m, routes)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = lookup(self.data, spec, shape, layout, dtype, m, routes)
        return hit

    def exact(self, key: str, kind: str = "conv2d") -> Optional[dict]:
        """The exact entry of a shape key of ``kind`` (``shape_key``;
        ``conv3d_shape_key`` for "conv3d"), a 16-bit dtype's falling back to
        the other's (``SHARED_EXACT_DTYPE``), or None."""
        exact = (self.data.get(kind) or {}).get("exact") or {}
        cfg = exact.get(key)
        if cfg is None:
            stem, dname = key.rsplit(".", 1)
            other = SHARED_EXACT_DTYPE.get(dname)
            cfg = exact.get(f"{stem}.{other}") if other else None
        return cfg

    @property
    def has_conv3d(self) -> bool:
        """Whether the table holds any measured conv3d entry."""
        return bool((self.data.get("conv3d") or {}).get("exact"))

    def conv3d_exact(self, key: str) -> Optional[dict]:
        """The conv3d entry of a ``conv3d_shape_key`` (``exact``), or None."""
        return self.exact(key, "conv3d")

    def __repr__(self) -> str:
        return f"Table({self.name!r})"


@functools.lru_cache(maxsize=None)
def packaged_table(arch: str) -> Table:
    """The table of ``arch``; ``default`` when there is no table of its own."""
    table = _read_packaged(arch) if arch != "default" else None
    if table is not None:
        return Table(table, arch)
    return Table(_read_packaged("default"), "default")


def has_table(arch: str) -> bool:
    return packaged_table(arch).name == arch


def load_user_table(table) -> Table:
    """A table given through PatchConfig: a dict or a JSON file path."""
    if isinstance(table, dict):
        return Table(validate_table(table, "PatchConfig.table"), "user")
    path = os.fspath(table)
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise TableError(f"{path}: cannot read the config table ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise TableError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return Table(validate_table(data, path), path)


def route_of(cfg: dict) -> str:
    """The table route a config names (the portable kernel where it names none)."""
    return cfg.get("route", DEFAULT_TABLE_ROUTE)


def lookup(table: dict, spec: ConvSpec, shape: tuple, layout: str, dtype: torch.dtype,
           m: int, routes: frozenset = ALL_ROUTES) -> Tuple[dict, str]:
    """(config, tier) where tier is 'exact', 'bucket' or 'any'. Configs whose
    route is not in ``routes`` (the ones this call can take) are skipped."""
    sec = table.get(spec.kind) or {}
    exact = sec.get("exact") or {}
    dname = dtype_name(dtype)
    for dn in (dname, SHARED_EXACT_DTYPE.get(dname)):
        cfg = exact.get(shape_key(spec, shape, layout, dtype).rsplit(".", 1)[0] + f".{dn}") if dn else None
        if cfg is not None and route_of(cfg) in routes:
            return cfg, "exact"
    for b in sec.get("buckets") or []:
        if b.get("max_m") is not None and m > b["max_m"]:
            continue
        if b.get("min_m") is not None and m <= b["min_m"]:
            continue
        if "dtypes" in b and dname not in b["dtypes"]:
            continue
        if "layouts" in b and layout not in b["layouts"]:
            continue
        if route_of(b["config"]) not in routes:
            continue
        return b["config"], "bucket"
    if "any" in sec and route_of(sec["any"]) in routes:
        return sec["any"], "any"
    # Nothing here this call can take: the curated defaults (portable only).
    default = packaged_table("default").data
    if default is table:
        raise TableError(f"configs/default.json has no entry for {spec.kind}")
    return lookup(default, spec, shape, layout, dtype, m, routes)
