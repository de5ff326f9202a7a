"""Every process gives a kernel the same Triton cache key (kernels/cache_keys.py).

Triton 3.6 (what torch 2.11 ships) merges a ``@triton.jit`` helper's
constexpr globals into its caller's hash before hashing the helper, so a
kernel hashed before its helpers gets another key than one hashed after them;
which came first followed a process's first launches, and a later process
missed the cache its kernels were compiled into (TAEF2 512²'s warm first
call compiled 17 kernels again on an H100). ``cache_keys.fix`` hashes a
kernel's helpers before it. The children below emulate both merges, so the
test means the same whatever Triton the CI installs; they run without
``TRITON_INTERPRET`` (the interpreter's functions have no such keys).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import json, sys
    from triton.runtime import jit as J

    def merge_first(self, func):  # Triton 3.6: the helper's globals read before it is hashed
        self.used_global_vals.update(func.used_global_vals)
        self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode("utf-8"))

    def hash_first(self, func):  # Triton 3.9: the helper hashed first
        key = func.cache_key
        self.used_global_vals.update(func.used_global_vals)
        self.hasher.update((key + str(getattr(func, "noinline", False))).encode("utf-8"))

    J.DependenciesFinder._update_hash = merge_first if sys.argv[1] == "3.6" else hash_first
    import conv_patch.kernels.api  # noqa: F401 - every kernel module
    from conv_patch.kernels import cache_keys
    fns = cache_keys.loaded()
    # The kernels first, as a process's first launches may hash them; each
    # through cache_keys.fix (as launch does) or straight away (Triton).
    for _, name, fn in sorted(fns, key=lambda t: (not t[1].endswith("_kernel"), t[0], t[1])):
        if sys.argv[2] == "fix":
            cache_keys.fix(fn)
        fn.cache_key
    print(json.dumps({f"{m}.{n}": f.cache_key for m, n, f in fns}))
""")


def _keys(tmp_path, merge: str, how: str) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    proc = subprocess.run([sys.executable, str(script), merge, how], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_kernels_cache_key_does_not_follow_what_the_process_hashed_first(tmp_path):
    from triton.runtime import jit
    if not hasattr(getattr(jit, "DependenciesFinder", None), "_update_hash"):
        pytest.skip("this Triton hashes a kernel's helpers another way")
    fixed_36 = _keys(tmp_path, "3.6", "fix")
    kernels_first_36 = _keys(tmp_path, "3.6", "kernels-first")
    kernels_first_39 = _keys(tmp_path, "3.9", "kernels-first")
    # The fix gives the keys of a Triton that hashes helpers first, whatever the order...
    assert fixed_36 == kernels_first_39
    # ...where Triton 3.6's own order gives some kernels other keys (the bug the fix is for).
    differ = sorted(k for k in fixed_36 if fixed_36[k] != kernels_first_36[k])
    assert any(k.endswith("conv2d_tma_kernel") for k in differ), differ


def test_the_kernels_are_hashed_before_the_first_launch_compiles(monkeypatch):
    """Every path of ``launch`` that may reach Triton's compile fixes the keys
    first (a GPU launches; on the CPU the call that would compile is stood in
    for)."""
    from conv_patch.kernels import cache_keys, launch as kl
    calls = []
    monkeypatch.setattr(cache_keys, "fix", lambda kernel: calls.append("fix"))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append("launch")

    monkeypatch.setattr(kl, "_fast_launch_on", lambda: False)
    kl.launch(Kernel(), (1,), 3)
    assert calls == ["fix", "launch"]
