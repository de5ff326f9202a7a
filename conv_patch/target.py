"""Where the kernels can run: the architecture key of a device and the
numerics policy PyTorch itself would use there."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from typing import Optional
from dataclasses import dataclass

import torch

# tl.dot on bf16 and the pointer loads the portable kernels use need sm80.
MIN_CUDA_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Target:
    """``arch`` names the config table: ``sm90``, ``sm80``, ``gfx942``, ...,
    ``interpreter`` for CPU tensors under TRITON_INTERPRET=1, or ``cpu``/
    ``none`` where no kernel can run (``reason`` says why). ``sms``: a GPU's
    streaming multiprocessors, read from the device (0 elsewhere: the cost
    model then takes its table's)."""

    arch: str
    kernels: bool
    reason: str = ""
    interpreter: bool = False
    sms: int = 0


def interpreter_enabled() -> bool:
    """Whether the kernels were (or will be) decorated for the interpreter.
    Triton fixes this when a kernel is decorated, so once the kernels are
    imported its value wins over a later change of the environment. (Not
    looked up while torch.compile traces: a look into ``sys.modules`` there
    leaves a guard that the first compiled call, importing the kernels,
    breaks, and the model compiles again.)"""
    mod = None if torch.compiler.is_compiling() else sys.modules.get("conv_patch.kernels.common")
    if mod is not None:
        return bool(mod.INTERPRET)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Looked up once, at import: a traced call (torch.compile) cannot call
# importlib (Dynamo refuses to trace ``find_spec``), and an installed
# package does not appear or vanish within a process.
_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON


@functools.lru_cache(maxsize=None)
def _gpu_arch(index: int) -> tuple:
    if torch.version.hip is not None:
        name = torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
        return name, True
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}", (major, minor) >= MIN_CUDA_CAPABILITY


@functools.lru_cache(maxsize=None)
def gpu_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (the cost model's
    waves of tiles)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_for(device: torch.device) -> Target:
    # Asked on hot paths (a call's route, attention, GroupNorm): the answer
    # per device and environment is kept, the environment read each time.
    interp = interpreter_enabled()
    index = device.index
    if device.type == "cuda" and index is None and not interp:
        index = torch.cuda.current_device()
    if torch.compiler.is_compiling():
        # Traced, the same answer built without the caches: Dynamo traces
        # through an lru_cache anyway, and warns at the first one it meets.
        return build_target(device.type, index, interp, triton_available(), _gpu_arch.__wrapped__,
                            gpu_sms.__wrapped__)
    return _target(device.type, index, interp, triton_available())


@functools.lru_cache(maxsize=None)
def _target(kind: str, index: Optional[int], interp: bool, triton: bool) -> Target:
    return build_target(kind, index, interp, triton, _gpu_arch, gpu_sms)


def build_target(kind: str, index: Optional[int], interp: bool, triton: bool, arch_of, sms_of) -> Target:
    """The target of device ``kind:index`` (``arch_of(index)``: its (arch,
    new enough?), ``sms_of(index)``: its SMs)."""
    device = torch.device(kind) if index is None else torch.device(kind, index)
    if not triton:
        return Target("none", False, "triton is not installed")
    if device.type == "cpu":
        if interp:
            return Target("interpreter", True, interpreter=True)
        return Target("cpu", False, "input on cpu (kernels run on GPUs, or on the CPU under TRITON_INTERPRET=1)")
    if device.type == "cuda":
        if interp:
            return Target("interpreter", False, "TRITON_INTERPRET=1: GPU tensors use PyTorch", interpreter=True)
        arch, ok = arch_of(index)
        if not ok:
            return Target(arch, False, f"GPU {arch} is older than sm80")
        return Target(arch, True, sms=sms_of(index))
    return Target(device.type, False, f"device type {device.type!r} has no kernels")


def default_target() -> Target:
    """The target of the current GPU, else of the CPU."""
    if torch.cuda.is_available():
        return target_for(torch.device("cuda", torch.cuda.current_device()))
    return target_for(torch.device("cpu"))


def what_runs(device=None) -> str:
    """One plain sentence on what a patched model runs on ``device`` (default:
    the current GPU, else the CPU): the examples and ``convpatch info`` print
    it, because a patch report lists routes even where no kernel can run."""
    t = default_target() if device is None else target_for(torch.device(device))
    if t.kernels and t.interpreter:
        return ("the kernels run on the CPU under the Triton interpreter (TRITON_INTERPRET=1): "
                "to check them, far slower than PyTorch")
    if t.kernels:
        return (f"the Triton kernels run on this GPU ({t.arch}) wherever its config table says they beat "
                "PyTorch as called; everything else runs PyTorch's code")
    if t.arch == "cpu":
        why = "no CUDA GPU"
    elif t.arch == "none":
        why = "Triton is not installed (a dependency on Linux only)"
    else:
        why = t.reason
    verify = ("; `convpatch verify` runs the kernels themselves under the Triton interpreter to check them"
              if t.arch == "cpu" else "")
    return (f"{why}: a patched model runs its original PyTorch code (no speed-up)"
            + verify)


def conv_tf32_enabled() -> bool:
    """PyTorch's own switch for TF32 in fp32 convolutions (on by default).
    Reads the new per-op flag first: mixing it with the legacy allow_tf32
    makes PyTorch raise on the legacy read."""
    try:
        prec = torch.backends.cudnn.conv.fp32_precision
        if prec == "tf32":
            return True
        if prec == "ieee":
            return False
    except AttributeError:
        pass
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return False


@contextlib.contextmanager
def conv_tf32(enabled: bool):
    """Inside the block, fp32 convolutions use TF32 (``True``) or exact IEEE
    fp32 (``False``), for PyTorch and for conv-patch alike; restored after.
    Sets the per-op flag where it exists, else the legacy allow_tf32."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        old = conv.fp32_precision
        conv.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            conv.fp32_precision = old
    else:  # torch < 2.9
        old = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = enabled
        try:
            yield
        finally:
            torch.backends.cudnn.allow_tf32 = old


def dot_precision(dtype: torch.dtype, target: Target) -> str:
    if dtype == torch.float32 and not target.interpreter and conv_tf32_enabled() and target.arch.startswith("sm"):
        return "tf32"
    return "ieee"
