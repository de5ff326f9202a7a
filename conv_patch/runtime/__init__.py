"""What runs at a patched call: the wrappers, the one dispatch entry and its
plans, the per-module state, weight packs, CUDA graphs, passthrough and the
torch.compile op."""
