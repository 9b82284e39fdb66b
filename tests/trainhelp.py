"""Build tiny run directories on the test dataset and read back what `nanopt train` wrote."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HIDE_CUDA = {"CUDA_VISIBLE_DEVICES": ""}  # set in a child before it touches CUDA: it sees no GPU, as on a CPU host


def visible_gpus() -> int:
    """GPUs a child of this process may see (NVML's count: CUDA is not initialized here)."""
    import torch

    return torch.cuda.device_count()


def device_env(world_size: int = 1, gpu: bool = False, gpus: int | None = None) -> dict[str, str]:
    """The environment a test's command (or its `world_size` ranks) runs under: CUDA hidden, so the numbers are
    the CPU's, unless the test asks for the GPU (`gpu`) and the host has one per rank. On a 1-GPU host two ranks
    would ask for cuda:0 and cuda:1; hidden, they run on the CPU with gloo as on a machine without a GPU.
    `gpus`: the GPUs visible (default: this host's)."""
    if gpu and world_size <= (visible_gpus() if gpus is None else gpus):
        return {}
    return dict(HIDE_CUDA)


def world_size_of(argv: Sequence[str]) -> int:
    """The ranks a `nanopt` command starts on this host: its --nproc-per-node, else 1."""
    for i, arg in enumerate(argv):
        if arg == "--nproc-per-node" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--nproc-per-node="):
            return int(arg.split("=", 1)[1])
    return 1


def make_run(root: Path, dataset: Path, name: str = "run", model: dict | None = None, **train: Any) -> Path:
    """A tiny run directory. fp32 and no compile unless a test says otherwise: "auto" would mean bf16 and
    torch.compile wherever a test process sees a GPU, and these runs stand for CPU numbers."""
    vocab = json.loads((dataset / "meta.json").read_text())["vocab_size"]
    run = root / name
    run.mkdir(parents=True)
    model_cfg = {"architecture": "llama", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 32, **(model or {})}
    train_cfg = {"data": str(dataset), "micro_batch_size": 4, "global_batch_tokens": 4 * 32 * 2, "max_steps": 20,
                 "learning_rate": 3e-3, "warmup_steps": 3, "eval_interval": 5, "eval_tokens": 1024,
                 "checkpoint_interval": 10, "keep_checkpoints": 5, "log_interval": 1, "seed": 7,
                 "precision": "fp32", "compile": False, **train}
    (run / "model.json").write_text(json.dumps(model_cfg))
    (run / "train.json").write_text(json.dumps(train_cfg))
    return run


def assert_train_refused(cli_in_process: Any, monkeypatch: Any, run: Path, message: str) -> None:
    """`nanopt train RUN` in this process, on the CPU: refused in one line that says `message`, nothing written."""
    from clihelp import assert_user_error

    for name, value in HIDE_CUDA.items():
        monkeypatch.setenv(name, value)
    assert_user_error(cli_in_process("train", run, "--no-live"), message)
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


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


def write_tiny_checkpoint(run: Path, step: int) -> Path:
    """A real one-process checkpoint of a tiny llama (vocab 16, hidden 8, one layer) at `step`, every weight
    filled with `step`, written by nanopt.train.checkpoint.write_checkpoint with the fields nanopt.train.checkpoint.save
    gives it (config snapshot, RNG state, AdamW state and groups), without training: for tests of checkpoint
    discovery, ordering and damage that need many checkpoints fast."""
    import torch

    from nanopt.config import ModelConfig, TrainConfig
    from nanopt.model.transformer import Transformer
    from nanopt.rng import rng_state
    from nanopt.train import checkpoint as ckpt
    from nanopt.train.optim.optimizer import group_names

    cfg = ModelConfig(architecture="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, max_position_embeddings=8)
    train = TrainConfig(data="data", micro_batch_size=1, global_batch_tokens=8, max_steps=10**9)
    model = Transformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float(step))
    weights = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    named = list(model.named_parameters())
    state = {name: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p)} for name, p in named}
    groups = [{"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": decay, "params": names}
              for decay, names in zip((0.1, 0.0), group_names(named, "adamw"), strict=True)]
    meta = {"tokens": step * 10, "world_size": 1, "ranks": [{"loader": {}, "rng": rng_state()}],
            "tied": {"lm_head.weight": "embed_tokens.weight"},
            "config": {"model": cfg.to_dict(), "train": train.to_dict()}}
    return ckpt.write_checkpoint(run, step, weights, {"state": state, "param_groups": groups}, meta)
