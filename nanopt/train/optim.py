"""The optimizer, chosen by train.json's `optimizer`; the LR is set per step from nanopt.train.schedule.

adamw   AdamW on everything, weight decay on matrices and embeddings only.
muon    Muon (torch.optim.Muon: momentum, then Newton-Schulz orthogonalization of each update) on the hidden 2-D
        matrices (the attention and MLP projections of every block), AdamW on the embeddings, the output head,
        norms and biases, which Muon is not meant for. One MuonWithAdamW object steps both.

Muon's settings follow modded-nanogpt and nanochat: LR 0.02 (`muon_learning_rate`) with torch's default
"original" adjust_lr_fn (the LR scaled by sqrt(max(1, rows/cols))), Nesterov momentum 0.95. Its decoupled weight
decay is set so that lr x weight_decay, the fraction by which a matrix shrinks per step, equals AdamW's: the
`weight_decay` key means the same shrinkage whichever optimizer is chosen.
"""

from __future__ import annotations

from typing import Any

import torch

from nanopt.config import TrainConfig
from nanopt.errors import ConfigError

MUON_MOMENTUM = 0.95


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's groups for all of `model` (the adamw optimizer)."""
    return decay_groups([p for p in model.parameters() if p.requires_grad], weight_decay)


def decay_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (dim >= 2); never biases or normalization gains (dim < 2)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block (`layers.N.`): the parameters Muon updates. The embeddings and the
    output head are 2-D too but sit outside the blocks, and stay with AdamW."""
    return name.startswith("layers.") and param.dim() == 2


class MuonWithAdamW:
    """Muon for the hidden matrices and AdamW for the rest, used like one torch optimizer: step, zero_grad,
    param_groups (AdamW's first, so param_groups[0]["lr"] is the `learning_rate` schedule), state_dict.

    nanopt.train.parallel hands `optimizers` to torch.distributed.checkpoint, which merges both into one state
    keyed by parameter name, so checkpoints keep the "<parameter name>/<state name>" layout of AdamW runs.
    """

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Optimizer, muon_lr_scale: float) -> None:
        self.adamw = adamw
        self.muon = muon
        self.muon_lr_scale = muon_lr_scale  # muon_learning_rate / learning_rate: fixed by the config, never saved

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return self.adamw, self.muon

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [*self.adamw.param_groups, *self.muon.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig,
                    device: torch.device) -> torch.optim.AdamW | MuonWithAdamW:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return _adamw([p for _, p in named], cfg, device)
    muon_class = getattr(torch.optim, "Muon", None)
    if muon_class is None:
        raise ConfigError(f"train.json: \"optimizer\": \"muon\" needs torch.optim.Muon, which torch "
                          f"{torch.__version__} does not have", "upgrade torch (2.9 or later), or use "
                          "\"optimizer\": \"adamw\"")
    matrices = [p for name, p in named if is_hidden_matrix(name, p)]
    rest = [p for name, p in named if not is_hidden_matrix(name, p)]
    muon = muon_class(matrices, lr=cfg.muon_learning_rate, momentum=MUON_MOMENTUM, nesterov=True,
                      weight_decay=cfg.weight_decay * cfg.learning_rate / cfg.muon_learning_rate)
    return MuonWithAdamW(_adamw(rest, cfg, device), muon, cfg.muon_learning_rate / cfg.learning_rate)


def _adamw(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; the fused CUDA kernel on GPUs (one launch for all parameters), foreach on the CPU."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(decay_groups(params, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=fused,
                             foreach=None if fused else True)


def set_lr(optimizer: torch.optim.Optimizer | MuonWithAdamW, lr: float) -> None:
    """Set the schedule's LR for this step; Muon's groups get their own base LR scaled by the same factor."""
    if isinstance(optimizer, MuonWithAdamW):
        _set_group_lr(optimizer.adamw, lr)
        _set_group_lr(optimizer.muon, lr * optimizer.muon_lr_scale)
    else:
        _set_group_lr(optimizer, lr)


def _set_group_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizers_of(optimizer: torch.optim.Optimizer | MuonWithAdamW) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizer`, as torch.distributed.checkpoint's state-dict functions take them."""
    return list(optimizer.optimizers) if isinstance(optimizer, MuonWithAdamW) else [optimizer]
