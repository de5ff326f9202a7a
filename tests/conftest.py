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


if not HAS_CUDA:
    # (Two costs of the interpreter that buy the tests nothing, cut here and,
    # through sitecustomize, in the processes the tests start: see
    # _site/interpreter_speedups.py.)
    import sys
    _site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
    sys.path.insert(0, _site)
    import interpreter_speedups
    interpreter_speedups.install()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_site, os.environ.get("PYTHONPATH")) if p)

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
