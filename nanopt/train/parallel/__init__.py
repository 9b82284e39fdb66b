"""How a built model runs on the devices and ranks: wrapped with activation checkpointing, FSDP2 or DDP and
torch.compile, and its state dicts full or sharded (wrap); the checkpointing granularity (recompute); the micro-step
as a CUDA graph (graphed_step); the micro-batch of a run resumed on another world size (world_fit)."""
