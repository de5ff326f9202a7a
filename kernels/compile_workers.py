"""A pass's Triton compiles handed to worker processes forked from one server.

Why: most of a cold Triton compile is its frontend (the code generator
walking a kernel's AST, the semantic layer), Python that holds the GIL, so
the threads of a pass compiling ahead (``launch.compile_ahead``) take turns
there and a pass of 30-50 kernels takes seconds per ten kernels on any
number of cores (docs/performance.md, fortieth session). Worker processes
each started fresh paid torch's import before their first compile and were
ready too late (forty-first session). Here one server process imports
Triton and the kernels once, then forks its workers, which are ready as
soon as it is.

How: ``Workers(n)`` starts the server (``python -c``, never
``multiprocessing``'s spawn, which would run the user's script again) and
listens on a private socket for its workers' connections. A compile thread
of the pass calls ``compile(compile_fn)`` with Triton's own async compile
(a closure over the kernel, its signature, constants, attributes, target,
options and environment): where a worker is connected and idle, the thread
sends it those (the ``@triton.jit`` functions by module and name), waits
with the GIL released while the worker compiles into Triton's on-disk cache,
then runs ``compile_fn`` itself, which finds the kernel there. Where the
closure is not of the known form, the worker fails or the server is gone,
``compile_fn`` compiles on the thread as without workers: a worker only
saves time. The worker hashes a kernel's helpers before it
(``cache_keys.fix``), as the pass does, so both get the same cache key;
``stats()`` counts the compiles by where they ran and the keys that
differed.

While the server starts or every worker is busy, ``LOCAL_COMPILES``
threads compile themselves and the others wait for a worker. Off by
default: the server's start (its import of torch) outlasted a pass on a
16-core GPU host, whose cold first call was then slower than on threads,
as on 2 cores (docs/performance.md, forty-sixth and forty-seventh
sessions). ``CONV_PATCH_COMPILE_PROCESSES=1`` turns it on; never under the
interpreter (nothing compiles).
"""

from __future__ import annotations

import os
import pickle
import queue
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

from conv_patch.checkout import refuse_top_level

refuse_top_level(__name__)

ENV = "CONV_PATCH_COMPILE_PROCESSES"
# The names Triton's async compile closes over (``JITFunction._do_compile``,
# Triton 3.6 to 3.9); another form compiles on the thread.
CLOSURE = ("self", "src", "target", "options", "env_vars")
# Seconds a closed server has to end (its workers see their connections
# closed) before it is killed: one still importing when a short pass ended
# (reaped on a thread of its own; the pass does not wait).
STOP_WAIT_S = 2.0
# A server that connected no worker in this many seconds is taken as failed.
START_TIMEOUT_S = 30.0
# While the server starts or every worker is busy, this many threads compile
# themselves, the others wait for a worker (checking every POLL_S seconds):
# Triton's frontend holds the GIL, so a few threads compile about as fast as
# the pass's many (one in the frontend while the others are in LLVM or ptxas).
LOCAL_COMPILES = 3
POLL_S = 0.02

_STATS = {"workers": 0, "threads": 0, "failed": 0, "keys_differed": 0}
_STATS_LOCK = threading.Lock()
_ERRORS: list = []  # the last few workers' failures, for a report


def enabled() -> bool:
    """Whether a pass hands its compiles to worker processes: where
    ``CONV_PATCH_COMPILE_PROCESSES`` is set and not ``0`` (module
    docstring: off by default), never under the interpreter."""
    from .common import INTERPRET
    if INTERPRET:
        return False
    return os.environ.get(ENV, "0") not in ("", "0")


def stats() -> dict:
    """Compiles of this process's passes: in a worker, on a thread (none
    free, an unknown closure), failed in a worker (then on the thread), and
    those whose cache key differed between worker and thread."""
    with _STATS_LOCK:
        return dict(_STATS, errors=list(_ERRORS))


def _count(what: str) -> None:
    with _STATS_LOCK:
        _STATS[what] += 1


