"""`nanopt export` on a trained run: transformers loads the directory and computes nanopt's logits.

Each `nanopt` command is a process of its own, forked from the warm launcher (tests/faulthelp.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from faulthelp import Launcher
from trainhelp import make_run

transformers = pytest.importorskip("transformers")


def test_export_of_a_trained_run_loads_in_transformers(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    from tokenizers import Tokenizer

    from nanopt.config import model_config_from_snapshot
    from nanopt.model.transformer import Transformer
    from nanopt.train.checkpoint import load_model_state, resolve

    run = make_run(tmp_path, tiny_dataset, max_steps=4, eval_interval=0, checkpoint_interval=4)
    launcher.train(run)
    out = tmp_path / "hf"
    result = launcher.run("export", run, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AutoModelForCausalLM.from_pretrained" in result.stdout and "config.json" in result.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "The model reads the next token near Kalomi street."
    ids = hf_tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == Tokenizer.from_file(str(tiny_dataset / "tokenizer.json")).encode(text).ids

    ckpt = resolve(run, "latest")
    model = Transformer(model_config_from_snapshot(ckpt.meta["config"]["model"]))
    model.load_state_dict(load_model_state(ckpt))
    with torch.no_grad():
        diff = (hf_model(ids).logits - model.eval()(ids)).abs().max().item()
    assert diff < 1e-4

    forced = launcher.run("export", run, "--out", out, "--force", "--json")  # replaces the export above
    assert forced.returncode == 0, forced.stderr[-3000:]
    summary = json.loads(forced.stdout)
    assert summary["step"] == 4 and summary["files"]["model.safetensors"] == (out / "model.safetensors").stat().st_size


def test_run_with_a_padded_vocab_trains_and_exports_the_tokenizers_vocab(tmp_path: Path, tiny_dataset: Path,
                                                                          launcher: Launcher):
    """The GPT-2 presets pad 50257 to 50304: a model vocab past the dataset's tokenizer trains, and the export
    has the tokenizer's vocab with nanopt's logits on those rows."""
    from faulthelp import TINY_MODEL

    from nanopt.config import load_run, model_config_from_snapshot
    from nanopt.model.transformer import Transformer
    from nanopt.train.checkpoint import load_model_state, resolve

    real_vocab = json.loads((tiny_dataset / "meta.json").read_text())["vocab_size"]
    padded = real_vocab + 128
    run = make_run(tmp_path, tiny_dataset, model={**TINY_MODEL, "vocab_size": padded}, micro_batch_size=2,
                   global_batch_tokens=32, max_steps=2, eval_interval=0, checkpoint_interval=2)
    launcher.train(run)
    out = tmp_path / "hf"
    result = launcher.run("export", run, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == real_vocab

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ckpt = resolve(run, "latest")
    model = Transformer(model_config_from_snapshot(ckpt.meta["config"]["model"]))
    assert model.cfg.vocab_size == padded
    model.load_state_dict(load_model_state(ckpt))
    ids = torch.randint(0, real_vocab, (1, 12))
    with torch.no_grad():
        hf_logits, ours = hf_model(ids).logits, model.eval()(ids)
    assert hf_logits.shape[-1] == real_vocab
    assert (hf_logits - ours[..., :real_vocab]).abs().max().item() < 1e-4

    # The padded rows are never a token: nanopt's test loss is transformers' loss of the export on the same tokens.
    evaluated = launcher.run("eval", run, "--tokens", "all", "--no-samples", "--json")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    ours = json.loads(evaluated.stdout)
    theirs = _transformers_test_loss(hf_model, tiny_dataset, seq_len=load_run(run).seq_len)
    assert ours["tokens"] == theirs[1]
    assert abs(ours["test_loss"] - theirs[0]) < 2e-6, (ours["test_loss"], theirs[0])


def _transformers_test_loss(hf_model, dataset: Path, seq_len: int) -> tuple[float, int]:
    """Mean cross-entropy of a transformers model over the whole test split, in the windows nanopt eval scores."""
    import torch.nn.functional as F

    from nanopt.data.dataset import TokenDataset
    from nanopt.data.loaders.loader import eval_batches

    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in eval_batches(TokenDataset.open(dataset), "test", seq_len, 4, 0, 1, None):
            logits = hf_model(inputs).logits.double()
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                     reduction="sum").item()
            tokens += int((targets != -100).sum())
    return total / tokens, tokens
