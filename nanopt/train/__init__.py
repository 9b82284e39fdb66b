"""Training: the loop and its step, optimizer and schedule, parallelism (compile, DDP, FSDP2, activation
checkpointing), checkpoints and resume, metrics, and the state a checkpoint carries.

Checkpoints in three layers: `checkpoint` (the directory contract: assemble, publish, pointers, retention, verify,
read weights), `sharded` (the torch.distributed.checkpoint shards several ranks write) and `save` (a session's
save, in the background, as a collective); `resume` puts a session back from either layout on any world size.

`loop.train` is the entry point; `validation.evaluate_loss` is its in-loop validation and `nanopt eval`'s held-out
loss alike. Imports nanopt.model, nanopt.data, nanopt.runtime and the contracts; never the CLI or rich (progress
goes through `events.TrainObserver`).
"""
