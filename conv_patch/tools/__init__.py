"""The ``convpatch`` command and what it runs: verify, tune, info, the
checkpoint readers and format recognition, the embedded TAEF2 model."""
