"""Test set-up: without CUDA the kernels run under the Triton interpreter on
CPU tensors (how CI tests them); with CUDA the same tests run on the GPU."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # torch.compile's caches (Inductor's FX graphs, AOTAutograd's) live in
    # one folder per machine and outlast a run, and a cached graph holds the
    # choices conv-patch's composite ops made when it was traced (PyTorch's
    # convolution or the routed op) by whatever code traced it: the tests
    # must trace with the code under test.
    _cache = tempfile.mkdtemp(prefix="conv-patch-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must happen before conv_patch.kernels is imported: Triton fixes the
    # interpreter choice when a kernel is decorated.
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _interpreter_patches_the_language_once_per_launch():
    """Triton's interpreter patches ``triton.language`` (``_patch_lang``:
    ``inspect.getmembers`` over tl, tl.tensor, tl.math, ...) at every launch,
    for the launch, and again at every call of a ``@triton.jit`` helper
    inside a kernel (merge_moments, activate, ...), where the launch's patch
    is already in place: there it replaces nothing (a patched member is no
    longer a builtin) and re-sets the same stateless functions, and it was
    about a third of a Mochi GroupNorm's interpreted time. Here a helper
    called inside a launch whose patch covers its language modules runs
    without re-patching; anything else (another triton.language module in
    the helper's globals, a call outside a launch) takes Triton's own path.
    The kernels' arithmetic is untouched. Only the Triton interpreter this
    was written against (its code checked); else nothing changes."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
        grid_call, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
        ok = ("patch_scope = _patch_lang(self.fn)" in inspect.getsource(grid_call)
              and "patch_scope.restore()" in inspect.getsource(grid_call)
              and "_patch_lang(self.fn)" in inspect.getsource(device_call)
              and "value in [tl, tl.core]" in inspect.getsource(ti._patch_lang))
    except Exception:
        return
    if not ok:
        return
    langs_of, active = {}, []

    def langs(fn):
        got = langs_of.get(fn)
        if got is None:
            got = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in (tl, tl.core))
        return got

    def launch(self, *args, **kwargs):
        active.append(langs(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            active.pop()

    def helper(self, *args, **kwargs):
        got = langs(self.fn)
        if not (got and active and got <= active[-1]):
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = launch, helper


def _interpreter_skips_the_overflow_check_it_never_asserts():
    """Triton's interpreter runs its integer-overflow sanitizer on every
    32-bit add, sub and mul (both operands cast to int64, the operation
    again, two comparisons, an and: about half a Wan decode's interpreted
    time), and hands the result to ``device_assert``, which returns
    without looking at it unless the interpreter's ``debug`` option is on;
    it is off (nothing here turns it on). With ``debug`` off the sanitizer
    is switched off too, so nothing the kernels compute or a test sees
    changes; with ``debug`` on it stays."""
    import dataclasses
    import inspect

    try:
        from triton.language import semantic
        from triton.runtime import interpreter as ti
        builder = ti.interpreter_builder
        sanitizer = inspect.getsource(semantic.TritonSemantic.binary_op_sanitize_overflow_impl)
        asserts = inspect.getsource(semantic.TritonSemantic.device_assert)
        ok = ("not self.builder.options.sanitize_overflow" in sanitizer and "self.device_assert(cond" in sanitizer
              and "if not self.builder.options.debug:\n            return" in asserts
              and not builder.options.debug)
        if ok:
            builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except Exception:
        return


if not HAS_CUDA:
    _interpreter_patches_the_language_once_per_launch()
    _interpreter_skips_the_overflow_check_it_never_asserts()

if os.environ.get("PYTEST_XDIST_WORKER") and not HAS_CUDA:
    # One thread per test worker: the workers already use every core, and
    # each one's intra-op threads on top oversubscribe them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_pass_marks(tmp_path_factory, monkeypatch):
    """Each test's compiling passes mark a folder of its own
    (``api/pass_marks``, made at the first mark): a mark left by another
    test, or by a run before, would skip a pass a test expects."""
    import uuid
    from conv_patch.api import pass_marks
    d = tmp_path_factory.getbasetemp() / f"triton-cache-{uuid.uuid4().hex}"
    monkeypatch.setattr(pass_marks, "cache_dir", lambda: d)


@pytest.fixture(autouse=True)
def _release_cuda_memory():
    """After each test on a GPU, the memory PyTorch's allocator keeps
    cached goes back to the device: test workers sharing one GPU (``-n``)
    otherwise starve each other (a 4 GiB-input test's cache held in one
    worker made another's 2 MiB allocation fail)."""
    yield
    if HAS_CUDA:
        import gc
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def exact_fp32():
    """fp32 convolutions in exact (IEEE) mode for the duration of a test."""
    from conv_patch.target import conv_tf32
    with conv_tf32(False):
        yield
