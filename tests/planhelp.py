"""DeepSeek LLM's published fits, recomputed from the model nanopt builds: what the planner's learning rate and
batch are checked against (tests/test_plan_budget.py, tests/test_plan_correction.py)."""

from __future__ import annotations

from pathlib import Path

from nanopt.config import load_run


# Bi et al. 2024 (arXiv:2401.02954), section 3.1, as the paper prints them.
def deepseek_lr(compute: float) -> float:
    return 0.3118 * compute ** -0.1250


def deepseek_batch(compute: float) -> float:
    return 0.2920 * compute ** 0.3271


def non_embedding_params(run_dir: Path) -> int:
    """Counted on the model nanopt builds (on the meta device: no memory), every parameter but the embeddings and
    an untied output head."""
    import torch

    from nanopt.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(load_run(run_dir).model)
    return sum(p.numel() for name, p in model.named_parameters()
               if not name.startswith(("embed_tokens", "embed_positions", "lm_head")))


def deepseek_compute(run_dir: Path) -> float:
    """C = M x D: M = 6 x non-embedding parameters + 6 x layers x width x seq_len (DeepSeek LLM, section 3.2)."""
    run = load_run(run_dir)
    m = 6 * non_embedding_params(run_dir) + 6 * run.model.num_hidden_layers * run.model.hidden_size * run.seq_len
    return m * run.total_tokens
