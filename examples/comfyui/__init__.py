"""ComfyUI custom node package for conv-patch.

Install conv-patch into ComfyUI's Python (``pip install conv-patch``), then copy
or symlink this folder to ``ComfyUI/custom_nodes/conv_patch_node``. The node
"Conv Patch VAE" (category conv-patch) takes a VAE and returns it patched.
"""

from conv_patch.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
