"""config.json -> model.json: GPT-2 (GPT2LMHeadModel) and the Llama family (LlamaForCausalLM: Llama, SmolLM, ...;
Qwen2ForCausalLM: biases on q/k/v only, model.json's qkv_bias; Qwen3ForCausalLM: qk_norm), without sliding windows.

Only a model nanopt computes exactly as transformers does is imported: every config.json key that changes the
computation is either mapped, checked to be the value nanopt's model assumes, or refused in one line that names
it (RoPE scaling other than Llama 3's, a head size that is not hidden / heads, another activation, sliding windows,
...). Keys that do not change the logits (token ids, dtypes, dropout probabilities, cache flags) are ignored. An
unknown key whose value is null, false or 0 changes nothing either; any other unknown key is refused, because
transformers may compute with it. Llama 3.1 / 3.2's llama3 RoPE scaling becomes model.json's `rope_scaling`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.config import ModelConfig
from nanopt.config.rope_scaling import check_rope_scaling
from nanopt.errors import ConfigError
from nanopt.parsing import show_value

# Keys with no effect on the logits of a causal LM (or that nanopt reads elsewhere: the tokenizer's EOS).
_IGNORED = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "output_attentions",
    "output_hidden_states", "return_dict", "tokenizer_class", "task_specific_params", "summary_type",
    "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout", "n_ctx",
    "resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "pretraining_tp", "id2label", "label2id",
    "is_llama_config", "reorder_and_upcast_attn", "max_length", "min_length",
    "do_sample", "temperature", "top_k", "top_p", "num_beams", "use_return_dict",
}
HINT = "nanopt imports GPT-2 and Llama-shaped models that its own model computes exactly"


def model_config_from_hf(config: Any, source: Path) -> ModelConfig:
    """The ModelConfig of a transformers config.json (already parsed), or ConfigError naming the key nanopt cannot
    represent."""
    where = f"{source}"
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: holds a JSON {type(config).__name__}, not an object", HINT)
    kind = config.get("model_type")
    if kind == "gpt2":
        fields, used = _gpt2(config, where)
    elif kind in ("llama", "qwen2", "qwen3"):
        fields, used = _llama(config, where)
        if kind != "llama":
            used |= _qwen(config, where, kind, fields)
    else:
        raise ConfigError(f"{where}: key 'model_type': {show_value(kind)} is not one nanopt imports",
                          f"{HINT}: model_type \"gpt2\", \"llama\", \"qwen2\" or \"qwen3\"")
    for key, value in config.items():
        if key not in used and key not in _IGNORED and value not in (None, False, 0, [], {}):
            raise ConfigError(f"{where}: key '{key}': {show_value(value)} is a setting nanopt's {kind} model does "
                              "not have", HINT)
    fields["initializer_range"] = _number(config, "initializer_range", where, 0.02)
    try:
        cfg = ModelConfig(**fields)
        cfg.validate(where)
    except TypeError as exc:  # a wrong JSON type in a mapped key
        raise ConfigError(f"{where}: {exc}", HINT) from None
    return cfg


def _gpt2(config: dict[str, Any], where: str) -> tuple[dict[str, Any], set[str]]:
    _require(config, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), where, "gelu_new")
    _require(config, "scale_attn_weights", (True,), where, True)
    _require(config, "scale_attn_by_inverse_layer_idx", (False,), where, False)
    _require(config, "add_cross_attention", (False,), where, False)
    hidden = _integer(config, "n_embd", where)
    fields = {
        "architecture": "gpt2", "vocab_size": _integer(config, "vocab_size", where),
        "hidden_size": hidden, "num_hidden_layers": _integer(config, "n_layer", where),
        "num_attention_heads": _integer(config, "n_head", where),
        "max_position_embeddings": _integer(config, "n_positions", where),
        "intermediate_size": _integer(config, "n_inner", where, 4 * hidden),
        "layer_norm_eps": _number(config, "layer_norm_epsilon", where, 1e-5),
        "tie_word_embeddings": _flag(config, "tie_word_embeddings", where, True),
        "attention_bias": True, "mlp_bias": True, "dropout": 0.0,
    }
    used = {"activation_function", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention",
            "n_embd", "vocab_size", "n_layer", "n_head", "n_positions", "n_inner", "layer_norm_epsilon",
            "tie_word_embeddings"}
    return fields, used


def _llama(config: dict[str, Any], where: str) -> tuple[dict[str, Any], set[str]]:
    _require(config, "hidden_act", ("silu",), where, "silu")
    theta, scaling = _rope(config, where)
    hidden, heads = _integer(config, "hidden_size", where), _integer(config, "num_attention_heads", where)
    head_dim = config.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim * heads != hidden):
        raise ConfigError(f"{where}: key 'head_dim': {show_value(head_dim)} is not hidden_size / num_attention_heads "
                          f"({hidden} / {heads}), the only head size nanopt's model has", HINT)
    fields = {
        "architecture": "llama", "vocab_size": _integer(config, "vocab_size", where), "hidden_size": hidden,
        "intermediate_size": _integer(config, "intermediate_size", where),
        "num_hidden_layers": _integer(config, "num_hidden_layers", where), "num_attention_heads": heads,
        "num_key_value_heads": _integer(config, "num_key_value_heads", where, heads),
        "max_position_embeddings": _integer(config, "max_position_embeddings", where),
        "rope_theta": theta, "rope_scaling": scaling, "rms_norm_eps": _number(config, "rms_norm_eps", where, 1e-6),
        "tie_word_embeddings": _flag(config, "tie_word_embeddings", where, False),
        "attention_bias": _flag(config, "attention_bias", where, False),
        "mlp_bias": _flag(config, "mlp_bias", where, False), "dropout": 0.0,
    }
    used = {"hidden_act", "rope_scaling", "rope_theta", "rope_parameters", "hidden_size", "num_attention_heads",
            "head_dim", "vocab_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias"}
    return fields, used


def _rope(config: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and model.json's rope_scaling (None: plain RoPE). transformers 4 spells a scaling `rope_scaling`,
    transformers 5 `rope_parameters` (with rope_theta inside); nanopt's export writes both, alike."""
    theta = _number(config, "rope_theta", where, 10000.0)
    scaled = {}
    if config.get("rope_scaling") is not None:
        scaled["rope_scaling"] = _llama3(config["rope_scaling"], f"{where}: key 'rope_scaling'")
    parameters = config.get("rope_parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise ConfigError(f"{where}: key 'rope_parameters': {show_value(parameters, 80)} is not a JSON object",
                              HINT)
        theta = _number(parameters, "rope_theta", where, theta)
        rest = {key: value for key, value in parameters.items() if key != "rope_theta"}
        if rest.get("rope_type", "default") != "default" or set(rest) - {"rope_type"}:
            scaled["rope_parameters"] = _llama3(rest, f"{where}: key 'rope_parameters'")
    if len(scaled) == 2 and scaled["rope_scaling"] != scaled["rope_parameters"]:
        raise ConfigError(f"{where}: key 'rope_scaling': {show_value(config['rope_scaling'], 80)} scales RoPE "
                          f"otherwise than key 'rope_parameters': {show_value(parameters, 80)}",
                          "keep the one transformers should read, or make them agree")
    return theta, next(iter(scaled.values()), None)


