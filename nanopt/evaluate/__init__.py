"""Evaluating trained checkpoints: held-out loss, perplexity and bits per byte on every rank, samples, and the
comparison of runs.

The held-out loss itself is training's in-loop validation (nanopt.train.validation), so both score a split the
same way; checkpoints are read through nanopt.train.checkpoint. Run health's replay (`nanopt eval --health`) is
nanopt.train.health.replay, beside the monitor it replays. Never the CLI or rich (progress goes through
`report.Progress`).
"""
