"""The optimizer, chosen by train.json's `optimizer`; the LR is set per step from nanopt.train.optim.schedule.

adamw   AdamW on everything, weight decay on matrices and embeddings only.
muon    Muon (torch.optim.Muon: momentum, then Newton-Schulz orthogonalization of each update) on the hidden 2-D
        matrices (the attention and MLP projections of every block), AdamW on the embeddings, the output head,
        norms and biases, which Muon is not meant for. One MuonWithAdamW object steps both. Whole matrices (one
        process, DDP) are stepped by nanopt.train.optim.muon_step, torch's step batched by shape: a tenth of the
        launches.

Under FSDP2 each Muon matrix is a DTensor of which a rank holds some rows, and Muon must orthogonalize the whole
matrix: `sharded_muon_step` keeps momentum and weight updates on the local rows and gives each rank its share of
whole matrices to orthogonalize with torch's own Newton-Schulz function, as Dion's distributed Muon does (Moonlight's
gathers every matrix on every rank and orthogonalizes all of them there: world-size times the work).

Muon's settings follow modded-nanogpt and nanochat: LR 0.02 (`muon_learning_rate`) with torch's default
"original" adjust_lr_fn (the LR scaled by sqrt(max(1, rows/cols))), Nesterov momentum 0.95. Its decoupled weight
decay is set so that lr x weight_decay, the fraction by which a matrix shrinks per step, equals AdamW's: the
`weight_decay` key means the same shrinkage whichever optimizer is chosen.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from nanopt.config import TrainConfig
from nanopt.errors import ConfigError
from nanopt.train.optim.muon_step import batched_muon_step, batched_step_supported, indices_by_shape

MUON_MOMENTUM = 0.95


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's groups for all of `model` (the adamw optimizer)."""
    return decay_groups([p for p in model.parameters() if p.requires_grad], weight_decay)


