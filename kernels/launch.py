"""Host-side helpers shared by the launchers (no Triton kernels here).

Plain integer arithmetic on purpose: ``triton.cdiv`` and
``triton.next_power_of_2`` are constexpr functions in Triton 3.x and cost
microseconds per host-side call, which adds up on every launch.
"""

import contextlib
import os
import threading

from torch import Tensor
from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)

from conv_patch.work import Work

from . import cache_keys, compile_workers, direct_launch

INT32_LIMIT = 2**31 - 1

# tl.dot needs every block dimension >= 16.
MIN_DOT_BLOCK = 16
# TMA needs 16-byte aligned base addresses and strides.
TMA_ALIGN = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def span(t):
    """Elements between the first and one past the last addressed element."""
    if t is None or t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))


def needs_int64(*tensors):
    for t in tensors:
        # The storage bounds every offset from the data pointer; the exact
        # span is only worked out when that bound is too loose to decide.
        if t is not None and t.untyped_storage().nbytes() // t.element_size() > INT32_LIMIT \
                and span(t) > INT32_LIMIT:
            return True
    return False


_SMS: dict = {}
# Programs per "SM" under the interpreter (CPU tensors): few, so that a
# persistent grid's programs each walk several tiles in the tests.
INTERPRETER_SMS = 2


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (cached: the property lookup
    costs microseconds per launch)."""
    n = _SMS.get(device)
    if n is None:
        import torch
        n = _SMS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                            if device.type == "cuda" else INTERPRETER_SMS)
    return n


def block_sizes(config, c_in, c_out):
    """The table's tile, narrowed to the channel counts: a 3-channel output
    would otherwise spend 125 of 128 columns on masked work."""
    bm = int(config["BLOCK_M"])
    bn = min(int(config["BLOCK_N"]), max(MIN_DOT_BLOCK, next_pow2(c_out)))
    bk = min(int(config["BLOCK_K"]), max(MIN_DOT_BLOCK, next_pow2(c_in)))
    return bm, bn, bk


def split_block_sizes(config, c_in, c_out):
    """``block_sizes`` plus the second block of output channels that the
    TMA kernels' split tiles take (``BLOCK_N2``): 0 where none is asked or
    where the first block alone covers ``c_out``."""
    bm, bn, bk = block_sizes(config, c_in, c_out)
    bn2 = int(config.get("BLOCK_N2", 0))
    return bm, bn, (bn2 if bn2 and c_out > bn else 0), bk


_INTERPRETED: list = []


def interpreted() -> bool:
    """``common.INTERPRET``, read at the first launch (by then the kernel
    being launched has imported ``common``): not at this module's import,
    which may come before the test set-up sets TRITON_INTERPRET (pytest
    imports the runtime for its warning filter first)."""
    if not _INTERPRETED:
        from .common import INTERPRET
        _INTERPRETED.append(INTERPRET)
    return _INTERPRETED[0]


def interpreter_block_m(bm: int, pixels) -> int:
    """BLOCK_M under the interpreter for images of ``pixels`` output pixels
    (GEMM rows) each: the table's tile narrowed to next_pow2(pixels), where
    smaller. There a program's masked-off rows cost interpreted work too,
    and most images in the tests are far smaller than the table's tile.
    Per image, not per launch, so a launch's constexprs do not follow its
    batch, as on a GPU they do not: a compile-ahead pass over a clip's first
    frames launches the kernels the whole clip does. On a GPU (or with
    ``pixels`` unknown) the table's tile as it is."""
    if pixels is None or not interpreted():
        return bm
    return min(bm, max(MIN_DOT_BLOCK, next_pow2(pixels)))


def conv_meta(config, c_in, c_out, *, bias, residual, activation, precision, upcast, tensors,
              force_int64=False, pixels=None):
    """The switches, tiles and launch options every implicit-GEMM kernel
    takes: the tile narrowed to ``c_in`` (the reduction BLOCK_K covers) and
    ``c_out``, and under the interpreter to an image's output ``pixels``
    (``interpreter_block_m``); 64-bit offsets where any of ``tensors`` needs them."""
    bm, bn, bk = block_sizes(config, c_in, c_out)
    bm = interpreter_block_m(bm, pixels)
    return dict(
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=int(activation),
        IDX64=bool(force_int64 or needs_int64(*tensors)),
        UPCAST=bool(upcast), PRECISION=precision,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=int(config.get("GROUP_M", 8)),
        num_warps=int(config.get("num_warps", 4)),
        num_stages=int(config.get("num_stages", 2)),
    )


