"""The workloads' run directories in the call's scratch folder, and reading back what a training run wrote."""

from __future__ import annotations

import json
from pathlib import Path

from gpusession.records import REPO, Context, read_jsonl

PRESETS = {"gpt2-small": "runs/gpt2-small", "llama-1b": "runs/llama-3.2-1b"}  # workload: the repository's preset
# The micro-batch of GPT-2 small that throughput, find-batch's compiled trial, bf16-vs-fp32, profile and resume all
# use: one shape, so Inductor's on-disk cache compiles it once per call (a smoke run's tiny model: 2).
GPT2_MICRO = 32
SMOKE_MICRO = 2
# A tiny model of the Llama architecture (grouped-query attention included): the preflight's compiled step on a GPU,
# and the shape of every workload in a smoke run.
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64,
        "vocab_size": 1024}


def gpt2_micro(ctx: Context) -> int:
    return SMOKE_MICRO if ctx.smoke else GPT2_MICRO


def preset(ctx: Context, name: str) -> Path:
    """A run directory for `name` ("gpt2-small", "llama-1b", or "tiny") in the scratch folder: the repository's
    preset on a GPU, a tiny model of the same architecture in a smoke run (and for "tiny"); its data is the
    built-in corpus tokenized by the `data` step (a model vocabulary larger than the dataset's is fine). Never an
    in-loop evaluation: it would compile a graph of its own that no step budgets."""
    run = ctx.work / "runs" / name
    if (run / "model.json").exists():
        return run
    run.mkdir(parents=True)
    source = REPO / PRESETS["llama-1b" if name == "tiny" else name]
    model = json.loads((source / "model.json").read_text())
    train = json.loads((source / "train.json").read_text())
    if ctx.smoke or name == "tiny":
        llama = model["architecture"] == "llama"
        model.update(TINY, intermediate_size=64 if llama else 128, num_key_value_heads=1 if llama else 2)
        model.pop("head_dim", None)
    train.update(data=str(ctx.data), eval_interval=0, checkpoint_interval=10**6, log_interval=1)
    train.pop("_note", None)
    (run / "model.json").write_text(json.dumps(model, indent=2))
    (run / "train.json").write_text(json.dumps(train, indent=2))
    return run


def copy_run(ctx: Context, source: Path, name: str) -> Path:
    """A fresh run directory with `source`'s model.json and train.json (for runs that write checkpoints)."""
    run = ctx.work / "runs" / name
    run.mkdir(parents=True, exist_ok=True)
    for file in ("model.json", "train.json"):
        (run / file).write_text((source / file).read_text())
    return run


def seq_len(run: Path) -> int:
    train = json.loads((run / "train.json").read_text())
    return train.get("seq_len") or json.loads((run / "model.json").read_text())["max_position_embeddings"]


def settings_args(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def train_losses(run: Path) -> dict[int, float]:
    """Each logged step's training loss; after a resume, the resumed session's (the later line)."""
    return {int(r["step"]): float(r["loss"]) for r in read_jsonl(run / "metrics.jsonl")
            if r.get("kind") == "train" and r.get("loss") is not None}


def last_logged_step(run: Path) -> int:
    return max((int(r["step"]) for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"), default=0)
