"""Planning a run before paying for it: `estimate` (pure arithmetic), `find_batch` (real trial steps) and
`profile` (a traced window of real steps).

Imports nanopt.train (find-batch and profile measure the session training builds), nanopt.model, nanopt.runtime,
nanopt.hardware and the contracts.
"""
