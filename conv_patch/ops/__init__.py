"""The torch-facing ops a route runs: a convolution's kernel launch or its
cuDNN call with the fused epilogue, Conv3d, GroupNorm, RMS norm, attention,
the subpixel fold. They take what the router decided; they decide nothing."""
