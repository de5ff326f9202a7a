"""The launch cache (kernels/_launch.py ``launch``): a cache hit must launch
the kernel Triton's own lookup would have picked, so its key must change
whenever Triton's specialisation of the arguments can."""

from types import SimpleNamespace

import pytest
import torch

from conv_patch.kernels import launch as _launch


def test_key_follows_what_triton_specialises():
    x = torch.zeros(64)
    key = _launch.arg_key
    assert key((x, 5, 1.5)) == key((torch.ones(64), 5, 2.5))  # values of tensors and floats: same kernel
    assert key((x,)) != key((x[1:],))  # 16-byte alignment of a pointer
    assert key((x,)) != key((x.half(),))  # dtype
    assert len({key((v,)) for v in (1, 2, 16, 17, 2**31)}) == 5  # == 1, % 16, 64-bit
    assert key((object(),)) is None  # unknown kinds take Triton's own path


def test_launch_hooks_send_every_call_through_triton():
    """Triton 3.6+ keeps an always-present HookChain: only hooks in it
    (a profiler's) count as installed."""
    empty, busy = SimpleNamespace(calls=[]), SimpleNamespace(calls=[print])
    assert not _launch._hooked(None) and not _launch._hooked(empty)
    assert _launch._hooked(busy) and _launch._hooked(print)


def _param(name, const):
    return SimpleNamespace(name=name, is_constexpr=const)


def test_constexprs_are_appended_in_signature_order():
    kernel = SimpleNamespace(params=[_param("x", False), _param("n", False), _param("A", True), _param("B", True)])
    assert _launch._constexpr_values(kernel, 2, {"B": 3, "A": 7, "num_warps": 4}) == (7, 3)
    # A constexpr missing from the call, or one before a runtime argument:
    # not cached (Triton's path every time).
    assert _launch._constexpr_values(kernel, 2, {"A": 7}) is None
    mixed = SimpleNamespace(params=[_param("x", False), _param("A", True), _param("n", False)])
    assert _launch._constexpr_values(mixed, 2, {"A": 1}) is None


@pytest.mark.gpu
def test_cached_launches_equal_tritons_own(monkeypatch):
    """Conv (portable and TMA), GroupNorm and the epilogue, each launched
    through the cache twice (miss, hit), equal Triton's own path bitwise,
    including a call whose input is not 16-byte aligned after an aligned one."""
    from conv_patch import functional
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(2, 32, 19, 23, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
    w = torch.randn(24, 32, 3, 3, device=dev, dtype=dt) * 0.05
    b = torch.randn(24, device=dev, dtype=dt)
    flat = torch.randn(2 * 32 * 19 * 23 + 1, device=dev, dtype=dt)
    unaligned = flat[1:].view(2, 19, 23, 32).permute(0, 3, 1, 2)
    tma = {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_W": 16, "num_warps": 4,
           "num_stages": 3}
    calls = [
        lambda: functional.conv2d(x, w, b, padding=1, activation="silu"),
        lambda: functional.conv2d(x, w, b, padding=1, config=tma),
        lambda: functional.conv2d(unaligned, w, b, padding=1),
        lambda: functional.group_norm(x, 8, None, None, 1e-6, "silu"),
        lambda: functional.epilogue(x, x[0, :, 0, 0].contiguous(), x, 0.5, "silu"),
    ]
    monkeypatch.setitem(_launch._FAST_STATE, "on", False)
    with torch.no_grad():
        own = [f() for f in calls]
        monkeypatch.setitem(_launch._FAST_STATE, "on", True)
        _launch._FAST.clear()
        for _ in range(2):
            for f, ref in zip(calls, own):
                assert torch.equal(f(), ref)
    assert _launch._FAST, "nothing was cached"
