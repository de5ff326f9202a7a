"""Marks of compiling passes made: a later process's first call skips its pass.

The pass before a patched model's first call (``api/warmup.py``) compiles
the call's kernels into Triton's on-disk cache. In a later process the same
call finds every kernel there, and the pass only costs time: three calls of
host time whose plans are then forgotten (0.14-0.24 s a first call on an
H100, docs/performance.md). So a pass that compiled and loaded every kernel
leaves a mark in Triton's cache directory (``conv-patch-passes/``, beside the
kernels it compiled: a cleared cache takes the marks with it), keyed on what
decides which kernels the call launches:

* conv-patch's code and tables (each installed file's size and time), the
  versions of torch and Triton, the GPU, and the ``CONV_PATCH_*`` and
  ``TRITON_*`` environment;
* the model: each module's class, each parameter's and buffer's shape,
  dtype, strides and device type;
* the call: the method, and each argument (a tensor's shape, dtype,
  strides, device type and 16-byte alignment; anything else's type and
  value).

A first call whose mark is found makes no pass: its launches load the kernels
from the cache. A mark that no longer holds (a kernel evicted from the
cache, a table given by ``PatchConfig(table=...)`` that changed) costs only
time: that call compiles what it lacks as it goes. Nothing is marked where
the cache directory cannot be written.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

MARKS_DIR = "conv-patch-passes"
# Nested arguments are described this deep; deeper ones make no mark.
MAX_DEPTH = 4


def cache_dir() -> Optional[Path]:
    """Triton's kernel cache directory, or None where it cannot be told."""
    try:
        from triton import knobs
        d = knobs.cache.dir
    except Exception:  # noqa: BLE001 - an older Triton: its environment variable and default
        d = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return Path(d) if d else None


@functools.lru_cache(maxsize=1)
def _code() -> str:
    """conv-patch's installed files (size, time), torch's and Triton's versions."""
    import importlib
    import triton
    import conv_patch
    parts = [torch.__version__, triton.__version__, conv_patch.__version__]
    for name in ("conv_patch", "conv_patch.kernels", "conv_patch.configs", "conv_patch.recipes"):
        pkg = importlib.import_module(name)
        # (The namespace packages have no __file__; an editable install puts
        # the checkout's root on conv_patch's __path__ too.)
        for root in [Path(pkg.__file__).parent] if pkg.__file__ else map(Path, pkg.__path__):
            for p in sorted(root.rglob("*")):
                if p.suffix in (".py", ".json") and "__pycache__" not in p.parts:
                    st = p.stat()
                    parts.append(f"{name}/{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def _tensor(t: torch.Tensor) -> str:
    return f"T{tuple(t.shape)}{t.dtype}{t.stride()}{t.device.type}{t.data_ptr() % 16 == 0}"


def describe_argument(v, containers: tuple = (tuple, list, dict), depth: int = 0) -> str:
    """A call argument as the key sees it (module docstring), walking the
    ``containers`` to ``MAX_DEPTH``; ``TypeError`` naming what cannot be
    described. (Also the pass's own check of its arguments, ``warmup``.)"""
    if isinstance(v, torch.Tensor):
        return _tensor(v)
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, containers) and depth < MAX_DEPTH:
        items = v.items() if isinstance(v, dict) else enumerate(v)
        inner = ",".join(f"{k!r}={describe_argument(x, containers, depth + 1)}" for k, x in items)
        return f"{type(v).__name__}({inner})"
    raise TypeError(f"an argument of type {type(v).__name__}")


def cuda_indices(tensors) -> list:
    """The indices of the GPUs ``tensors`` are on (a tensor on ``cuda``
    without an index: the current device's), sorted."""
    return sorted({torch.cuda.current_device() if t.device.index is None else t.device.index
                   for t in tensors if t.is_cuda})


def pass_key(module: nn.Module, method: str, args: tuple, kwargs: dict) -> Optional[str]:
    """The mark's key of a pass before ``module.<method>(*args, **kwargs)``
    (module docstring); None where an argument cannot be described."""
    try:
        call = ";".join([*map(describe_argument, args),
                         *(f"{k}={describe_argument(v)}" for k, v in kwargs.items())])
    except TypeError:
        return None
    h = hashlib.sha256()
    h.update(_code().encode())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("CONV_PATCH_", "TRITON_")))
    h.update(repr(env).encode())
    devices = cuda_indices([t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)])
    h.update(repr([(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in devices]).encode())
    for name, m in module.named_modules():
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__}".encode())
        for pname, p in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)):
            h.update(f"{pname}:{_tensor(p)}".encode())
    h.update(f"{method}:{call}".encode())
    return h.hexdigest()


def _path(key: str) -> Optional[Path]:
    d = cache_dir()
    return None if d is None else d / MARKS_DIR / key


def marked(key: Optional[str]) -> bool:
    """Whether a pass of this key compiled every kernel into this cache."""
    p = None if key is None else _path(key)
    return p is not None and p.is_file()


def mark(key: Optional[str]) -> None:
    """Record that the pass of this key compiled and loaded every kernel
    (nothing where the directory cannot be written)."""
    p = None if key is None else _path(key)
    if p is None:
        return
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
        tmp.write_text("")
        os.replace(tmp, p)
    except OSError:
        pass