def _llama3(scaling: Any, where: str) -> dict[str, Any]:
    """A config.json's RoPE scaling as model.json's rope_scaling, or ConfigError: llama3 is the only type nanopt's
    model computes (older configs name the type `type`)."""
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: {show_value(scaling, 80)} is not a JSON object", HINT)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ConfigError(f"{where}: {show_value(scaling, 80)}: nanopt's RoPE computes the default type and llama3 "
                          "scaling only, so positions would be encoded differently", HINT)
    converted = {"rope_type": kind, **{key: value for key, value in scaling.items()
                                       if key not in ("rope_type", "type")}}
    check_rope_scaling(converted, "llama", where)
    return converted


def _qwen(config: dict[str, Any], where: str, kind: str, fields: dict[str, Any]) -> set[str]:
    """Qwen2's built-in q/k/v biases, or Qwen3's qk-norm, on top of the Llama fields; full attention only (the
    window keys mean nothing while use_sliding_window is false). Returns the keys read."""
    _require(config, "use_sliding_window", (False,), where, False)
    layer_types = config.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(kind != "full_attention" for kind in layer_types)):
        raise ConfigError(f"{where}: key 'layer_types': {show_value(layer_types, 80)}: nanopt's attention is full "
                          "attention in every layer", HINT)
    if kind == "qwen2":  # Qwen2's q/k/v projections always have biases, its o_proj and MLP never
        fields.update(qkv_bias=True, attention_bias=False, mlp_bias=False)
    else:
        fields.update(qk_norm=True, mlp_bias=False)
    return {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


def _require(config: dict[str, Any], key: str, allowed: tuple[Any, ...], where: str, default: Any) -> None:
    value = config.get(key, default)
    if not any(value == ok and type(value) is type(ok) for ok in allowed):
        raise ConfigError(f"{where}: key '{key}': {show_value(value)}, nanopt's model computes only "
                          f"{' or '.join(show_value(ok) for ok in allowed)}", HINT)


def _integer(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None and default is None:
        raise ConfigError(f"{where}: key '{key}' is missing", HINT)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: key '{key}': {show_value(value)} is not a positive integer", HINT)
    return value


def _number(config: dict[str, Any], key: str, where: str, default: float) -> float:
    value = config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ConfigError(f"{where}: key '{key}': {show_value(value)} is not a positive number", HINT)
    return float(value)


def _flag(config: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: key '{key}': {show_value(value)} is not true or false", HINT)
    return value