def run_conv_kernel(kernel, grid_fn, x, w, bias, out, residual, *, stride, padding,
                    dilation, beta, activation, out_scale, config, precision, upcast,
                    force_int64=False, reduction=None, pixels=None):
    """Launch one of the 2-D implicit-GEMM kernels, which share one signature.

    ``w`` is viewed as [C_out, C_in, KH, KW] whatever its storage; ``out`` is
    preallocated; ``padding`` is (top, left). ``grid_fn(bm, bn)`` sizes the grid.
    ``reduction`` is the extent BLOCK_K is narrowed to (default C_in, the
    per-tap reduction); ``pixels`` the GEMM rows of one image (the
    interpreter's BLOCK_M is narrowed to them).
    """
    N, C_in, H, W = x.shape
    C_out, _, KH, KW = w.shape
    meta = conv_meta(config, reduction or C_in, C_out, bias=bias, residual=residual, activation=activation,
                     precision=precision, upcast=upcast, tensors=(x, w, out, residual),
                     force_int64=force_int64, pixels=pixels)
    res = residual if residual is not None else out
    launch(kernel, grid_fn(meta["BLOCK_M"], meta["BLOCK_N"]),
        x, w, bias if bias is not None else out, res, out,
        N, C_in, H, W, C_out, out.shape[2], out.shape[3],
        *x.stride(), *w.stride(), *res.stride(), *out.stride(),
        KH, KW, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
        float(beta), float(out_scale), **meta)
    return out


# -- launching -----------------------------------------------------------------
# ``kernel[grid](*args)`` costs ~50 us of host time per call on the H200's
# host (bench/results/overhead-*.json): Triton binds the ~40 arguments,
# specialises each one (integer == 1 or divisible by 16, pointer alignment),
# and builds a cache key from the result before it launches. A FLUX decode
# makes ~120 launches, and at 1024^2 the GPU waited on them. ``launch``
# keeps the compiled kernel of each call signature: the key holds every
# integer argument's value and every tensor's dtype and 16-byte alignment,
# which determine Triton's specialisation exactly, so a hit launches the very
# kernel Triton's own lookup would have returned (~15 us). Under the
# interpreter, with a launch hook installed (profilers) or with
# CONV_PATCH_FAST_LAUNCH=0, every call goes through Triton's own path.
FAST_LAUNCH_ENTRIES = 4096
_FAST: dict = {}
# "on": whether launches may use the cache; "triton": (knobs, driver,
# TensorDescriptor), imported once (an import statement per launch is ~1 us).
_FAST_STATE: dict = {}


def _fast_launch_on() -> bool:
    on = _FAST_STATE.get("on")
    if on is None:
        interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        on = _FAST_STATE["on"] = not interp and os.environ.get("CONV_PATCH_FAST_LAUNCH", "1") != "0"
    return on


def _triton():
    mods = _FAST_STATE.get("triton")
    if mods is None:
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.tools.tensor_descriptor import TensorDescriptor
        mods = _FAST_STATE["triton"] = (knobs, driver, TensorDescriptor)
    return mods


