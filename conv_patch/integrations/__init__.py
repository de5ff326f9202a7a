"""conv-patch inside other programs: ComfyUI's node and its installer."""
