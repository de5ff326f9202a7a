"""Tensors conv-patch keeps across calls: a weight pack, a folded upsample
weight, a staging buffer, a graph's static input, a PReLU epilogue's
(bias, slope) buffer. Below every other layer, so that each of them makes
its buffers the one way."""

from __future__ import annotations

import torch


def persistent(make, *args, **kwargs):
    """``make(*args, **kwargs)``, a tensor kept across calls, made outside
    inference mode whatever mode this call runs in. Made inside it, it would
    be an inference tensor, which a later call outside inference mode may
    read but not write: the next refresh in place would raise. (A compiling
    pass, ``conv_patch.warmup``, runs in inference mode before a user's
    first call under ``no_grad``.) A normal tensor may be written in every
    mode."""
    with torch.inference_mode(False):
        return make(*args, **kwargs)
