"""Per-task numbers from the pairs' scores, with the harness's definitions (lm_eval/api/task.py
process_results, lm_eval/api/metrics.py):

- acc: the choice with the largest summed log-likelihood is the gold one (ties: the first, as numpy's argmax).
- acc_norm: the same with each log-likelihood divided by its choice's length in characters (the harness's
  len(choice), without the leading space). Not reported for Winogrande, whose choices are contexts.
- acc_per_token: divided by the continuation's token count (llm.c's HellaSwag, nanochat's CORE).
- LAMBADA: acc is the share of passages whose last word is the greedy continuation; perplexity is
  exp(-mean log-likelihood of the last word).
- centered: (accuracy - chance) / (1 - chance), the CORE convention (DCLM, nanochat), of acc_per_token for the
  choice tasks (CORE scores choices per token) and of acc for LAMBADA; chance 0 for LAMBADA.
- stderr: the sample standard deviation over examples / sqrt(n), as the harness reports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from nanopt.evaluate.tasks.catalog import Example, Task
from nanopt.evaluate.tasks.scorer import Score


def first_argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda j: (values[j], -j))


def _normalized(ll: float, by: int) -> float:
    if by > 0:
        return ll / by
    return -math.inf if ll < 0 else ll  # numpy's ll / 0 for a log-likelihood (never positive)


def stderr(values: Sequence[float]) -> float | None:
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def _summary(values: list[float]) -> dict[str, float | None]:
    return {"value": sum(values) / len(values), "stderr": stderr(values)}


def task_metrics(task: Task, examples: Sequence[Example], scores: Sequence[Score]) -> dict:
    """The task's metrics; `scores` holds one Score per pair, in the examples' order."""
    per_example: dict[str, list[float]] = {"acc": [], "acc_norm": [], "acc_per_token": []}
    lambada_ll: list[float] = []
    at = 0
    for example in examples:
        mine = scores[at:at + len(example.pairs)]
        at += len(example.pairs)
        if task.kind == "last_word":
            per_example["acc"].append(float(mine[0].greedy))
            lambada_ll.append(mine[0].loglikelihood)
            continue
        lls = [s.loglikelihood for s in mine]
        per_example["acc"].append(float(first_argmax(lls) == example.gold))
        per_example["acc_norm"].append(float(first_argmax(
            [_normalized(ll, c) for ll, c in zip(lls, example.norm_chars, strict=True)]) == example.gold))
        per_example["acc_per_token"].append(float(first_argmax(
            [_normalized(ll, s.tokens) for ll, s in zip(lls, mine, strict=True)]) == example.gold))
    result: dict = {"n": len(examples), "kind": task.kind, "chance": task.baseline}
    result["acc"] = _summary(per_example["acc"])
    if task.kind == "last_word":
        result["perplexity"] = math.exp(min(-sum(lambada_ll) / len(lambada_ll), 700.0))
        primary = result["acc"]
    else:
        result["acc_per_token"] = _summary(per_example["acc_per_token"])
        if task.kind == "choice":
            result["acc_norm"] = _summary(per_example["acc_norm"])
        primary = result["acc_per_token"]
    scale = 1.0 - task.baseline
    result["centered"] = {"value": (primary["value"] - task.baseline) / scale,
                          "stderr": None if primary["stderr"] is None else primary["stderr"] / scale,
                          "of": "acc" if task.kind == "last_word" else "acc_per_token"}
    return result


def centered_mean(results: dict[str, dict]) -> float | None:
    """The mean centered accuracy over the tasks run (CORE-style; CORE itself is 22 tasks, some few-shot)."""
    values = [r["centered"]["value"] for r in results.values()]
    return sum(values) / len(values) if values else None
