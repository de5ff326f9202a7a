"""Model-family rewrites, installed as ``conv_patch.recipes`` (none yet)."""
