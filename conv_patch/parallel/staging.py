"""Host memory for the bands a staged decode keeps off the device.

A staged band is written to host memory once and read back by the layers
that need it. ``HostStaging`` hands out host tensors over buffers pinned
once at their exact size (``cudaHostRegister`` on plain host memory) and
takes a buffer back when the tensor handed out is dropped, for the next
band of about its size. PyTorch's own pinned allocator (``pin_memory=True``)
rounds every request up to a power of two and caches by that size: a
4.1 GiB band pinned 8 GiB, on a host whose 8192^2 decode stages tens of GiB.

A staging pool is kept per device for the process's later calls (pinning
is the slow part of the first staged decode: the host faults in and locks
every page); ``release_host_staging()`` unpins and frees it. Before a buffer
is pinned the host's available memory is checked: a staged decode that
needs more host memory than there is stops with a ``MemoryError`` that says
how much, instead of swapping.
"""

from __future__ import annotations

import bisect
import time
import weakref
from typing import Dict, List, Optional

import torch

from conv_patch.buffers import persistent

GIB = float(1 << 30)
# A free buffer serves a request up to this many times smaller (a band of a
# few rows fewer than the last one), so that a level's bands share buffers.
REUSE_SLACK = 1.5
# Host memory left to everything else when a buffer is pinned.
HOST_RESERVE = 4 << 30


def available_host_bytes() -> Optional[int]:
    """``MemAvailable`` of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostStaging:
    """Host tensors for staged bands over reusable buffers, pinned on CUDA.
    ``held_bytes``: what the pool holds; ``peak_bytes``: the most handed out
    at once; ``pin_seconds``: time spent pinning new buffers."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._sizes: List[int] = []  # sorted sizes of the free buffers
        self._free: Dict[int, List[torch.Tensor]] = {}
        self._all: List[torch.Tensor] = []
        self.held_bytes = self.in_use = self.peak_bytes = 0
        self.pin_seconds = 0.0
        weakref.finalize(self, _unpin_all, self._all, pinned)

    def take(self, shape, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
        """An uninitialised host tensor of ``shape`` (NCHW or channels_last)
        whose buffer returns to the pool when the tensor is dropped."""
        n, c, h, w = shape
        nbytes = n * c * h * w * dtype.itemsize
        base = self._reuse(nbytes)
        if base is None:
            base = self._new(nbytes)
        flat = base[:nbytes].view(dtype)
        t = flat.view(n, h, w, c).permute(0, 3, 1, 2) if channels_last else flat.view(n, c, h, w)
        self.in_use += base.numel()
        self.peak_bytes = max(self.peak_bytes, self.in_use)
        weakref.finalize(t, self._give_back, base)
        return t

    def _reuse(self, nbytes: int) -> Optional[torch.Tensor]:
        i = bisect.bisect_left(self._sizes, nbytes)
        if i == len(self._sizes) or self._sizes[i] > REUSE_SLACK * nbytes:
            return None
        size = self._sizes.pop(i)
        return self._free[size].pop()

    def _new(self, nbytes: int) -> torch.Tensor:
        avail = available_host_bytes()
        if avail is not None and nbytes > avail - HOST_RESERVE:
            raise MemoryError(
                f"bands: staging a band needs {nbytes / GIB:.1f} GiB more host memory, "
                f"{max(0, avail) / GIB:.1f} GiB is available and the staged bands already hold "
                f"{self.held_bytes / GIB:.1f} GiB; raise max_activation_gib (fewer bytes to stage) or free host memory")
        t0 = time.perf_counter()
        # Kept for later decodes, whatever their inference mode.
        base = persistent(torch.empty, nbytes, dtype=torch.uint8)
        if self.pinned:
            # Fault the pages in first, on all of PyTorch's CPU threads:
            # cudaHostRegister faulting them in itself, one thread, pinned
            # 80 GiB in 76 s on the H200's host.
            base.zero_()
            rc = int(torch.cuda.cudart().cudaHostRegister(base.data_ptr(), nbytes, 0))
            if rc != 0:
                raise MemoryError(f"bands: pinning {nbytes / GIB:.1f} GiB of host memory for a staged band failed "
                                  f"(cudaError {rc}); raise max_activation_gib or free host memory")
        self.pin_seconds += time.perf_counter() - t0
        self._all.append(base)
        self.held_bytes += nbytes
        return base

    def _give_back(self, base: torch.Tensor) -> None:
        self.in_use -= base.numel()
        size = base.numel()
        bisect.insort(self._sizes, size)
        self._free.setdefault(size, []).append(base)

    def release(self) -> None:
        """Unpin and free every buffer (those handed out stay valid, unpinned)."""
        _unpin_all(self._all, self.pinned)
        self._all.clear()
        self._free.clear()
        self._sizes.clear()
        self.held_bytes = 0


def _unpin_all(buffers: List[torch.Tensor], pinned: bool) -> None:
    if pinned:
        for b in buffers:
            torch.cuda.cudart().cudaHostUnregister(b.data_ptr())


_POOLS: Dict[torch.device, HostStaging] = {}


def pool_for(device: torch.device) -> HostStaging:
    """The process's staging pool for bands of ``device`` (pinned on CUDA)."""
    device = torch.device(device)
    if device not in _POOLS:
        _POOLS[device] = HostStaging(pinned=device.type == "cuda")
    return _POOLS[device]


def release_host_staging() -> int:
    """Unpin and free the host memory the staged decodes of this process
    keep for their next call; returns the bytes released."""
    freed = sum(p.held_bytes for p in _POOLS.values())
    for p in _POOLS.values():
        p.release()
    _POOLS.clear()
    return freed
