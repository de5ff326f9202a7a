"""The tests' processes under the Triton interpreter (TRITON_INTERPRET=1,
set by the conftest, which puts this folder on PYTHONPATH for the processes
they start): the interpreter's speed-ups the test process has
(interpreter_speedups.py). Nothing anywhere else."""

import os

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    try:
        import interpreter_speedups
        interpreter_speedups.install()
    except Exception:
        pass
