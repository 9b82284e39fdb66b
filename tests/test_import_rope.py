"""Llama 3's RoPE scaling (Llama 3.1 / 3.2's `rope_scaling` with rope_type llama3): `nanopt import` of a tiny
random Llama that uses it computes transformers' logits, whichever spelling its config.json has (transformers 4's
`rope_scaling`, transformers 5's `rope_parameters`); `nanopt export` gives transformers the same model back; and a
model.json whose rope_scaling nanopt cannot compute is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from clihelp import REPO, assert_user_error
from importhelp import perturbed, save

transformers = pytest.importorskip("transformers")

# Small numbers for which every piece of the scaling matters: head_dim 16 at theta 1e4 has wavelengths from 6.3 to
# ~1e4 tokens; with an original context of 32 the shortest (< 32 / 4) stays, the next (19.9) is blended, the rest
# are stretched 4x. The tokens run to position 95, past the original context.
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
SEQ = 96


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_dataset: Path) -> tuple[Path, torch.nn.Module]:
    """A transformers Llama with llama3 RoPE scaling, saved by save_pretrained (transformers 5: rope_parameters)."""
    vocab = json.loads((tiny_dataset / "meta.json").read_text())["vocab_size"]
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope_scaling={**LLAMA3, "rope_theta": 10000.0})
    model = perturbed(transformers.LlamaForCausalLM(cfg))
    return save(model, tmp_path_factory.mktemp("hf") / "llama3", tiny_dataset / "tokenizer.json"), model


def _transformers4_spelling(directory: Path) -> None:
    """config.json as Llama-3.2-1B's on the hub has it: rope_theta and rope_scaling, no rope_parameters."""
    config = json.loads((directory / "config.json").read_text())
    parameters = config.pop("rope_parameters")
    config["rope_theta"] = parameters.pop("rope_theta")
    config["rope_scaling"] = parameters
    (directory / "config.json").write_text(json.dumps(config))


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _imported(run: Path) -> tuple[torch.nn.Module, object]:
    from nanopt.model.transformer import Transformer
    from nanopt.train import checkpoint as ckpt

    found = ckpt.verify(run / "checkpoints" / "step-000000")
    model = Transformer(found.model)
    missing, unexpected = model.load_state_dict(ckpt.load_model_state(found), strict=False)
    assert not unexpected and not missing
    return model.eval(), found


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_llama3_scaling_imports_with_transformers_logits(spelling, source, tmp_path, cli_in_process):
    from nanopt.model.transformer import Transformer

    directory = Path(shutil.copytree(source[0], tmp_path / "src"))
    if spelling == "rope_scaling":
        _transformers4_spelling(directory)
    assert spelling in json.loads((directory / "config.json").read_text())
    result = cli_in_process("import", directory, "--run", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "run" / "model.json").read_text())["rope_scaling"] == LLAMA3

    model, found = _imported(tmp_path / "run")
    tokens = _tokens(found.model.vocab_size)
    with torch.no_grad():
        expected = source[1](tokens).logits
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=0)
        # The comparison can tell: the same weights with plain RoPE compute other logits.
        plain = Transformer(dataclasses.replace(found.model, rope_scaling=None))
        plain.load_state_dict(model.state_dict())
        assert (plain.eval()(tokens) - expected).abs().max() > 1e-2


def test_export_gives_transformers_the_same_model(source, tmp_path, cli_in_process):
    assert cli_in_process("import", source[0], "--run", tmp_path / "run").returncode == 0
    result = cli_in_process("export", tmp_path / "run", "--out", tmp_path / "export")
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA3 and config["rope_parameters"] == {**LLAMA3, "rope_theta": 10000.0}

    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    tokens = _tokens(config["vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, source[1](tokens).logits, atol=1e-5, rtol=0)
    # The export, which spells the scaling both ways, imports again as the same model.
    assert cli_in_process("import", tmp_path / "export", "--run", tmp_path / "again").returncode == 0
    assert json.loads((tmp_path / "again" / "model.json").read_text())["rope_scaling"] == LLAMA3


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, "yarn"),
    ("rope_scaling", {"type": "linear", "factor": 4.0}, "linear"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, "dynamic"),
    ("rope_parameters", {**LLAMA3, "factor": 0, "rope_theta": 10000.0}, "'factor' must be a positive number"),
    ("rope_scaling", {**LLAMA3, "factor": 8.0}, "otherwise than key 'rope_parameters'"),
])
def test_other_rope_scaling_is_refused(key, value, fragment, source, tmp_path, cli_in_process):
    directory = Path(shutil.copytree(source[0], tmp_path / "src"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, key: value}))
    assert_user_error(cli_in_process("import", directory, "--run", tmp_path / "run"), f"key '{key}'", fragment)
    assert not (tmp_path / "run").exists()


MODEL_JSON_MISTAKES = [
    ({**LLAMA3, "rope_type": "yarn"}, "rope_type 'yarn' is not one nanopt computes"),
    ({**LLAMA3, "factor": 0}, "'factor' must be a positive number, got 0"),
    ({**LLAMA3, "high_freq_factor": -4.0}, "'high_freq_factor' must be a positive number"),
    ({**LLAMA3, "low_freq_factor": "1"}, "'low_freq_factor' must be a positive number"),
    ({**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "'low_freq_factor' 4.0 must be below"),
    ({**LLAMA3, "low_freq_factor": 4.0}, "must be below 'high_freq_factor' 4.0"),
    ({**LLAMA3, "original_max_position_embeddings": 8192.5}, "'original_max_position_embeddings' must be a positive"),
    ({**LLAMA3, "attention_factor": 1.0}, "unknown key 'attention_factor'"),
    ({key: value for key, value in LLAMA3.items() if key != "factor"}, "missing 'factor'"),
    (32.0, "32.0 is not a JSON object or null"),
]


@pytest.mark.parametrize(("value", "fragment"), MODEL_JSON_MISTAKES)
def test_bad_rope_scaling_in_model_json_is_one_line(value, fragment, tmp_path, cli_in_process):
    run = Path(shutil.copytree(REPO / "runs" / "llama-3.2-1b", tmp_path / "run"))
    model = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**model, "rope_scaling": value}))
    assert_user_error(cli_in_process("estimate", run), "model.json", "key 'rope_scaling'", fragment)


def test_gpt2_has_no_rope_to_scale(tmp_path, cli_in_process):
    run = Path(shutil.copytree(REPO / "runs" / "gpt2-small", tmp_path / "run"))
    model = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**model, "rope_scaling": LLAMA3}))
    assert_user_error(cli_in_process("estimate", run), "key 'rope_scaling'", "no RoPE to scale")


def test_scaling_changes_no_estimate(tmp_path, cli_in_process):
    """RoPE scaling changes no shape: the parameter count, FLOPs and memory estimate stay the same."""
    run = Path(shutil.copytree(REPO / "runs" / "llama-3.2-1b", tmp_path / "run"))
    plain = cli_in_process("estimate", run, "--json")
    model = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**model, "rope_scaling": {**LLAMA3, "factor": 32.0,
                                                                          "original_max_position_embeddings": 8192}}))
    scaled = cli_in_process("estimate", run, "--json")
    assert plain.returncode == scaled.returncode == 0, scaled.stderr
    assert json.loads(scaled.stdout) == json.loads(plain.stdout)
