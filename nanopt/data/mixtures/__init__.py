"""Data mixtures: several datasets read at the weights of train.json's phases (mixture), which source each sample
comes from (interleave), and what a run will read from each source, before it runs (mixture_plan)."""
