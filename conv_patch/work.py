"""A process-wide count of the work conv-patch does of its own: every Triton
launch (``kernels.launch`` and a recorded program's replay) and every read of
a weight pack. ``conv_patch.runtime.passthrough`` reads it around a component's call
to learn whether that call ran anything but the component's own computation.
A count, not a flag, so that reading it is one attribute load and bumping it
one store, whatever the thread (a lost update between threads only makes a
component look busier than it was, which keeps it patched)."""


class Work:
    n = 0
