"""Rendering for the commands: human formatting of numbers and tables (format), the live view of a training run
(train), a data mixture's figures (mixture), a run's prediction against what was measured (prediction), run health
(health) and estimate's memory-ladder tables (estimate_ladder). The console they print through is
nanopt.cli.terminal."""
