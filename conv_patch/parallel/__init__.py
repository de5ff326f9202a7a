"""Decode (and encode) at any size: a VAE's image split into row bands that
are computed exactly as the whole image would be.

- ``decode_in_bands`` / ``encode_in_bands``: the bands one after the other on
  one device, within a memory budget (``PatchConfig(max_activation_gib=...)``
  does the same inside a patched model's decode).
- ``decode`` / ``encode``: one band per rank of a ``torch.distributed`` group.

``geometry`` cuts the bands and finds each conv's halo rows, ``stats`` merges
GroupNorm statistics exactly over bands, ``comm`` moves halos, statistics and
outputs (one process, or a process group), ``walker`` runs the recognised
decoders and encoders over bands, ``budget`` plans bands for a memory budget
and holds the ``BandReport``. docs/design.md ("Bands") describes the scheme.
"""

from conv_patch.parallel.api import BandHook, decode, decode_in_bands, encode, encode_in_bands, last_report
from conv_patch.parallel.staging import release_host_staging
from conv_patch.parallel.budget import BandReport
from conv_patch.recipes.layers import UnsupportedModel

__all__ = ["decode", "encode", "decode_in_bands", "encode_in_bands", "BandReport", "BandHook", "UnsupportedModel",
           "last_report", "release_host_staging"]
