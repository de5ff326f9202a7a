"""What the cost model knows of one machine: host costs, copy bandwidth,
launch latency, SM count and the lean route's timing model, read from an
architecture's table (``"calibration"`` in configs/<arch>.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict

HOST_KEYS = ("conv", "conv_1x1", "op", "base", "refresh", "launch", "alloc", "desc", "unplanned")


@dataclass(frozen=True)
class Calibration:
    """What the cost model knows of a machine, from its architecture's
    table (``"calibration"`` in configs/<arch>.json; an architecture
    without one gets default.json's, curated; configs/README.md says what
    each means and docs/performance.md where it was measured):

    * ``host_us``: microseconds of host time: "conv" ``F.conv2d`` of a 3x3
      (or larger) kernel, "conv_1x1" of a 1x1 one, "op" one PyTorch
      elementwise op, "base" a planned call's own Python, "refresh" a weight
      pack's refresh, "launch" one replayed Triton launch, "alloc" one
      output or scratch allocation, "desc" one TMA descriptor rebuilt,
      "unplanned" the cuDNN route's epilogue pass through its launcher;
    * ``copy_tbps``: device-to-device copy bandwidth, and ``launch_ms`` a
      launch's fixed GPU latency: the memory-bound terms;
    * ``refresh_tbps``: the bandwidth of an eager weight pack's refresh
      (PyTorch's strided copy of an NCHW weight into the channels_last
      pack, reading and writing it: slower than a dense copy); a table
      without it gets ``copy_tbps``;
    * ``sms``: the architecture's SM count, where the device's own is not
      known (a GPU's target reads it at start);
    * the lean route's GPU time model: each wave of up to
      ``lean_ctas_per_sm`` tiles per SM takes ``lean_step_us`` per K step
      (``lean_step_1x1_us`` for a 1x1 conv, whose steps gather nothing;
      fp32 ``lean_fp32_factor`` times that); it is taken only where it
      saves at least ``lean_min_saving_us`` of host time per call.
    """

    host_us: Dict[str, float]
    copy_tbps: float
    launch_ms: float
    refresh_tbps: float
    sms: int
    lean_step_us: float
    lean_step_1x1_us: float
    lean_ctas_per_sm: int
    lean_fp32_factor: float
    lean_min_saving_us: float

    @classmethod
    def of(cls, data: dict, where: str = "calibration") -> "Calibration":
        """From a table's ``"calibration"`` object; ValueError naming the
        field that is missing or not a positive number."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be an object")
        host = data.get("host_us")
        if not isinstance(host, dict) or set(host) != set(HOST_KEYS) or not all(
                isinstance(v, (int, float)) and v >= 0 for v in host.values()):
            raise ValueError(f"{where}.host_us: needs exactly {', '.join(HOST_KEYS)}, each a number >= 0")
        lean = data.get("lean") or {}
        fields = {"copy_tbps": data.get("copy_tbps"), "launch_ms": data.get("launch_ms"), "sms": data.get("sms"),
                  "refresh_tbps": data.get("refresh_tbps", data.get("copy_tbps")),
                  "lean_step_us": lean.get("step_us"), "lean_step_1x1_us": lean.get("step_1x1_us"),
                  "lean_ctas_per_sm": lean.get("ctas_per_sm"), "lean_fp32_factor": lean.get("fp32_factor"),
                  "lean_min_saving_us": lean.get("min_saving_us")}
        for name, v in fields.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{where}: {name} must be a positive number, got {v!r}")
        return cls(host_us={k: float(v) for k, v in host.items()}, copy_tbps=float(fields["copy_tbps"]),
                   launch_ms=float(fields["launch_ms"]), refresh_tbps=float(fields["refresh_tbps"]),
                   sms=int(fields["sms"]),
                   lean_step_us=float(fields["lean_step_us"]), lean_step_1x1_us=float(fields["lean_step_1x1_us"]),
                   lean_ctas_per_sm=int(fields["lean_ctas_per_sm"]),
                   lean_fp32_factor=float(fields["lean_fp32_factor"]),
                   lean_min_saving_us=float(fields["lean_min_saving_us"]))

    def with_host(self, **host_us) -> "Calibration":
        """This calibration with some host costs replaced (tests, A/Bs)."""
        return dataclasses.replace(self, host_us=dict(self.host_us, **host_us))