def decay_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (dim >= 2); never biases or normalization gains (dim < 2)."""
    decay = [p for p in params if decays(p)]
    no_decay = [p for p in params if not decays(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def decays(param: torch.Tensor) -> bool:
    return param.dim() >= 2


def group_names(named: list[tuple[str, torch.Tensor]], optimizer: str) -> list[list[str]]:
    """The parameter names in each param group `build_optimizer` makes from `named`, in its order (AdamW's decay
    and no-decay groups, then Muon's hidden matrices): what a checkpoint's optimizer_param_groups must list."""
    matrices = [name for name, p in named if optimizer == "muon" and is_hidden_matrix(name, p)]
    rest = [(name, p) for name, p in named if name not in set(matrices)]
    adamw = [[name for name, p in rest if decays(p)], [name for name, p in rest if not decays(p)]]
    return adamw + ([matrices] if optimizer == "muon" else [])


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block (`layers.N.`): the parameters Muon updates. The embeddings and the
    output head are 2-D too but sit outside the blocks, and stay with AdamW."""
    return name.startswith("layers.") and param.dim() == 2


class MuonWithAdamW:
    """Muon for the hidden matrices and AdamW for the rest, used like one torch optimizer: step, zero_grad,
    param_groups (AdamW's first, so param_groups[0]["lr"] is the `learning_rate` schedule), state_dict.

    nanopt.train.parallel.wrap hands `optimizers` to torch.distributed.checkpoint, which merges both into one state
    keyed by parameter name, so checkpoints keep the "<parameter name>/<state name>" layout of AdamW runs.
    """

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Optimizer, muon_lr_scale: float,
                 sharded: bool = False) -> None:
        self.adamw = adamw
        self.muon = muon
        self.muon_lr_scale = muon_lr_scale  # muon_learning_rate / learning_rate: fixed by the config, never saved
        self.sharded = sharded  # the Muon matrices are FSDP2 shards: stepped by sharded_muon_step
        # Whole matrices: torch's step, batched by shape (nanopt.train.optim.muon_step), where this torch allows it.
        self.batched = not sharded and batched_step_supported(muon)

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return self.adamw, self.muon

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [*self.adamw.param_groups, *self.muon.param_groups]

    def step(self) -> None:
        self.adamw.step()
        if self.sharded:
            sharded_muon_step(self.muon)
        elif self.batched:
            batched_muon_step(self.muon)
        else:
            self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                    shard_states: bool = False) -> torch.optim.Optimizer | MuonWithAdamW:
    """The optimizer train.json names; `shard_states`: its state sharded across the ranks (ZeRO-1, AdamW only:
    nanopt.train.optim.zero)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if cfg.optimizer == "adamw" and shard_states:
        from nanopt.train.optim.zero import build_zero_adamw

        return build_zero_adamw(decay_groups([p for _, p in named], cfg.weight_decay), cfg.learning_rate,
                                (cfg.beta1, cfg.beta2), cfg.adam_eps, _fused([p for _, p in named]))
    if cfg.optimizer == "adamw":
        return _adamw([p for _, p in named], cfg, device)
    if cfg.optimizer == "adamw8bit":
        from nanopt.train.optim.lowbit import build_adamw8bit

        return build_adamw8bit(decay_groups([p for _, p in named], cfg.weight_decay), cfg.learning_rate,
                               (cfg.beta1, cfg.beta2), cfg.adam_eps)
    muon_class = getattr(torch.optim, "Muon", None)
    if muon_class is None:
        raise ConfigError(f"train.json: \"optimizer\": \"muon\" needs torch.optim.Muon, which torch "
                          f"{torch.__version__} does not have", "upgrade torch (2.9 or later), or use "
                          "\"optimizer\": \"adamw\"")
    matrices = [p for name, p in named if is_hidden_matrix(name, p)]
    rest = [p for name, p in named if not is_hidden_matrix(name, p)]
    muon = muon_class(matrices, lr=cfg.muon_learning_rate, momentum=MUON_MOMENTUM, nesterov=True,
                      weight_decay=cfg.weight_decay * cfg.learning_rate / cfg.muon_learning_rate)
    sharded = any(isinstance(p, DTensor) for p in matrices)
    if sharded:
        _check_row_sharded(matrices)
        _torch_newton_schulz(muon)  # fails here, before any training, on a torch whose Muon nanopt cannot reuse
    return MuonWithAdamW(_adamw(rest, cfg, device), muon, cfg.muon_learning_rate / cfg.learning_rate, sharded)


def _adamw(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; the fused CUDA kernel on GPUs (one launch for all parameters), foreach on the CPU (and for
    parameters FSDP2 offloads to host memory, which live there on a GPU machine too)."""
    fused = device.type == "cuda" and _fused(params)
    return torch.optim.AdamW(decay_groups(params, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=fused,
                             foreach=None if fused else True)


def _fused(params: list[torch.nn.Parameter]) -> bool:
    return bool(params) and all(p.device.type == "cuda" for p in params)


# ------------------------------------------------------------------------------------------ Muon under FSDP2


@torch.no_grad()
def sharded_muon_step(muon: torch.optim.Optimizer) -> None:
    """torch.optim.Muon's step for parameters sharded by rows (FSDP2's DTensors), with one process's results.

    torch's own step would orthogonalize each rank's rows as if they were the matrix (or, through DTensor, run
    collectives inside every Newton-Schulz iteration). Its per-parameter loop (torch.optim._muon
    ._single_tensor_muon: momentum, orthogonalization, weight decay, update) is therefore repeated here on the
    local rows, and only the orthogonalization, torch's own function, sees whole matrices (_orthogonalized_rows).
    The momentum buffers are torch's (`momentum_buffer`, sharded like the gradients), so checkpoints and
    torch.distributed.checkpoint's state dicts are those of any Muon run.
    """
    newton_schulz, adjust_lr = _torch_newton_schulz(muon)
    # The label torch's own Optimizer.step carries: nanopt profile counts everything inside it as the optimizer's.
    with torch.profiler.record_function(f"Optimizer.step#{type(muon).__name__}.step"):
        for group in muon.param_groups:
            _sharded_group_step(muon, group, newton_schulz, adjust_lr)


def _sharded_group_step(muon: torch.optim.Optimizer, group: dict[str, Any], newton_schulz: Callable,
                        adjust_lr: Callable) -> None:
    """One parameter group: torch's per-parameter loop, on the local rows, orthogonalizing whole matrices."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    muon._init_group(group, params, grads, buffers)  # creates missing momentum buffers as torch's step does
    updates = [_momentum_update(g.to_local(), b.to_local(), group) for g, b in zip(grads, buffers, strict=True)]
    orthogonalized = _orthogonalized_rows(params, updates, functools.partial(newton_schulz, group=group))
    lr, decay = group["lr"], group["weight_decay"]
    for param, update in zip(params, orthogonalized, strict=True):
        rows = param.to_local()  # the rank's rows of the fp32 weight, updated in place
        rows.mul_(1 - lr * decay)
        rows.add_(update, alpha=-adjust_lr(lr, group["adjust_lr_fn"], param.shape))  # the whole matrix's shape


def _momentum_update(grad: torch.Tensor, buffer: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """torch's Muon momentum, elementwise, so the local rows suffice: the buffer in place, then the update."""
    momentum = group["momentum"]
    buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(buffer, momentum) if group["nesterov"] else buffer


def _orthogonalized_rows(params: list[torch.Tensor], updates: list[torch.Tensor],
                         orthogonalize: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """This rank's rows of orthogonalize(whole update), for each parameter sharded by rows (`updates`: its rows).

    Matrices of one shape go in batches of one per rank: an all-to-all gives each rank one whole matrix, each rank
    orthogonalizes its own, a second all-to-all returns the rows. Every rank does 1/world of the Newton-Schulz work
    and receives about two matrices' worth of traffic per batch (gathering every matrix on every rank would be
    world times both), in bf16: torch's Newton-Schulz converts its input to bf16 first, so sending bf16 changes
    nothing. Every rank walks the same parameters in the same order, as collectives require.
    """
    results: list[torch.Tensor] = [torch.empty(0)] * len(params)
    world = params[0].device_mesh.size() if params else 1
    for indices in indices_by_shape(params).values():
        for start in range(0, len(indices), world):
            batch = indices[start:start + world]
            rows = _orthogonalize_one_per_rank(params[batch[0]], [updates[i] for i in batch], orthogonalize)
            for index, result in zip(batch, rows, strict=True):
                results[index] = result
    return results


def _orthogonalize_one_per_rank(like: torch.Tensor, updates: list[torch.Tensor],
                                orthogonalize: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Up to world rows-of-a-matrix updates of `like`'s shape in; this rank's rows of each orthogonalized out."""
    mesh = like.device_mesh
    world, me = mesh.size(), mesh.get_local_rank()
    rows, cols = like.shape
    local = [u.bfloat16() for u in updates]
    local += [torch.zeros_like(local[0])] * (world - len(local))  # a short batch: zeros, orthogonalized by nobody
    shape, stride = (world, rows, cols), (rows * cols, cols, 1)
    # [matrix, row, col] with rows sharded, as the parameters are -> matrices sharded: matrix `me` whole here.
    stacked = DTensor.from_local(torch.stack(local), mesh, [Shard(1)], run_check=False, shape=shape, stride=stride)
    mine = _resharded(stacked, 0).to_local()
    done = orthogonalize(mine[0]).unsqueeze(0).contiguous() if me < len(updates) else mine
    whole = DTensor.from_local(done, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return list(_resharded(whole, 1).to_local().unbind(0))[:len(updates)]


def _resharded(tensor: DTensor, dim: int) -> DTensor:
    """`tensor` sharded on `dim` instead: one all-to-all. Gloo has none, and DTensor's stand-in (an all-gather)
    logs a warning on every rank; on the CPU the all-gather is asked for by name (to Replicate; from there a
    shard is a local slice)."""
    mesh = tensor.device_mesh
    if mesh.device_type == "cpu":
        tensor = tensor.redistribute(mesh, [Replicate()])
    return tensor.redistribute(mesh, [Shard(dim)])


def _check_row_sharded(params: list[torch.Tensor]) -> None:
    """sharded_muon_step handles FSDP2's layout: every matrix sharded by rows over one 1-D mesh."""
    mesh = params[0].device_mesh
    for param in params:
        if not isinstance(param, DTensor) or param.device_mesh != mesh or mesh.ndim != 1 \
                or tuple(param.placements) != (Shard(0),):
            raise ValueError(f"Muon under FSDP expects every matrix sharded by rows over one 1-D device mesh, got "
                             f"{type(param).__name__} {getattr(param, 'placements', None)}")


def _torch_newton_schulz(muon: torch.optim.Optimizer) -> tuple[Callable, Callable]:
    """torch.optim.Muon's own Newton-Schulz orthogonalization, as f(matrix, param group), and LR adjustment.

    Both are private to torch (torch.optim._muon) and their arguments have changed between releases (torch 2.13's
    Newton-Schulz takes the matrix, ns_coefficients, ns_steps and eps; some releases add use_addmm): every argument
    after the matrix is the Muon setting of the same name, taken from the parameter group, and a torch whose
    function differs is refused when the optimizer is built, never mid-run.
    """
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
    except ImportError:
        _adjust_lr = _zeropower_via_newtonschulz = None
    settings = [] if _zeropower_via_newtonschulz is None else \
        list(inspect.signature(_zeropower_via_newtonschulz).parameters)[1:]
    if _adjust_lr is None or not set(settings) <= set(muon.defaults):
        raise ConfigError(f"train.json: \"optimizer\": \"muon\" with \"parallelism\": \"fsdp\" reuses "
                          f"torch.optim.Muon's Newton-Schulz function, which torch {torch.__version__} does not have "
                          f"in a form nanopt knows", "use \"parallelism\": \"ddp\" with muon, or torch 2.13")

    def newton_schulz(matrix: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        return _zeropower_via_newtonschulz(matrix, **{name: group[name] for name in settings})

    return newton_schulz, _adjust_lr


def set_lr(optimizer: torch.optim.Optimizer | MuonWithAdamW, lr: float) -> None:
    """Set the schedule's LR for this step; Muon's groups get their own base LR scaled by the same factor."""
    if isinstance(optimizer, MuonWithAdamW):
        _set_group_lr(optimizer.adamw, lr)
        _set_group_lr(optimizer.muon, lr * optimizer.muon_lr_scale)
    else:
        _set_group_lr(optimizer, lr)


def _set_group_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):  # torchao's 8-bit AdamW keeps it a tensor (its compiled step reads it)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def optimizers_of(optimizer: torch.optim.Optimizer | MuonWithAdamW) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizer`, as torch.distributed.checkpoint's state-dict functions take them."""
    return list(optimizer.optimizers) if isinstance(optimizer, MuonWithAdamW) else [optimizer]
