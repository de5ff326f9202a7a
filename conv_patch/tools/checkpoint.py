"""Reading a user's checkpoint without trusting it.

A safetensors file is checked byte by byte before anything is allocated:
header length against the file size, the header as a JSON object, every
tensor's dtype, shape and offsets, byte sizes against offsets, overlaps and
gaps. Only then are tensors read (through the ``safetensors`` library). Any
problem becomes a ``CheckpointError`` whose message is one line naming the
file. Files are only ever opened for reading.

Pickle checkpoints (``.ckpt``, ``.pt``, ``.pth``, ``.bin``) can run code when
loaded; they are refused unless the caller allows them, and then loaded with
``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Dict

import torch

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")

# safetensors dtype strings -> (torch dtype name, bytes per element)
DTYPES = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2),
    "U16": ("uint16", 2), "I32": ("int32", 4), "U32": ("uint32", 4), "I64": ("int64", 8),
    "U64": ("uint64", 8), "F16": ("float16", 2), "BF16": ("bfloat16", 2), "F32": ("float32", 4),
    "F64": ("float64", 8), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}


# The safetensors library's own limit on the header (MAX_HEADER_SIZE): a
# larger length field is refused before anything is read, however large the
# (possibly sparse) file claims to be.
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """Bad input: the message is one line naming the file and the problem."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int


def _short(v, limit: int = 60) -> str:
    """A header value as an error message shows it: one line, bounded."""
    text = repr(v).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _detail(e: BaseException, limit: int = 160) -> str:
    """An exception as an error message quotes it: ``Type: first line``,
    terminal colour codes removed, and where it is long, cut at a word
    boundary with "..." rather than mid-word."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]
    text = lines[0] if lines else "no detail"
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return f"{type(e).__name__}: {text}"


def _fail(path, msg):
    raise CheckpointError(f"{path}: {msg}")


def _check_path(path: str) -> int:
    if not os.path.exists(path):
        _fail(path, "no such file")
    if os.path.isdir(path):
        _fail(path, "is a directory, not a checkpoint file")
    try:
        size = os.path.getsize(path)
    except OSError as e:
        _fail(path, f"cannot read ({e.strerror})")
    if size == 0:
        _fail(path, "empty file")
    return size


def read_header(path: str) -> Dict[str, TensorEntry]:
    """Validate a safetensors file's header against the file; return its tensors."""
    size = _check_path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                _fail(path, f"not a safetensors file ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                _fail(path, f"not a safetensors file: header length {n} bytes is over the format's "
                            f"{MAX_HEADER_BYTES}-byte limit")
            if n > size - 8:
                _fail(path, f"not a safetensors file or truncated: header length {n} bytes is larger than "
                            f"the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        _fail(path, f"cannot read ({e.strerror})")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        _fail(path, f"not a safetensors file (the header is not JSON: {_detail(e)})")
    except RecursionError:
        _fail(path, "not a safetensors file (the header's JSON is nested too deeply)")
    if not isinstance(header, dict):
        _fail(path, f"not a safetensors file (the header is a JSON {type(header).__name__}, not an object)")

    data_size = size - 8 - n
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            _fail(path, f"tensor {name!r}: header entry lacks dtype, shape or data_offsets")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            _fail(path, f"tensor {name!r} has unknown dtype {_short(dtype)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            _fail(path, f"tensor {name!r} has an invalid shape {_short(shape)}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or offs[0] < 0 or offs[0] > offs[1]):
            _fail(path, f"tensor {name!r} has invalid data_offsets {_short(offs)}")
        begin, end = offs
        if end > data_size:
            _fail(path, f"tensor {name!r} data [{begin}, {end}) runs past the end of the file's "
                        f"{data_size} data bytes (truncated file?)")
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        if nbytes != end - begin:
            _fail(path, f"tensor {name!r} declares shape {shape} of {dtype} = {nbytes} bytes, but its offsets "
                        f"span {end - begin} bytes")
        entries[name] = TensorEntry(name, dtype, tuple(shape), begin, end)
    if not entries:
        _fail(path, "holds no tensors")
    pos, prev = 0, None
    for e in sorted(entries.values(), key=lambda t: (t.begin, t.end)):
        if e.begin < pos:
            _fail(path, f"tensors {prev!r} and {e.name!r} overlap in the data section")
        if e.begin > pos:
            _fail(path, f"the data section has a gap of {e.begin - pos} bytes at byte {pos} "
                        "(not a valid safetensors file)")
        pos, prev = e.end, e.name
    if pos != data_size:
        _fail(path, f"{data_size - pos} bytes after the last tensor are not covered by the header "
                    "(not a valid safetensors file)")
    return entries


def load_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """The tensors of a validated safetensors file, on the CPU."""
    entries = read_header(path)
    from safetensors import SafetensorError, safe_open
    out = {}
    try:
        with safe_open(path, framework="pt") as f:
            for name in entries:
                out[name] = f.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as e:
        _fail(path, f"cannot read its tensors ({_detail(e)})")
    return out


def load_pickle(path: str) -> Dict[str, torch.Tensor]:
    """A pickle checkpoint through ``torch.load(weights_only=True)``: tensors
    and plain containers only, no code. A full training checkpoint's
    ``state_dict`` (or ``model``) entry is unwrapped."""
    _check_path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # anything weights_only refuses or cannot parse
        # torch's refusal is many lines of advice for torch.load's own
        # caller; the one fact that matters here is the class it refused.
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", _ANSI.sub("", str(e)))
        if refused:
            _fail(path, f"cannot load as a weights-only pickle: it refers to {refused.group(1)}, which "
                        "torch.load(weights_only=True) refuses (only tensors and plain containers load); "
                        "convert it to safetensors where you trust its code")
        _fail(path, f"cannot load as a weights-only pickle ({_detail(e)})")
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        _fail(path, f"the pickle holds a {type(obj).__name__}, not a state dict")
    tensors = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        _fail(path, "holds no tensors")
    return tensors


def load(path, allow_pickle: bool = False) -> Dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, validated. Raises CheckpointError."""
    path = os.fspath(path)
    if path.lower().endswith(PICKLE_SUFFIXES):
        if not allow_pickle:
            _check_path(path)
            _fail(path, "is a pickle checkpoint; loading a pickle can run arbitrary code, so it is refused "
                        "(convert it to safetensors, or pass --allow-pickle to load it with "
                        "torch.load(weights_only=True))")
        return load_pickle(path)
    return load_safetensors(path)
