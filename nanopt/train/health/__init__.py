"""Run health, in one place: the signals and the verdicts judged from them (verdicts, pure arithmetic), the signals
measured on the device at log steps (probe), the spans of steps they are judged over (window), the training loop's
side (watch) and the replay of a run's metrics.jsonl through the same monitor for `nanopt health` and
`nanopt eval --health` (replay). Rendering lives in nanopt.cli.display.health."""
