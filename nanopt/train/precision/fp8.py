"""FP8 training, train.json "fp8": "off" (default), "head" or "all".

"head": the output head's three GEMMs inside the chunked loss run in FP8 (torch._scaled_mm, nanopt.model.fp8): the
place a 768-wide model gains, where the [tokens, vocab] GEMMs are the largest of the step. "all": the head, and the
transformer blocks' linear layers through torchao's float8 training (tensorwise dynamic scaling), each layer only
where torchao's own H100 measurements say the FP8 GEMM and its casts beat bf16 (`converted_layers`).

What never changes: parameter names and dtypes (fp32 master weights), so a checkpoint resumes with FP8 on or off,
and export writes plain weights. Evaluation runs without gradients, and there the head and the converted layers
compute in bf16, as `nanopt eval`, `generate` and `export` do (they build a plain model).

Refused, in one line: on the CPU (FP8 there would only be emulated, slower than fp32: the emulation serves the
tests), on GPUs without FP8 tensor cores (before compute capability 8.9: Ada, Hopper), outside bf16, "all" without
torch.compile (unfused casts cost more than FP8 saves), without torchao 0.18+ (an install hint) or on torch
before 2.11 (torchao 0.18's floor).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.model.fp8 import SCALED_MM_ALIGN, head_fits_scaled_mm

FP8_CAPABILITY = (8, 9)  # torch._scaled_mm's FP8 GEMMs: Ada (8.9), Hopper (9.0) and newer
TORCHAO_MINIMUM = (0, 18)  # the version this code is written and tested against
TORCH_FOR_TORCHAO = (2, 11)  # torchao 0.18's own floor (older torch: it skips its kernels, and its ops branch on it)
TORCHAO_HINT = "pip install 'nanopt[fp8]' (torchao 0.18 or newer), or set \"fp8\": \"head\" (torch alone)"
# torchao's auto filter for tensorwise scaling, from its H100 benchmarks: a layer with K <= 4096 and N <= 1024 runs
# slower in FP8 than in bf16 (https://github.com/pytorch/ao/tree/main/torchao/float8#tensorwise-scaling).
SMALL_K, SMALL_N = 4096, 1024


def check_fp8(run: RunConfig, device: torch.device, precision: str, compiled: bool) -> None:
    """ConfigError, one line, when train.json's fp8 cannot run here; nothing for "off"."""
    mode = run.train.fp8
    if mode == "off":
        return
    where = f"{run.run_dir / 'train.json'}: key 'fp8': \"{mode}\""
    if device.type != "cuda":
        raise ConfigError(f"{where} needs a CUDA GPU with FP8 tensor cores; this run is on the {device.type}",
                          "set \"fp8\": \"off\" (on the CPU FP8 could only be emulated, slower than fp32)")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"{where} needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper or newer); "
                          f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}",
                          "set \"fp8\": \"off\"")
    if precision != "bf16":
        raise ConfigError(f"{where} needs \"precision\": \"bf16\" (the FP8 GEMMs write bf16), not {precision}",
                          "set \"precision\": \"bf16\" or \"auto\", or \"fp8\": \"off\"")
    rows = run.tokens_per_micro_batch
    if not head_fits_scaled_mm(rows, run.model.hidden_size, run.model.vocab_size):
        raise ConfigError(f"{where}: the head's FP8 GEMMs need micro_batch_size x seq_len ({rows}), hidden_size "
                          f"({run.model.hidden_size}) and vocab_size ({run.model.vocab_size}) multiples of "
                          f"{SCALED_MM_ALIGN}", "pad vocab_size to a multiple of 128, or set \"fp8\": \"off\"")
    if mode == "all":
        _check_torchao(where)
        if not compiled:
            raise ConfigError(f"{where} needs torch.compile (eager FP8 casts cost more than FP8 saves)",
                              "set \"compile\": true or \"auto\", or \"fp8\": \"head\"")


