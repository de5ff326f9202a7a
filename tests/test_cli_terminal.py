"""The command on a terminal: ``convpatch verify`` run under a
pseudo-terminal, where the output goes through rich (table, colours,
progress bar) instead of plain text. Names taken from the user's files
(tensor names, the file's own name) are shown as text, never read as rich
markup, and bad input still ends in one line and exit 2."""

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.skipif(not hasattr(pty, "openpty"), reason="no pseudo-terminals here")
# The GPU where there is one (on a CUDA machine the kernels do not run on CPU
# tensors: no interpreter there), else the CPU under the interpreter.
DEVICE = [] if torch.cuda.is_available() else ["--device", "cpu"]


def run_on_a_terminal(argv, cwd, timeout=240):
    """``convpatch ARGV`` with its stdin, stdout and stderr on one
    pseudo-terminal (as a user's shell runs it): (exit code, what it
    printed)."""
    pytest.importorskip("rich")
    main, child = pty.openpty()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)  # conv_patch from this checkout
    env = dict(os.environ, COLUMNS="160", LINES="50", TERM="xterm-256color", PYTHONPATH=path)
    env.pop("NO_COLOR", None)
    p = subprocess.Popen([sys.executable, "-m", "conv_patch.tools.cli", *argv], stdin=child, stdout=child,
                         stderr=child, cwd=cwd, env=env, close_fds=True)
    os.close(child)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.5)
            if ready:
                try:
                    data = os.read(main, 65536)
                except OSError:  # the child closed the terminal (Linux: EIO)
                    break
                if not data:
                    break
                chunks.append(data)
            elif p.poll() is not None:
                break
        else:
            p.kill()
            pytest.fail(f"convpatch {' '.join(argv)} ran past {timeout} s on a terminal")
        code = p.wait(timeout=30)
    finally:
        os.close(main)
    return code, b"".join(chunks).decode("utf-8", "replace")


def test_markup_like_names_on_a_terminal(tmp_path):
    """Tensor names and a file name that look like rich markup: exit 0, no
    traceback, each name printed as it is (it was a MarkupError traceback,
    exit 1, on a terminal only)."""
    path = tmp_path / "[bold]vae [red].safetensors"  # ("/" cannot stand in a file name)
    save_file({"[/x].weight": torch.randn(4, 3, 3, 3), "[bold]b.weight": torch.randn(4, 4, 1, 1)}, str(path))
    code, out = run_on_a_terminal(["verify", str(path), "--size", "8", *DEVICE], tmp_path)
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # colours and cursor moves out
    assert "Traceback" not in out and "MarkupError" not in out, out[-3000:]
    assert code == 0, out[-3000:]
    assert "[/x]" in out and "[bold]b" in out, out[-3000:]
    assert "[bold]vae" in out and "[red].safetensors" in out, out[-3000:]  # the title (it may wrap)
    assert "┃ layer" in out  # rich's table: the terminal path ran, not the plain one
    assert "PASS" in out


def test_bad_input_on_a_terminal_is_one_line_and_exit_2(tmp_path):
    """A file named like markup that is no safetensors file: one line naming
    it, exit 2, on a terminal as in a pipe."""
    path = tmp_path / "[bold]vae[/].safetensors".replace("/", "")
    path.write_bytes(b"\x01\x02")
    code, out = run_on_a_terminal(["verify", str(path), "--size", "8", *DEVICE], tmp_path)
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    lines = [line for line in out.replace("\r", "").splitlines() if line.strip()]
    assert code == 2, out[-3000:]
    assert "Traceback" not in out and len(lines) == 1, out[-3000:]
    assert path.name in lines[0] and "too short" in lines[0], lines


def test_progress_bar_shows_a_markup_like_name_as_text():
    """The same, deterministically: the bar's refresh (which runs in a
    thread of its own on a terminal, where a MarkupError became a traceback
    whenever it met such a name) renders the name as it is."""
    pytest.importorskip("rich")
    from rich.console import Console

    from conv_patch.tools import cli
    console = Console(record=True, width=120, force_terminal=True)
    progress = cli._Progress(True)  # not entered: rendered here, not in the bar's thread
    progress(0, 2, "[/x].weight")
    console.print(progress.bar.get_renderable())
    assert "checking [/x].weight" in console.export_text()
