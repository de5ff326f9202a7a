"""A plain install (``pip install conv-patch``, no extras) runs every
documented command: each third-party import of the package is declared in
pyproject.toml, guarded, or behind an extra that the error message names.

.ci/run proves the same in a second, extras-free environment; these tests
catch an undeclared import on the fast path, from the test environment.
"""

import ast
import functools
import importlib.metadata as md
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("conv_patch", "kernels", "recipes")  # all installed inside conv_patch (pyproject package-dir)


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _declared() -> set:
    return {_norm(Requirement(r).name) for r in _project()["dependencies"]}


def _extras() -> dict:
    return {extra: {_norm(Requirement(r).name) for r in reqs}
            for extra, reqs in _project().get("optional-dependencies", {}).items()}


@functools.lru_cache(maxsize=None)
def _packages_distributions() -> dict:
    return md.packages_distributions()  # a scan of every installed distribution: once


def _dists_of(module: str) -> set:
    """The distributions that install top-level ``module`` (PIL -> pillow);
    the module's own name when none is installed here."""
    return {_norm(d) for d in _packages_distributions().get(module, [module])}


def _catches_import_error(node: ast.Try) -> bool:
    for h in node.handlers:
        names = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
            return True
    return False


def _imports(tree: ast.AST):
    """(line, top-level module, lazy, guarded) for each absolute import:
    lazy when inside a function, guarded when inside a try that catches
    ImportError."""
    found = []

    def walk(node, lazy, guarded):
        for child in ast.iter_child_nodes(node):
            c_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            c_guarded = guarded or (isinstance(node, ast.Try) and child in node.body
                                    and _catches_import_error(node))
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name.partition(".")[0], c_lazy, c_guarded) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                found.append((child.lineno, child.module.partition(".")[0], c_lazy, c_guarded))
            walk(child, c_lazy, c_guarded)

    walk(tree, False, False)
    return found


def test_every_import_is_declared_guarded_or_an_extra():
    """A module-level import must be stdlib, the package, a declared
    dependency, or inside ``try: ... except ImportError``. A lazy import (in a
    function) may also be of an extra's package: its callers turn the
    ImportError into one line naming the extra."""
    declared, extras = _declared(), _extras()
    in_extras = set().union(*extras.values())
    bad = []
    for src in SOURCES:
        for path in sorted((ROOT / src).rglob("*.py")):
            for line, mod, lazy, guarded in _imports(ast.parse(path.read_text(), str(path))):
                if mod in sys.stdlib_module_names or mod == "conv_patch" or guarded:
                    continue
                dists = _dists_of(mod)
                if dists & declared or (lazy and dists & in_extras):
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{line}: import {mod} ({'/'.join(sorted(dists))}) is "
                           + ("in no extra and not declared" if lazy else "not in pyproject dependencies"))
    assert not bad, "undeclared imports (a plain install fails on them):\n" + "\n".join(bad)


def test_extras_named_in_messages_exist():
    """Every "pip install 'conv-patch[X]'" the code prints names a real extra."""
    extras = _extras()
    named = {m for src in SOURCES for p in (ROOT / src).rglob("*.py")
             for m in re.findall(r"conv-patch\[([\w,-]+)\]", p.read_text())}
    assert named, "the scan found no message naming an extra; the pattern is stale"
    missing = {e for n in named for e in n.split(",") if e not in extras}
    assert not missing, f"messages name extras pyproject.toml lacks: {sorted(missing)}"


