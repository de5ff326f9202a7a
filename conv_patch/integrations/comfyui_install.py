"""``convpatch comfyui-install DIR``: put the "Conv Patch VAE" node into ComfyUI.

The node's code lives in the installed package (``conv_patch.integrations.comfyui``,
imported by every shim as ``conv_patch.comfyui``, a path kept stable), so a
plain ``pip install`` (wheel, git URL, checkout) carries it. What goes into
ComfyUI's ``custom_nodes`` folder is a shim package, ``conv_patch_node``,
whose ``__init__.py`` imports the node mappings from ``conv_patch``; upgrading
conv-patch upgrades the node, the shim stays. Kept free of torch so that the
command works in any Python.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

NODE_DIR = "conv_patch_node"
# The first line of every shim we write: how a later run knows the folder is ours.
MARKER = "# Written by `convpatch comfyui-install`"
# The whole __init__.py that examples/comfyui held before the command existed
# (copied or symlinked by hand): recognised as ours too.
_LEGACY_IMPORT = "from conv_patch.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS"

SHIM = MARKER + '''; refreshed by running it again.
"""ComfyUI custom node package of conv-patch: the node "Conv Patch VAE"
(category conv-patch). Its code is the installed conv_patch package
(conv_patch.comfyui), so upgrading conv-patch upgrades the node."""

import logging
import sys

try:
    from conv_patch.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
except ImportError as e:
    # ComfyUI would log a traceback and "IMPORT FAILED"; say what to do instead.
    if isinstance(e, ModuleNotFoundError) and e.name == "conv_patch":
        logging.error("conv-patch: the Conv Patch VAE node is not loaded: conv_patch is not installed in the "
                      "Python running ComfyUI (%s). Install it there: \\"%s\\" -m pip install /path/to/conv-patch "
                      "(or a git URL), then restart ComfyUI.", sys.executable, sys.executable)
    else:
        logging.error("conv-patch: the Conv Patch VAE node is not loaded: importing conv_patch failed in %s: %s",
                      sys.executable, e)
    NODE_CLASS_MAPPINGS = {}
    NODE_DISPLAY_NAME_MAPPINGS = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
'''


class InstallError(Exception):
    """A folder the shim cannot go into: one line naming the path."""


def custom_nodes_dir(path: str) -> Path:
    """``path`` itself, or its ``custom_nodes`` child when ``path`` is
    ComfyUI's root (a folder holding ``custom_nodes/``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InstallError(f"{path}: no such folder (give ComfyUI's custom_nodes folder, or ComfyUI's root)")
    if not p.is_dir():
        raise InstallError(f"{path}: not a folder (give ComfyUI's custom_nodes folder, or ComfyUI's root)")
    if p.name != "custom_nodes" and (p / "custom_nodes").is_dir():
        return p / "custom_nodes"
    return p


def _is_ours(target: Path) -> bool:
    if target.is_symlink() or not target.is_dir():
        return False
    names = {e.name for e in target.iterdir()}
    if not names <= {"__init__.py", "__pycache__"} or "__init__.py" not in names:
        return False
    try:
        text = (target / "__init__.py").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return text.startswith(MARKER) or (_LEGACY_IMPORT in text and len(text) < 1000)


def _what_is(target: Path) -> str:
    if target.is_symlink():
        return f"a symlink to {os.readlink(target)}"
    if target.is_dir():
        return "a folder not written by convpatch comfyui-install"
    return "a file"


def install(path: str, force: bool = False) -> Path:
    """Write ``conv_patch_node/__init__.py`` into the custom_nodes folder
    ``path`` (or ComfyUI root); return the file written. A ``conv_patch_node``
    written by an earlier run is refreshed; anything else there is replaced
    only with ``force``."""
    nodes = custom_nodes_dir(path)
    target = nodes / NODE_DIR
    if not os.access(nodes, os.W_OK | os.X_OK):
        raise InstallError(f"{nodes}: cannot write there (permission denied)")
    exists = target.exists() or target.is_symlink()
    if exists and not _is_ours(target):
        if not force:
            raise InstallError(f"{target}: already exists, {_what_is(target)}; "
                               f"--force replaces it (deleting what is there)")
        try:
            if target.is_symlink() or not target.is_dir():
                target.unlink()
            else:
                shutil.rmtree(target)
        except OSError as e:
            raise InstallError(f"{target}: cannot remove it ({e.strerror})") from None
    init = target / "__init__.py"
    tmp = target / "__init__.py.tmp"
    try:
        target.mkdir(exist_ok=True)
        tmp.write_text(SHIM, encoding="utf-8")
        os.replace(tmp, init)
        shutil.rmtree(target / "__pycache__", ignore_errors=True)
    except OSError as e:
        raise InstallError(f"{e.filename or target}: cannot write there ({e.strerror})") from None
    return init


def notes(init: Path) -> List[str]:
    """What to tell the user after :func:`install`."""
    lines = [f"wrote {init}",
             f"it imports the node from the conv_patch package installed in {sys.executable}; ComfyUI must run a "
             f"Python where `import conv_patch` works (if it runs another one: that python -m pip install "
             f"/path/to/conv-patch)"]
    embedded = _portable_python(init.parent.parent)
    if embedded is not None and Path(sys.executable).resolve() != embedded.resolve():
        lines.append(f"this looks like the Windows portable ComfyUI: install into its Python with "
                     f"{embedded} -m pip install /path/to/conv-patch")
    if sys.platform != "linux":
        lines.append("Triton is a dependency on Linux only: here the node loads and its VAE runs ComfyUI's own "
                     "code (no kernels)")
    lines.append("restart ComfyUI (stop the server, start main.py again) to load the node: "
                 "\"Conv Patch VAE\", category conv-patch")
    return lines


def _portable_python(custom_nodes: Path) -> Optional[Path]:
    # ComfyUI_windows_portable/{python_embeded,ComfyUI/custom_nodes}
    for name in ("python_embeded", "python_embedded"):
        exe = custom_nodes.parent.parent / name / "python.exe"
        if exe.is_file():
            return exe
    return None
