"""Planning a run before paying for it: `estimate` (pure arithmetic, or a preflight's measured throughput),
`find_batch` (real trial steps), `profile` (a traced window of real steps) and `preflight` (a few dozen real steps,
checked and projected to the run's time and cost).

Imports nanopt.train (find-batch, profile and preflight measure the session training builds, and preflight times
its in-loop validation), nanopt.model, nanopt.runtime, nanopt.hardware and the contracts.
"""
