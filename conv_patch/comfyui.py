"""The ComfyUI node's import path: every ``custom_nodes/conv_patch_node``
shim ``convpatch comfyui-install`` wrote imports the node mappings from here,
so this path stays whatever the package's layout (the node itself is
``conv_patch.integrations.comfyui``)."""

from conv_patch.integrations.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F401

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
