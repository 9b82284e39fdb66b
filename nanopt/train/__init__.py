"""Training: the loop and its step, optimizer and schedule, parallelism (compile, DDP, FSDP2, activation
checkpointing), checkpoints and resume, metrics, and the state a checkpoint carries.

`loop.train` is the entry point. Imports nanopt.model, nanopt.data, nanopt.evaluate.loss (in-loop validation),
nanopt.runtime and the contracts; never the CLI or rich (progress goes through `events.TrainObserver`).
"""
