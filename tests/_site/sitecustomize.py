"""The tests' processes under the Triton interpreter (TRITON_INTERPRET=1,
set by the conftest, which puts this folder on PYTHONPATH for the processes
they start): the interpreter's speed-ups the test process has
(interpreter_speedups.py). Nothing anywhere else. The environment's own
sitecustomize, which this one shadows, runs after it (a coverage hook, a
distribution's)."""

import importlib.util
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    try:
        import interpreter_speedups
        interpreter_speedups.install()
    except Exception:
        pass


def _run_the_next_one() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        path = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("sitecustomize_of_the_environment", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


try:
    _run_the_next_one()
except Exception:
    pass
