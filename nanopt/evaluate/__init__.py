"""Evaluating trained checkpoints: held-out loss, perplexity and bits per byte on every rank, samples, and the
comparison of runs.

`loss.evaluate_loss` is also training's in-loop validation, so it imports nothing from nanopt.train; the rest
reads checkpoints through nanopt.train.checkpoint. Never the CLI or rich (progress goes through `report.Progress`).
"""
