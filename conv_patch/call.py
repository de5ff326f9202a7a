"""One call of a patched convolution, as one object: what the wrappers, the
recipes' steps, the torch.compile op and the folded upsample hand the one
dispatch entry (``dispatch.conv`` / ``dispatch.conv3d``), and what its plans
run.

``out_scale * act(conv(x) + bias + beta * residual)``, into ``out`` where
given (it may be ``residual``: the epilogue reads each residual element
before writing it). A 2-D call may also carry its own ``padding`` (F.pad
order: it replaces the module's, a folded F.pad or a band's image-edge rows),
``no_bias`` (the result is ``(y, b)`` with ``y + b`` the output, for a
GroupNorm that folds the bias in), a transposed conv's ``output_padding``
and the extra arguments of the module's own forward (``fallback_args``); a
Conv3d call its cached frames (``cache``: the frames before ``x`` in time),
its padding per axis (``pads``, (front, back) each; None: the module's) and
the module's own computation of the call (``own()``: what runs where the
kernels do not).
"""

from __future__ import annotations


class Call:
    __slots__ = ("x", "residual", "beta", "activation", "out_scale", "out", "padding", "no_bias",
                 "output_padding", "fallback_args", "cache", "pads", "own")

    def __init__(self, x, residual=None, beta=1.0, activation="none", out_scale=1.0, out=None, padding=None,
                 no_bias=False, output_padding=None, fallback_args=(), cache=None, pads=None, own=None):
        self.x = x
        self.residual = residual
        self.beta = beta
        self.activation = activation
        self.out_scale = out_scale
        self.out = out
        self.padding = padding
        self.no_bias = no_bias
        self.output_padding = output_padding
        self.fallback_args = fallback_args
        self.cache = cache
        self.pads = pads
        self.own = own

    @property
    def plain_epilogue(self) -> bool:
        """No residual, activation or scale: the conv alone."""
        return self.residual is None and self.activation == "none" and self.out_scale == 1.0

    def __repr__(self) -> str:
        shape = None if self.x is None else tuple(self.x.shape)
        return f"Call(x={shape}, activation={self.activation!r}, residual={self.residual is not None})"
