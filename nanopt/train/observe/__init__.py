"""What a run records and tells: metrics.jsonl, spikes and the loss chart (metrics), the records read back (records,
eval_history), TensorBoard and W&B (sinks), the observer the CLI renders (events), time per phase and cost (phases),
the session's pace (pace), the prediction against what was measured (prediction) and downstream task accuracy on the
chart (task_curves)."""