def _plain_closure() -> set:
    """The distributions a plain install brings: the declared dependencies
    and, transitively, their own (no extras, markers of this machine)."""
    todo, seen = list(_project()["dependencies"]), set()
    while todo:
        req = Requirement(todo.pop())
        name = _norm(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += md.requires(req.name) or []
        except md.PackageNotFoundError:
            pass  # declared but not installed here: the run below says what breaks
    return seen


def test_plain_install_runs_verify(tmp_path):
    """``convpatch verify FILE --image IMG --json R`` and ``convpatch info``
    in a subprocess that can import only what a plain install has (the
    modules of every other installed distribution raise ModuleNotFoundError,
    as if absent; the standard library stays): the kernels under the Triton
    interpreter, the safetensors reader, PIL, plain output. This catches
    numpy, which the interpreter imports but neither this package nor triton
    declared, and which no import of the package names."""
    torch = pytest.importorskip("torch")
    from PIL import Image
    from safetensors.torch import save_file

    closure = _plain_closure() | {"conv-patch"}
    blocked = sorted(m for m, ds in _packages_distributions().items() if not {_norm(d) for d in ds} & closure)
    assert "diffusers" in blocked and "torch" not in blocked  # the test env has the extras; they are hidden
    save_file({"conv.weight": torch.randn(4, 3, 3, 3), "conv.bias": torch.randn(4)},
              str(tmp_path / "one.safetensors"))
    Image.new("RGB", (16, 16), (200, 30, 90)).save(tmp_path / "img.png")
    code = textwrap.dedent(f"""
        import sys

        BLOCKED = set({blocked!r})

        class PlainInstall:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, PlainInstall())
        from conv_patch.tools import cli
        rc = cli.main(["verify", "one.safetensors", "--device", "cpu", "--image", "img.png", "--json", "r.json"])
        # info second: its "import triton" would fix Triton's own jit functions as compiled, not
        # interpreted, before verify turns the interpreter on (one command per process in real use).
        sys.exit(rc or cli.main(["info"]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # cli sets it for --device cpu
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert "PASS" in r.stdout and "conv2d_" in r.stdout and "Triton interpreter" in r.stdout
    assert (tmp_path / "r.json").exists()


def test_without_triton_verify_and_info_say_so(monkeypatch, capsys, tmp_path):
    """No triton (macOS, Windows): every layer runs the original module, and
    the report says no kernel was checked instead of claiming the
    interpreter ran them; info says kernels: no."""
    import torch
    from safetensors.torch import save_file

    from conv_patch.tools import cli
    from conv_patch import target

    save_file({"conv.weight": torch.randn(4, 3, 3, 3)}, str(tmp_path / "one.safetensors"))
    monkeypatch.setattr(target, "triton_available", lambda: False)
    assert cli.main(["verify", str(tmp_path / "one.safetensors"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "no kernel ran: Triton is not installed" in out and "PASS" in out
    assert "Triton interpreter" not in out and "conv2d_igemm" not in out
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "here: Triton is not installed" in out and "triton available: False" in out


def test_without_torch_the_command_says_so_in_one_line(tmp_path):
    """A broken install without torch: the package imports, any use of it
    names the fix, and convpatch prints one line and exits 2 (the README's
    'bad input or usage'), not a traceback and exit 1."""
    code = textwrap.dedent("""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "torch":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoTorch())
        import conv_patch
        try:
            conv_patch.apply
        except ModuleNotFoundError as e:
            print(e)
        from conv_patch.tools import cli
        sys.exit(cli.main(["verify"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "conv_patch.apply: PyTorch is not installed here: pip install torch" in r.stdout
    assert r.stderr.strip().splitlines() == ["convpatch: error: PyTorch is not installed here: pip install torch "
                                             "(a CUDA build on a GPU machine)"]


# The checkout's top-level folders that hold Python: installed inside
# conv_patch (kernels, recipes, configs) or run from the checkout (bench).
TOP_LEVEL = ("kernels", "recipes", "configs", "bench")


def test_the_checkout_root_shadows_no_installed_package():
    """Python started in the checkout's root (pytest, ``python -c``, a
    notebook: the root is on sys.path) imports diffusers' Wan VAE, whose
    transformers imports Hugging Face's ``kernels``; that ``kernels`` is the
    installed one, and none of the top-level folders loads a module of ours
    under a top-level name: at most an empty namespace, and any module of
    ours imported through it refuses (it is conv_patch's)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("kernels")  # Hugging Face's (the test extra has it; transformers >= 5.25 needs it)
    code = textwrap.dedent(f"""
        import importlib, os, sys
        ROOT = {str(ROOT)!r}
        assert os.path.abspath(sys.path[0] or os.getcwd()) == ROOT, sys.path[:2]
        from diffusers import AutoencoderKLWan, AutoencoderKL  # noqa: F401
        import kernels
        assert kernels.get_kernel.__module__.startswith("kernels."), kernels.get_kernel.__module__
        OWN = [os.path.join(ROOT, d) + os.sep for d in {TOP_LEVEL!r} + ("conv_patch",)]

        def ours(mod):
            f = getattr(mod, "__file__", None)
            return f is not None and any(os.path.abspath(f).startswith(d) for d in OWN)

        assert not ours(kernels), kernels.__file__

        for name in {TOP_LEVEL!r}:
            try:
                top = importlib.import_module(name)
            except ImportError:
                continue
            assert not ours(top), (name, top)
            for f in sorted(os.listdir(os.path.join(ROOT, name))):
                if not f.endswith(".py") or name == "bench":
                    continue
                try:
                    mod = importlib.import_module(name + "." + f[:-3])
                except ImportError:
                    continue
                assert not ours(mod), (name, f, mod)
        stray = sorted(n for n, m in list(sys.modules.items()) if ours(m) and not n.startswith("conv_patch"))
        assert not stray, stray
        import conv_patch.kernels.api, conv_patch.recipes.catalog  # noqa: F401  (found beside conv_patch/)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def test_in_this_process_kernels_is_hugging_faces():
    """The same in the test process itself (pytest puts the root first on
    sys.path: ``pythonpath`` in pyproject.toml)."""
    kernels = pytest.importorskip("kernels")
    assert str(ROOT) in [os.path.abspath(p) for p in sys.path]
    assert callable(kernels.get_kernel)
    assert not os.path.abspath(kernels.__file__).startswith(str(ROOT / "kernels") + os.sep), kernels.__file__
