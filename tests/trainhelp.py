"""Build tiny run directories on the test dataset and read back what `nanopt train` wrote."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def make_run(root: Path, dataset: Path, name: str = "run", model: dict | None = None, **train: Any) -> Path:
    vocab = json.loads((dataset / "meta.json").read_text())["vocab_size"]
    run = root / name
    run.mkdir(parents=True)
    model_cfg = {"architecture": "llama", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 32, **(model or {})}
    train_cfg = {"data": str(dataset), "micro_batch_size": 4, "global_batch_tokens": 4 * 32 * 2, "max_steps": 20,
                 "learning_rate": 3e-3, "warmup_steps": 3, "eval_interval": 5, "eval_tokens": 1024,
                 "checkpoint_interval": 10, "keep_checkpoints": 5, "log_interval": 1, "seed": 7, **train}
    (run / "model.json").write_text(json.dumps(model_cfg))
    (run / "train.json").write_text(json.dumps(train_cfg))
    return run


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            out[record["step"]] = record["loss"]
    return out


def eval_losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in records if r["kind"] == "eval"}


def final_weights_hash(run: Path) -> str:
    """A hash of the weights `latest` holds, tensor by tensor in name order: the same for either checkpoint layout
    (one safetensors file, or shards written by several ranks)."""
    from nanopt.train.checkpoint import load_model_state, resolve

    digest = hashlib.sha256()
    for name, tensor in sorted(load_model_state(resolve(run, "latest")).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()