def arg_key(args):
    """What Triton's specialisation of ``args`` depends on, or None for an
    argument kind this cache does not know (that call takes Triton's path)."""
    desc = _triton()[2]
    key = []
    for a in args:
        t = type(a)
        if t is int or t is bool:
            key.append(a)
        elif t is float:
            key.append(float)  # fp32 arguments are never specialised
        elif isinstance(a, Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif t is desc:
            key.append((a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                        tuple(a.block_shape), getattr(a, "padding", None)))
        else:
            return None
    return tuple(key)


def _constexpr_values(kernel, n_args: int, meta: dict):
    """The constexpr arguments in signature order, when the kernel takes its
    ``n_args`` runtime arguments first and every constexpr from ``meta``."""
    params = getattr(kernel, "params", None)
    if params is None or any(p.is_constexpr for p in params[:n_args]):
        return None
    rest = params[n_args:]
    if not all(p.is_constexpr and p.name in meta for p in rest):
        return None
    return tuple(meta[p.name] for p in rest)


def _hooked(hook) -> bool:
    """A launch hook is installed. Triton 3.6+ keeps an always-present
    HookChain whose ``calls`` are the hooks; older versions None or a
    callable."""
    return hook is not None and bool(getattr(hook, "calls", True))


# -- compiling ahead ---------------------------------------------------------------
# Inside ``compile_ahead`` (``conv_patch.warmup``'s first pass) a launch
# compiles its kernel on a worker thread and launches nothing: Triton's
# AsyncCompileMode, whose compiles run side by side (LLVM and ptxas, most of
# a compile, run without the GIL), and leaving it waits for them all. Then
# each kernel's launcher is made and its binary loaded, side by side too: on
# a cold cache the launcher is a C module built by the host compiler, which a
# first launch would do one kernel at a time (docs/performance.md, thirty-
# fourth session). What such a pass computes is garbage and what it planned
# must be forgotten (``conv_patch.api.warmup``); what it leaves is Triton's
# compiled and loaded kernels.
_AHEAD = threading.local()


def compiling_ahead() -> bool:
    return getattr(_AHEAD, "pending", None) is not None


class AheadProgress:
    """What a pass compiling ahead has done so far, read from another
    thread (a progress line): ``counts()`` is (kernels finished, kernels
    submitted); ``loading`` turns True once the pass's call has returned and
    the launchers are being made."""

    def __init__(self, pending: list):
        self.pending = pending
        self.loaded = 0
        self.failed = 0  # kernels whose compile or load failed (their launches will raise)
        self.loading = False

    def counts(self) -> tuple:
        # (A kernel launched several times is one compile: one object.)
        kernels = list({id(kernel): kernel for kernel, _ in list(self.pending)}.values())
        if self.loading:
            return min(self.loaded, len(kernels)), len(kernels)
        return sum(1 for kernel in kernels if _finished(kernel)), len(kernels)


def _finished(kernel) -> bool:
    """Whether a compile ahead has ended (a kernel already compiled in this
    process comes back compiled, not as a future)."""
    future = kernel.__dict__.get("future") if hasattr(kernel, "__dict__") else None
    return future is None or future.done()


@contextlib.contextmanager
def compile_ahead(workers: int):
    """Launches inside compile on ``workers`` threads instead (see above);
    yields an ``AheadProgress`` (None where this Triton has no async
    compiles: launches inside then run as usual)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        yield None
        return
    from concurrent.futures import ThreadPoolExecutor
    pending = []
    progress = AheadProgress(pending)
    # (Worker processes for the compiles where they can run: compile_workers.)
    procs = compile_workers.start(workers)
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="conv-patch-compile") as pool:
            # A compile that fails is left to the real call's launch, which
            # raises it where the plans handle failures.
            executor = pool if procs is None else compile_workers.Executor(pool, procs)
            with AsyncCompileMode(executor, ignore_errors=True):
                _AHEAD.pending, _AHEAD.seen = pending, set()
                try:
                    yield progress
                finally:
                    _AHEAD.pending = _AHEAD.seen = None
            if procs is not None:  # (every compile has ended: the workers go while the launchers load)
                procs.close()
                procs = None
            progress.loading = True
            unique = list({id(item[0]): item for item in pending}.values())
            for ok in pool.map(_load, unique):
                progress.loaded += 1
                progress.failed += not ok
    finally:
        if procs is not None:
            procs.close()


def _load(item) -> bool:
    """Make a compiled kernel's launcher and load it on its GPU (what its
    first launch would do); whether it could. A failure is left to that
    launch."""
    kernel, device = item
    try:
        compiled = kernel.result(True) if hasattr(kernel, "result") else kernel
        if compiled is None:
            return False
        import torch
        with torch.cuda.device(device):
            compiled.run  # (the property loads it: Triton's lazy handles)
        return True
    except Exception:  # noqa: BLE001 - the real launch raises it where the plans handle failures
        return False


def hash_triton() -> None:
    """Triton's own compile-cache key computed now (a hash of its compiler's
    sources and library, done once per process before the first kernel is
    compiled or loaded: a large share of a warm-cache first call,
    docs/performance.md). Reading and hashing the files release the GIL, so
    on a thread it overlaps the caller's work. Nothing where this Triton
    keeps it elsewhere."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return
    try:
        triton_key()
    except Exception:  # noqa: BLE001 - the first compile computes it again and raises there
        pass


def compile_only(kernel, grid, args, meta):
    """The launch of a pass compiling ahead: the kernel compiled for these
    arguments, nothing run."""
    cache_keys.fix(kernel)
    _AHEAD.pending.append((kernel.warmup(*args, grid=grid, **meta), _triton()[1].active.get_current_device()))


