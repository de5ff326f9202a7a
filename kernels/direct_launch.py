"""Triton's C launcher called without its Python wrapper, for the replays of
recorded programs (``launch.Program``).

A replayed launch through ``compiled.run`` still runs Triton's Python on
every call: the ``CudaLauncher`` frame and its scratch closures, then a
wrapper that walks all ~40 arguments and, for each TMA descriptor, calls
``make_tensordesc_arg``, which encodes a fresh CUtensorMap through the
driver. A TMA conv passes three to five descriptors. A program's launches
have fixed arguments but for their tensors, so the replay can hand the C
launcher its final argument list directly: built once from the recorded
launch, with the tensors and the descriptors' maps put in at each call.
A map depends only on the base address besides the recorded shape, strides
and box, and the caching allocator hands a model the same addresses call
after call, so the maps are kept per address (``MAPS_PER_SLOT`` of them).

Only where Triton's launcher has the shape this was written against
(Triton 3.6: ``CudaLauncher.launch`` a closure over ``launcher``,
``tensordesc_indices`` and ``tensordesc_meta``, 13 leading launch
arguments, no global or profile scratch); any other launcher, a launch
hook, or ``CONV_PATCH_DIRECT_LAUNCH=0`` keeps Triton's own path. What the
C launcher receives is what Triton's wrapper would have passed it, but for
pointers, which go as their addresses (ints, which Triton's C launcher takes
as they are): a replay then makes no view of a role for a view argument (a
1x1 conv's plane, the im2col route's column matrix, each an ``as_strided``
of a few microseconds), and the launcher skips the driver's pointer check
it makes on a tensor argument (tests/test_direct_launch.py compares the
two).
"""

import os

from torch import Tensor
from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)

# Triton 3.6's leading launcher arguments ("iiiKKppOOOOOO"): the grid, the
# stream, the function, cooperative grid, PDL, global and profile scratch,
# the packed metadata, the launch metadata and the two hooks.
BASE_ARGS = 13
STREAM = 3
# Maps kept per descriptor argument of a launch: more than the addresses one
# signature's calls cycle through in a model, few enough to scan nothing.
MAPS_PER_SLOT = 8
_STATE: dict = {}
_LAUNCHERS: dict = {}  # id(compiled kernel) -> (kernel, Launcher or None)


def direct_launch_on() -> bool:
    on = _STATE.get("on")
    if on is None:
        on = _STATE["on"] = os.environ.get("CONV_PATCH_DIRECT_LAUNCH", "1") != "0"
    return on


def enable(on: bool) -> bool:
    """Turn the direct path on or off for later replays; returns the
    previous setting (benchmarks compare it with Triton's own path)."""
    was = direct_launch_on()
    _STATE["on"] = bool(on)
    return was


class Launcher:
    """Triton's C launcher of one compiled kernel and what its wrapper adds."""

    __slots__ = ("c_launch", "base", "indices", "meta", "expand")

    def __init__(self, c_launch, base, indices, meta, expand):
        self.c_launch, self.base, self.indices, self.meta, self.expand = c_launch, base, indices, meta, expand


def launcher_of(compiled):
    """The ``Launcher`` of ``compiled``, or None where its Triton launcher is
    not the known shape (then Triton's own path runs)."""
    hit = _LAUNCHERS.get(id(compiled))
    if hit is None or hit[0] is not compiled:
        # (By identity, the kernel kept beside: its id must not be reused.)
        hit = _LAUNCHERS[id(compiled)] = (compiled, _inspect(compiled))
    return hit[1]


def _inspect(compiled):
    run = getattr(compiled, "run", None)
    if type(run).__name__ != "CudaLauncher":
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None  # (scratch is allocated per launch by the wrapper)
    function, packed = getattr(compiled, "function", None), getattr(compiled, "packed_metadata", None)
    coop, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None)
    if function is None or packed is None or not isinstance(coop, bool) or not isinstance(pdl, bool):
        return None
    inner = getattr(run, "launch", None)
    code = getattr(inner, "__code__", None)
    if code is None:
        # No descriptor arguments: Triton's launcher is the C function itself.
        if not callable(inner) or getattr(inner, "__closure__", None) is not None:
            return None
        c_launch, indices, meta, expand = inner, frozenset(), (), None
    else:
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in inner.__closure__ or ())))
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        glob = inner.__globals__
        expand = glob.get("make_tensordesc_arg")
        if glob.get("_BASE_ARGS_FORMAT_LEN") != BASE_ARGS or not callable(expand):
            return None
        expand_code = getattr(expand, "__code__", None)
        if expand_code is None or expand_code.co_argcount != 2:
            return None
        c_launch, indices, meta = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
        if not isinstance(indices, (set, frozenset)) or not meta or len(meta) != len(indices) \
                or any(not isinstance(m, dict) for m in meta):
            # (Descriptors decomposed in the frontend pass tensors: Triton's path.)
            return None
    base = [0, 0, 0, None, function, coop, pdl, None, None, packed, None, None, None]
    return Launcher(c_launch, base, frozenset(indices), tuple(meta), expand)


class Replay:
    """One recorded launch's final argument list for the C launcher, built
    from the recorded arguments (``args`` then ``consts``); each call puts in
    its tensors by argument index, and for a descriptor argument the map of
    the recorded descriptor (``fields``, a ``TensorDescriptor``'s but its
    base) over that call's tensor."""

    __slots__ = ("launcher", "template", "slots", "maps")

    def __init__(self, launcher: Launcher, grid, args, consts, fields: dict):
        self.launcher = launcher
        template = list(launcher.base)
        template[0] = grid[0]
        template[1] = grid[1] if len(grid) > 1 else 1
        template[2] = grid[2] if len(grid) > 2 else 1
        slots, maps, k = {}, {}, 0
        for i, a in enumerate((*args, *consts)):
            slots[i] = len(template)
            if i in launcher.indices:
                # The recorded descriptor's expansion (map, shape, strides);
                # the map is replaced at every call by its base's.
                template.extend(launcher.expand(a, launcher.meta[k]))
                maps[i] = (launcher.meta[k], {}, type(a), fields[i])
                k += 1
            else:
                # (A tensor is put in by every call: the plan must not keep
                # the recorded call's tensors alive.)
                template.append(None if isinstance(a, Tensor) else a)
        self.template, self.slots, self.maps = template, slots, maps

    def call(self, stream, values):
        """Launch with ``values``: (argument index, tensor, view) triples
        (``launch.Program``'s), the argument being the tensor itself where
        ``view`` is None, else its view (shape, strides, offset in elements
        from the tensor's own). A pointer goes to the C launcher as its
        address (an int: no view made, and none of the driver's pointer
        checks a tensor argument costs); a descriptor as its map."""
        launcher = self.launcher
        final = self.template.copy()
        final[STREAM] = stream
        slots, maps = self.slots, self.maps
        for i, t, view in values:
            ptr = t.data_ptr() if view is None else t.data_ptr() + view[2] * t.element_size()
            entry = maps.get(i)
            if entry is None:
                final[slots[i]] = ptr
                continue
            meta, cache, cls, fields = entry
            m = cache.get(ptr)
            if m is None:
                if len(cache) >= MAPS_PER_SLOT:
                    cache.clear()
                desc = object.__new__(cls)
                desc.__dict__.update(fields)
                desc.base = t if view is None else t.as_strided(view[0], view[1], t.storage_offset() + view[2])
                m = cache[ptr] = launcher.expand(desc, meta)[0]
            final[slots[i]] = m
        launcher.c_launch(*final)