def _check_torchao(where: str) -> None:
    try:
        import torchao
    except ImportError:
        raise ConfigError(f"{where} needs torchao, which is not installed", TORCHAO_HINT) from None
    version = _version_tuple(getattr(torchao, "__version__", "0"))
    if version < TORCHAO_MINIMUM:
        raise ConfigError(f"{where} needs torchao {'.'.join(map(str, TORCHAO_MINIMUM))} or newer; this is "
                          f"{torchao.__version__}", TORCHAO_HINT)
    if _version_tuple(torch.__version__) < TORCH_FOR_TORCHAO:
        raise ConfigError(f"{where} needs torch {'.'.join(map(str, TORCH_FOR_TORCHAO))} or newer for torchao's "
                          f"float8 training; this is {torch.__version__}",
                          "upgrade torch (`make install`), or set \"fp8\": \"head\" (any supported torch)")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def converted_layers(model: torch.nn.Module) -> list[str]:
    """Names of the block linear layers "all" converts: dimensions multiples of 16 (the FP8 GEMM's), and not both
    K <= 4096 and N <= 1024 (torchao's measured break-even). The head is not among them: the loss does its GEMMs."""
    names = []
    for name, module in model.named_modules():
        if not (name.startswith("layers.") and isinstance(module, torch.nn.Linear)):
            continue
        out_features, in_features = module.weight.shape
        aligned = in_features % SCALED_MM_ALIGN == 0 and out_features % SCALED_MM_ALIGN == 0
        if aligned and not (in_features <= SMALL_K and out_features <= SMALL_N):
            names.append(name)
    return names


def fsdp_float8_all_gather(model: torch.nn.Module, names: list[str], world_size: int) -> bool:
    """FSDP2 gathers the converted weights in FP8 (half bf16's traffic) only when every one of them splits into
    equal shards along dim 0: an uneven shard would be padded, and torchao's FP8 all-gather does not take it."""
    weights = dict(model.named_modules())
    return world_size > 1 and all(weights[name].weight.shape[0] % world_size == 0 for name in names)


def apply_fp8(model: torch.nn.Module, mode: str, fsdp_world_size: int = 1) -> list[str]:
    """Turn train.json's fp8 on in a built model (before FSDP2 and compile), after check_fp8 accepted it; the names
    of the converted block layers. Parameter names are unchanged: torchao's Float8Linear keeps weight and bias."""
    if mode == "off":
        return []
    model.head_fp8 = "scaled_mm"
    if mode != "all":
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = converted_layers(model)
    chosen = set(names)
    gather_in_fp8 = fsdp_float8_all_gather(model, names, fsdp_world_size)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=gather_in_fp8)
    convert_to_float8_training(model, module_filter_fn=lambda _module, fqn: fqn in chosen, config=config)
    if gather_in_fp8:
        model.register_state_dict_post_hook(_plain_weights)
    modules = dict(model.named_modules())
    for name in names:
        layer = modules[name]
        layer.forward = functools.partial(_bf16_without_grad, layer, layer.forward)
    return names


def _plain_weights(_module: torch.nn.Module, state: dict[str, Any], _prefix: str, _metadata: Any) -> None:
    """For FSDP2's FP8 all-gather torchao wraps each converted weight in a tensor subclass that state dicts would
    carry (safetensors cannot write it, a plain model cannot load it): checkpoints get the fp32 tensor inside."""
    for key, value in state.items():
        state[key] = _unwrapped(value)


def _unwrapped(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        inner = getattr(local, "_tensor", None)
        if inner is None or type(local) is torch.Tensor:
            return value
        return DTensor.from_local(inner.detach(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    inner = getattr(value, "_tensor", None)
    return inner.detach() if inner is not None and type(value) is not torch.Tensor else value


def _bf16_without_grad(layer: Any, fp8_forward: Any, x: torch.Tensor) -> torch.Tensor:
    """Evaluation (no gradients) through a converted layer is a plain linear in the autocast dtype, as in a model
    that was never converted: validation losses stay comparable with FP8 on or off."""
    if torch.is_grad_enabled():
        return fp8_forward(x)
    return F.linear(x, layer.weight, layer.bias)

