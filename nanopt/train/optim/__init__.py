"""The optimizer and its learning rate: the optimizer train.json's `optimizer` names (optimizer), Muon's batched step
(muon_step), AdamW with 8-bit moments (lowbit), ZeRO-1's sharded optimizer state (zero) and the learning-rate
schedule, a pure function of the step (schedule)."""
