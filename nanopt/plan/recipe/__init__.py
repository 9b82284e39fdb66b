"""`nanopt plan`: from a budget to a run directory ready to train (see nanopt.plan.recipe.planner).

The parts: `budget` (what --budget says), `options` (what is asked, on which device), `rule` (DeepSeek LLM's
learning rate and batch), `shape` (the model and its sequence length), `data` (what the dataset holds, and whether
it is enough), `cadence` (batch, warmup, evaluation and checkpoint intervals), `planner` (the plan), `write` (its
record and the run directory).
"""

from nanopt.plan.recipe.options import PlanOptions
from nanopt.plan.recipe.planner import make_plan
from nanopt.plan.recipe.write import check_out, write_run

__all__ = ["PlanOptions", "check_out", "make_plan", "write_run"]
