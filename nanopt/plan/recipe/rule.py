"""The scaling rule a plan takes its learning rate and batch from: DeepSeek LLM's fits.

Bi et al. 2024, "DeepSeek LLM: Scaling Open-Source Language Models with Longtermism" (arXiv:2401.02954), section
3.1, fitted the near-optimal peak learning rate and global batch of their AdamW runs (betas 0.9 / 0.95, weight
decay 0.1, gradient clipping 1.0, a warmup then a multi-step decay) against compute, from 1e17 to 3e20 FLOPs:

    eta_opt = 0.3118 * C ** -0.1250        B_opt = 0.2920 * C ** 0.3271   (B in tokens)

with C = M * D: D the training tokens and M their "non-embedding FLOPs per token" (section 3.2),

    M = 72 * n_layer * d_model**2 + 6 * n_layer * d_model * l_seq

where 72 * n_layer * d_model**2 is 6 x the non-embedding parameters of their blocks (12 * d_model**2 per layer).
For another block shape (GQA, another MLP width) the same meaning is 6 x its own non-embedding parameters, which
is what `rule_flops_per_token` counts; the attention term is theirs. Pure arithmetic.
"""

from __future__ import annotations

from nanopt.config import ModelConfig
from nanopt.model.flops import count_params

SOURCE = ("DeepSeek LLM (Bi et al. 2024, arXiv:2401.02954, section 3.1): eta_opt = 0.3118 C^-0.1250, "
          "B_opt = 0.2920 C^0.3271 tokens, C = M D with M the non-embedding FLOPs per token")
LR_COEFFICIENT, LR_EXPONENT = 0.3118, -0.1250
BATCH_COEFFICIENT, BATCH_EXPONENT = 0.2920, 0.3271
# The compute the fits were made over: outside it the rule is extrapolated, and the plan says so.
FITTED_FROM, FITTED_TO = 1e17, 3e20


def rule_flops_per_token(model: ModelConfig, seq_len: int) -> int:
    """DeepSeek's M: 6 x the non-embedding parameters plus 6 x layers x width x sequence length."""
    return 6 * count_params(model).non_embedding + 6 * model.num_hidden_layers * model.hidden_size * seq_len


def rule_compute(model: ModelConfig, seq_len: int, tokens: float) -> float:
    """C = M x D, the compute the rule is a function of."""
    return rule_flops_per_token(model, seq_len) * tokens


def learning_rate(compute: float) -> float:
    return LR_COEFFICIENT * compute ** LR_EXPONENT


def batch_tokens(compute: float) -> float:
    return BATCH_COEFFICIENT * compute ** BATCH_EXPONENT


def extrapolated(compute: float) -> str | None:
    """A note when C lies outside the range the rule was fitted on, else None."""
    if FITTED_FROM <= compute <= FITTED_TO:
        return None
    side = "below" if compute < FITTED_FROM else "above"
    return (f"the rule's compute C = {compute:.3g} is {side} the {FITTED_FROM:.0e} to {FITTED_TO:.0e} FLOPs it was "
            "fitted on: its learning rate and batch are extrapolated")
