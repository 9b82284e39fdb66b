"""`nanopt import` of the transformers models nanopt exports its model.json options to: Qwen2 (biases on q/k/v
only: qkv_bias) and Qwen3 (qk_norm). The imported run computes transformers' logits, and exports back to the same
class; a sliding window, which nanopt's attention lacks, is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from importhelp import perturbed, save

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5)


def qwen(kind: str, vocab: int, **overrides) -> torch.nn.Module:
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=vocab, tie_word_embeddings=False, **{**SHAPE, **overrides})
        return perturbed(transformers.Qwen2ForCausalLM(cfg))
    cfg = transformers.Qwen3Config(vocab_size=vocab, head_dim=8, tie_word_embeddings=True, **{**SHAPE, **overrides})
    return perturbed(transformers.Qwen3ForCausalLM(cfg))


@pytest.mark.parametrize(("kind", "options"), [("qwen2", {"qkv_bias": True, "attention_bias": False}),
                                               ("qwen3", {"qk_norm": True})])
def test_qwen_imports_with_its_option_and_exports_back(kind, options, tiny_dataset: Path, tmp_path):
    from nanopt.export.hf import export_hf
    from nanopt.importer.run import import_model
    from nanopt.model.transformer import Transformer
    from nanopt.train import checkpoint as ckpt

    vocab = json.loads((tiny_dataset / "meta.json").read_text())["vocab_size"]
    source = qwen(kind, vocab)
    directory = save(source, tmp_path / kind, tiny_dataset / "tokenizer.json")
    import_model(str(directory), tmp_path / "run")
    model_json = json.loads((tmp_path / "run" / "model.json").read_text())
    assert {key: model_json[key] for key in options} == options
    found = ckpt.verify(tmp_path / "run" / "checkpoints" / "step-000000")
    model = Transformer(found.model)
    missing, unexpected = model.load_state_dict(ckpt.load_model_state(found), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tokens = torch.randint(0, vocab, (2, 24))
    with torch.no_grad():
        expected = source(tokens).logits
        torch.testing.assert_close(model.eval()(tokens), expected, atol=1e-5, rtol=0)
    out = export_hf(found.model, ckpt.load_model_state(found), found.tokenizer_path, tmp_path / "export")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(again).__name__ == type(source).__name__
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, expected, atol=1e-5, rtol=0)


def test_a_sliding_window_is_refused(tiny_dataset: Path, tmp_path, cli_in_process):
    vocab = json.loads((tiny_dataset / "meta.json").read_text())["vocab_size"]
    directory = save(qwen("qwen2", vocab, use_sliding_window=True, sliding_window=8), tmp_path / "sliding",
                     tiny_dataset / "tokenizer.json")
    assert_user_error(cli_in_process("import", directory, "--run", tmp_path / "run"), "use_sliding_window")
    assert not (tmp_path / "run").exists()