def _ahead_launch(kernel, grid, args, meta):
    """A launch inside ``compile_ahead``: ``compile_only``, once per launch
    signature of the pass. Asking Triton again for a signature it was given
    costs a hash of the kernel's source (its compile cache key), about a
    millisecond with the GIL held, and a model launches one signature many
    times (a net of repeated blocks).
    The signature is the fast path's key, finer than Triton's
    specialisation (integers by value), so a kernel a later launch needs is
    never left out."""
    akey = arg_key(args)
    if akey is not None:
        # (The device by the arguments': asking the driver needs a GPU, and a
        # pass is forced on the CPU by the tests.)
        device = next((getattr(a, "base", a).device for a in args
                       if isinstance(getattr(a, "base", a), Tensor)), None)
        sig = (kernel, device, akey, tuple(meta.items()))
        if sig in _AHEAD.seen:
            return None
        _AHEAD.seen.add(sig)
    return compile_only(kernel, grid, args, meta)


def _triton_launch(kernel, grid, args, meta):
    """``kernel[grid](*args, **meta)``, the kernels' cache keys made alike in
    every process first (``cache_keys``: Triton may compile here)."""
    cache_keys.fix(kernel)
    return kernel[grid](*args, **meta)


def _fast_key(args):
    """``arg_key(args)`` where a launch may use the cache of compiled
    kernels; None where it takes Triton's own path (the cache turned off or
    under the interpreter, a launch hook installed, an argument the key does
    not know)."""
    if not _fast_launch_on():
        return None
    knobs = _triton()[0]
    if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        return None
    return arg_key(args)


def launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)``, from the cache of compiled kernels
    where the call's signature was seen before (see above)."""
    Work.n += 1
    if getattr(_AHEAD, "pending", None) is not None:
        return _ahead_launch(kernel, grid, args, meta)
    akey = _fast_key(args)
    if akey is None:
        compiled = _triton_launch(kernel, grid, args, meta)
        _record(kernel, grid, args, meta, None, None)
        return compiled
    driver = _triton()[1]
    device = driver.active.get_current_device()
    key = (kernel, device, akey, tuple(meta.items()))
    hit = _FAST.get(key)
    if hit is None:
        compiled = _triton_launch(kernel, grid, args, meta)
        consts = _constexpr_values(kernel, len(args), meta)
        if consts is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            if len(_FAST) >= FAST_LAUNCH_ENTRIES:
                _FAST.clear()
            _FAST[key] = (compiled, consts)
        _record(kernel, grid, args, meta, compiled, consts)
        return compiled
    compiled, consts = hit
    _record(kernel, grid, args, meta, compiled, consts)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *consts)
    return compiled


# -- recorded programs -----------------------------------------------------------
# A plan (conv_patch.runtime.dispatch) records the launches of its first call and
# replays them on later calls with the same signature: the launchers' Python
# (tile sizes, strides, descriptors, the cache key above) runs once per
# signature instead of once per call. A replay substitutes the call's tensors
# for the recorded ones by role: a tensor argument of a recorded launch must
# be one of the roles the plan passed in, a view of one, or a tensor the
# launchers allocated through ``empty`` while recording (scratch, allocated
# afresh at every replay). Anything else makes the call unrecordable, and
# that plan calls the launchers every time.
# Per thread: a plan built in one thread must record its own launches only.
# One list shared by all threads (as it was) recorded another thread's
# launches and scratch into the plan being built, and pushes and pops of
# two threads' recordings interleaved, so a plan could be missing its own
# launch and replay into an unwritten output.
_LOCAL = threading.local()


def _recorders() -> list:
    stack = getattr(_LOCAL, "recorders", None)
    if stack is None:
        stack = _LOCAL.recorders = []
    return stack


class Unrecordable(Exception):
    """A launch used a tensor that is neither a role, a view of one, nor
    scratch allocated through ``empty``."""


class Recorder:
    def __init__(self):
        self.launches = []  # (kernel, grid, args, meta, compiled, consts, device)
        self.scratch = []   # tensors allocated through ``empty``


@contextlib.contextmanager
def recording():
    """``with recording() as rec:`` every ``launch`` and ``empty`` inside is
    recorded into ``rec`` (nested recordings record into the innermost)."""
    rec = Recorder()
    stack = _recorders()
    stack.append(rec)
    try:
        yield rec
    finally:
        stack.pop()


