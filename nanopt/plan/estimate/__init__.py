"""`nanopt estimate`: what a run will cost before any GPU is rented, and whether it fits.

Combines a run's configs (or a bare parameter count) with the formulas of `flops`, the memory model and the GPU
table of `hardware` (or this machine's CPU, `--gpu cpu`) into one JSON-ready report, with a verdict on memory and
the changes that would make a run fit. Pure arithmetic: no torch.

Throughput is assumed (an MFU of the device's peak) unless the run directory holds a preflight.json
(nanopt.plan.preflight_record) measured with the run's current settings on the estimate's device and GPU count,
and no MFU was given: then it is the measured tokens/s, and the report says so (`throughput_source`).

The parts: `options` (what to estimate with, bounded), `target` (the device and the memory model of the run on it),
`report` (the sections of the report), `fit` (the verdict and its remedies), `layouts` (the parallelism table),
`ladder` (every rung of the memory ladder at the run's GPU count, the fastest that fits, and --compare-gpus).
"""

from nanopt.plan.estimate.options import DEFAULT_MFU, EstimateOptions, check_mfu
from nanopt.plan.estimate.report import estimate

__all__ = ["DEFAULT_MFU", "EstimateOptions", "check_mfu", "estimate"]