# -- the job: Triton's closure, the @triton.jit functions by name -------------------

def _jit_ref(obj):
    from triton.runtime.jit import JITFunction
    if isinstance(obj, JITFunction):
        return ("jit", obj.fn.__module__, obj.fn.__qualname__)
    return None


class _JobPickler(pickle.Pickler):
    def persistent_id(self, obj):
        return _jit_ref(obj)


class _JobUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        import importlib
        _, module, qualname = pid
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj


def job_of(compile_fn: Callable) -> Optional[bytes]:
    """The pickled compile ``compile_fn`` (Triton's async compile closure)
    stands for; None where it is not of the known form or does not pickle."""
    code, cells = getattr(compile_fn, "__code__", None), getattr(compile_fn, "__closure__", None)
    if code is None or cells is None or set(code.co_freevars) != set(CLOSURE):
        return None
    try:
        env = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
        src = env["src"]
        fields = (src.fn, src.signature, src.constants, src.attrs, env["target"], dict(env["options"].__dict__),
                  env["env_vars"], src.hash())
        import io
        buf = io.BytesIO()
        _JobPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(fields)
        return buf.getvalue()
    except Exception:  # noqa: BLE001 - anything unexpected compiles on the thread
        return None


def run_job(data: bytes) -> tuple:
    """A worker's compile of a job into Triton's cache: ("ok", whether its
    source hash is the sender's) or ("error", message)."""
    import io
    try:
        fn, signature, constants, attrs, target, options, env_vars, sender_hash = \
            _JobUnpickler(io.BytesIO(data)).load()
        from triton.compiler import ASTSource, compile as triton_compile
        from . import cache_keys
        cache_keys.fix(fn)
        src = ASTSource(fn, signature, constants, attrs)
        triton_compile(src, target=target, options=options, _env_vars=env_vars)
        return ("ok", src.hash() == sender_hash)
    except BaseException as e:  # noqa: BLE001 - reported to the thread, which compiles itself
        return ("error", f"{type(e).__name__}: {e}"[:500])


# -- the server and its workers -----------------------------------------------------

def serve(address: str, n: int) -> None:
    """The server's body (``python -c``): import the kernels, fork ``n``
    workers that each connect to ``address`` and compile what they are
    sent until the connection closes, then wait for them."""
    import signal
    import warnings
    warnings.simplefilter("ignore")  # (fork with an import's threads: the workers only compile)
    # (A Ctrl-C is the user's process's to handle: it closes the connections,
    # and the workers end there.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from multiprocessing.connection import Client
    from conv_patch.kernels import api  # noqa: F401  (every kernel module, decorated once)
    authkey = bytes.fromhex(os.environ.pop("CONV_PATCH_COMPILE_AUTHKEY"))
    children = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                conn = Client(address, authkey=authkey)
                while True:
                    try:
                        data = conn.recv_bytes()
                    except (EOFError, OSError):
                        break
                    conn.send(run_job(data))
            except BaseException:  # noqa: BLE001 - a worker that cannot connect just ends
                code = 1
            finally:
                os._exit(code)
        children.append(pid)
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


