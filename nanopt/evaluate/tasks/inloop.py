"""The hook that scores train.json's downstream_tasks during training (nanopt.train.downstream calls it at each
in-loop evaluation). Records are loaded and tokenized once, at the first evaluation; a task that cannot be
loaded is dropped with a warning, on every rank alike. Every batch has the training shape's width (seq_len),
so a compiled model meets one more shape at most, once, never a new one per evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nanopt.errors import ConfigError, DataError
from nanopt.evaluate.tasks.catalog import TASKS, parse_tasks
from nanopt.evaluate.tasks.downstream import TaskOptions, load_examples
from nanopt.evaluate.tasks.metrics import centered_mean, task_metrics
from nanopt.evaluate.tasks.scorer import Request, encode_pairs, score_requests
from nanopt.runtime import Runtime


class InLoopTasks:
    def __init__(self, opts: TaskOptions) -> None:
        self.opts = opts
        self.loaded: dict[str, tuple[list, list[Request]]] | None = None

    @classmethod
    def from_run(cls, train: Any, run_dir: Path) -> InLoopTasks | None:
        """The hook for a TrainConfig's downstream keys (None when off); a misspelt task name is a ConfigError."""
        if not train.downstream_tasks:
            return None
        names = parse_tasks(train.downstream_tasks, "train.json: key 'downstream_tasks'", ConfigError)
        data = train.downstream_task_data
        return cls(TaskOptions(names=names, limit=train.downstream_examples,
                               task_data=None if data is None else run_dir / data))

    def _load(self, rt: Runtime, dataset: Any, seq_len: int) -> list[str]:
        warnings, self.loaded = [], {}
        tokenizer = dataset.tokenizer()
        for name in self.opts.names:
            try:
                examples, _ = load_examples(rt, name, self.opts)
            except DataError as exc:  # every rank gets the same error: every rank drops the task
                warnings.append(f"downstream task {name} is off for this session: {exc.one_line()}")
                continue
            pairs = [pair for example in examples for pair in example.pairs]
            self.loaded[name] = (examples, encode_pairs(tokenizer, pairs, dataset.eos_id, seq_len))
        return warnings

    def __call__(self, model: torch.nn.Module, rt: Runtime, dataset: Any, micro_batch_size: int,
                 seq_len: int) -> tuple[dict[str, float], list[str]]:
        warnings = self._load(rt, dataset, seq_len) if self.loaded is None else []
        assert self.loaded is not None
        results = {}
        for name, (examples, requests) in self.loaded.items():
            scores = score_requests(model, rt, requests, micro_batch_size, seq_len, width=seq_len)
            results[name] = task_metrics(TASKS[name], examples, scores)
        flat = {}
        for name, r in results.items():
            for metric in ("acc", "acc_norm", "acc_per_token", "centered"):
                if metric in r:
                    flat[f"task_{name}_{metric}"] = r[metric]["value"]
            if "perplexity" in r:
                flat[f"task_{name}_perplexity"] = r["perplexity"]
        if results:
            flat["task_centered_mean"] = centered_mean(results)
        return flat, warnings
