"""The public API's machinery: ``apply`` / ``remove`` / ``patched`` (plan the
swaps, then swap), ``PatchConfig`` and ``PatchReport``."""
