"""What every plan of the dispatch core shares: where a failed kernel is
reported, how plans are stored (bounded per module) and built (one at a
time), how a kernel call is recorded for replay."""

from __future__ import annotations

import threading
import warnings

from conv_patch.ops.conv2d import kernels
from conv_patch.routing.select import Route, RouteDecision


class KernelFailureWarning(RuntimeWarning):
    """A kernel could not be built or launched here (e.g. a tile needing more
    shared memory than this GPU has); that call ran on PyTorch instead."""


def kernel_failure(e: Exception, stacklevel: int = 3) -> str:
    """The reason a call whose kernel failed to build or launch (one of
    ``kernel_errors()``) gives for running on PyTorch, warned as a
    ``KernelFailureWarning``: callers remember it and do not try again."""
    reason = f"kernel failed here: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    warnings.warn(f"conv-patch: {reason}; this call ran on PyTorch", KernelFailureWarning, stacklevel=stacklevel)
    return reason


# Plans kept per module; a model that sees more signatures than this (a
# stream of resolutions) starts over rather than growing without bound.
MAX_PLANS = 64

# Plans are built one at a time, every module's, in every thread: two
# threads building one module's plans at once compiled its kernels twice and
# swapped its weight pack (``_cp_pack``) under each other, and a full plan
# dict could be replaced under a concurrent store. Only a miss takes the
# lock: a lookup is a plain dict read (a plan is stored complete, and a
# replay only reads it). Reentrant: a build runs the module's forward.
BUILD_LOCK = threading.RLock()

UNREGISTERED = RouteDecision(Route.FALLBACK, "weight or bias is not a registered Parameter (parametrized, or a "
                                             "buffer)")


def tensor_sig(t):
    """What of a tensor a plan's signature holds: shape, strides, dtype,
    device, 16-byte alignment."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def recorded(fn, roles):
    """``(fn(), program)``: the result and its launches recorded as a
    ``Program`` that replays them with another call's tensors in ``roles``
    (None where they cannot be recorded). Kernel errors propagate, raised
    before anything ran."""
    k = kernels()
    with k.recording() as rec:
        y = fn()
    try:
        return y, k.Program(rec, roles, y)
    except k.Unrecordable:
        return y, None


def store_plan(m, key, plan, keep: bool = True):
    """``plan`` kept in ``m._cp_plans`` under ``key``; a full dict starts
    over (with the bare fast path's slots, which it bounds). Not where
    ``keep`` is false: a plan built inside someone else's CUDA graph
    capture (``pack.graph_flag`` says why)."""
    if not keep:
        return
    plans = m.__dict__.get("_cp_plans")
    if plans is None or len(plans) >= MAX_PLANS:
        if plans is not None:
            m.__dict__["_cp_bare"] = None
        plans = m.__dict__["_cp_plans"] = {}
    plans[key] = plan