def empty(shape, *, dtype, device, memory_format=None):
    """``torch.empty`` for a launcher's scratch and outputs: while recording,
    the tensor is registered as scratch (see above)."""
    import torch
    if memory_format is None:
        t = torch.empty(shape, dtype=dtype, device=device)
    else:
        t = torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)
    stack = getattr(_LOCAL, "recorders", None)
    if stack:
        stack[-1].scratch.append(t)
    return t


def _record(kernel, grid, args, meta, compiled, consts):
    stack = getattr(_LOCAL, "recorders", None)
    if stack:
        usable = consts is not None and compiled is not None and all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
        device = _triton()[1].active.get_current_device() if usable else None
        stack[-1].launches.append((kernel, grid, args, meta, compiled if usable else None,
                                        consts if usable else None, device))


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


class Program:
    """The recorded launches of one call, replayable with the tensors of
    another call of the same signature: ``program(roles)`` returns what the
    recorded call returned, in the new call's tensors."""

    def __init__(self, rec: Recorder, roles: tuple, result):
        self.n_roles = len(roles)
        bases = list(roles)
        self.scratch = [(tuple(t.shape), t.stride(), t.dtype, t.device) for t in rec.scratch]
        bases += rec.scratch
        by_storage = {}
        for i, t in enumerate(bases):
            if t is not None:
                by_storage.setdefault(_storage(t), i)
        self._bases, self._by_storage = bases, by_storage
        desc_cls = None
        self.launches = []
        for kernel, grid, args, meta, compiled, consts, device in rec.launches:
            subs, template, descs = [], list(args), {}
            for i, a in enumerate(args):
                if isinstance(a, Tensor):
                    subs.append((i, self._ref(a), None))
                elif type(a).__name__ == "TensorDescriptor":
                    desc_cls = type(a)
                    # The descriptor's fields but its base: the plan must
                    # not keep the first call's tensors alive.
                    fields = descs[i] = dict(a.__dict__, base=None)
                    subs.append((i, self._ref(a.base), fields))
                else:
                    continue
                template[i] = None
            replay = None
            if compiled is not None:
                c_launcher = direct_launch.launcher_of(compiled)
                if c_launcher is not None:
                    replay = direct_launch.Replay(c_launcher, grid, args, consts, descs)
            self.launches.append((kernel, grid, template, subs, meta, compiled, consts, device, replay))
        self.result = self._ref(result) if isinstance(result, Tensor) else None
        self._desc_cls = desc_cls
        del self._bases, self._by_storage

    def _ref(self, t):
        for i, b in enumerate(self._bases):
            if b is t:
                return (i, None)
        i = self._by_storage.get(_storage(t)) if t.numel() else None
        if i is None:
            raise Unrecordable(f"a launch argument of shape {tuple(t.shape)} is no role, view or scratch")
        b = self._bases[i]
        return (i, (tuple(t.shape), t.stride(), t.storage_offset() - b.storage_offset()))

    def __call__(self, roles: tuple):
        import torch
        Work.n += 1
        bases = list(roles)
        for shape, stride, dtype, device in self.scratch:
            bases.append(torch.empty_strided(shape, stride, dtype=dtype, device=device))
        knobs, driver, _ = _triton()
        hooked = _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)
        direct = not hooked and direct_launch.direct_launch_on()
        for kernel, grid, args, subs, meta, compiled, consts, device, replay in self.launches:
            if direct and replay is not None:
                # Addresses, not views: the C launcher takes an int for a
                # pointer, and a view is built only where a descriptor's map
                # is encoded anew (Replay.call).
                replay.call(driver.active.get_current_stream(device),
                            [(i, bases[b], view) for i, (b, view), _ in subs])
                continue
            args = args.copy()
            for i, (b, view), desc in subs:
                t = bases[b]
                if view is not None:
                    t = t.as_strided(view[0], view[1], t.storage_offset() + view[2])
                if desc is not None:
                    d = object.__new__(self._desc_cls)
                    d.__dict__.update(desc)
                    d.base = t
                    t = d
                args[i] = t
            if compiled is None or hooked:
                kernel[grid](*args, **meta)
            else:
                g1 = grid[1] if len(grid) > 1 else 1
                g2 = grid[2] if len(grid) > 2 else 1
                compiled.run(grid[0], g1, g2, driver.active.get_current_stream(device), compiled.function,
                             compiled.packed_metadata, None, None, None, *args, *consts)
        if self.result is None:
            return None
        b, view = self.result
        t = bases[b]
        return t if view is None else t.as_strided(view[0], view[1], t.storage_offset() + view[2])