class Workers:
    """A server and the connections of its ``n`` workers (module docstring)."""

    def __init__(self, n: int):
        from multiprocessing.connection import Listener
        self.n = n
        self.idle: "queue.Queue" = queue.Queue()
        self.conns: list = []
        self.closed = False
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._local = threading.BoundedSemaphore(LOCAL_COMPILES)
        self._dir = tempfile.mkdtemp(prefix="conv-patch-compile-")
        self._listener = None
        try:
            authkey = secrets.token_bytes(16)
            self._listener = Listener(os.path.join(self._dir, "s"), family="AF_UNIX", authkey=authkey)
            env = dict(os.environ, CONV_PATCH_COMPILE_AUTHKEY=authkey.hex())
            try:  # (the cache this process compiles into, where it was set in code rather than the environment)
                from triton import knobs
                env["TRITON_CACHE_DIR"] = str(knobs.cache.dir)
            except Exception:  # noqa: BLE001 - the environment's, as inherited
                pass
            code = f"from conv_patch.kernels import compile_workers as w; w.serve({self._listener.address!r}, {int(n)})"
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
        except BaseException:
            if self._listener is not None:
                self._listener.close()
            import shutil
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._acceptor = threading.Thread(target=self._accept, name="conv-patch-compile-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        for _ in range(self.n):
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - closed, or the server died: the threads compile
                return
            with self._lock:
                if self.closed:
                    conn.close()
                    return
                self.conns.append(conn)
            self.idle.put(conn)

    def ready(self) -> int:
        """Workers connected so far."""
        with self._lock:
            return len(self.conns)

    def failed(self) -> bool:
        """The server is gone, or connected no worker in ``START_TIMEOUT_S``."""
        if self.closed or self.proc.poll() is not None:
            return True
        return self.ready() == 0 and time.monotonic() - self.started > START_TIMEOUT_S

    def _take(self):
        """(an idle worker's connection or None, whether this thread holds
        a local slot): waits while the server starts or every worker is
        busy, and meanwhile up to ``LOCAL_COMPILES`` threads compile
        themselves; (None, False) once the server failed."""
        while True:
            try:
                return self.idle.get(timeout=POLL_S), False
            except queue.Empty:
                pass
            if self.failed():
                return None, False
            if self._local.acquire(blocking=False):
                return None, True

    def compile(self, compile_fn: Callable):
        """``compile_fn()`` (Triton's async compile), its kernel compiled by
        a worker first (module docstring)."""
        job = job_of(compile_fn)
        conn, local = (None, False) if job is None else self._take()
        if conn is None:
            _count("threads")
            try:
                return compile_fn()
            finally:
                if local:
                    self._local.release()
        try:
            conn.send_bytes(job)
            status, detail = conn.recv()
        except (EOFError, OSError, pickle.PickleError):
            status, detail = "error", "lost"
            with self._lock:
                if conn in self.conns:
                    self.conns.remove(conn)
            conn = None
        if conn is not None:
            self.idle.put(conn)
        if status == "ok":
            _count("workers")
            if not detail:
                _count("keys_differed")
        else:
            _count("failed")
            with _STATS_LOCK:
                _ERRORS[:] = _ERRORS[-4:] + [detail]
        return compile_fn()

    def close(self) -> None:
        """End the workers (their connections closed) and the server."""
        with self._lock:
            self.closed = True
            conns, self.conns = self.conns, []
        for conn in conns:
            conn.close()
        try:
            self._listener.close()
        except OSError:
            pass
        proc = self.proc

        def reap():
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            import shutil
            shutil.rmtree(self._dir, ignore_errors=True)
        threading.Thread(target=reap, name="conv-patch-compile-reap", daemon=True).start()


def start(n: int) -> Optional[Workers]:
    """``Workers(n)`` for a pass of ``n`` threads where they are on
    (``enabled``; two threads at least) and this platform can fork them;
    None where not or where they fail to start (the pass compiles on its
    threads)."""
    # (An embedded or frozen interpreter's executable is its application,
    # which ``-c`` would not run as Python.)
    if (n < 2 or not enabled() or not hasattr(os, "fork") or getattr(sys, "frozen", False)
            or not os.path.basename(sys.executable or "").lower().startswith("python")):
        return None
    try:
        return Workers(n)
    except Exception:  # noqa: BLE001 - workers only save time
        return None


class Executor:
    """What Triton's ``AsyncCompileMode`` submits to: ``pool`` (the pass's
    threads) running each compile through ``workers``."""

    def __init__(self, pool, workers: Workers):
        self.pool, self.workers = pool, workers

    def submit(self, fn, *args, **kwargs):
        if args or kwargs:
            return self.pool.submit(fn, *args, **kwargs)
        return self.pool.submit(self.workers.compile, fn)
