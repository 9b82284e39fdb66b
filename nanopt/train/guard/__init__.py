"""What guards a training session and ends it well: one writer per run directory (lock), a stop asked at a step
boundary (preemption), a run that makes no progress (stall), spikes rolled back to a checkpoint (recovery), a lost
peer, a full disk or out-of-memory said in one line (failures, oom), and the on-exit hook (exit_hook)."""
