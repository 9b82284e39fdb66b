"""`nanopt import`: transformers checkpoints written here with random weights (GPT-2, Llama with GQA, tied and
untied, one sharded with an index) become runs whose logits are transformers' own, whose export gives them back,
whose tokenizer is the source's, and that `nanopt train` continues from. What nanopt cannot represent exactly, and
pickle weights, are refused in one line, and a failed import leaves no run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error, run_cli
from importhelp import gpt2, llama, save
from safetensorshelp import append_tensor, rewrite
from trainhelp import losses

transformers = pytest.importorskip("transformers")

TEXT = "the model reads every layer of this corpus, and the optimizer learns"


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_dataset: Path) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Four transformers directories with the tiny dataset's tokenizer (512 tokens)."""
    root, tokenizer = tmp_path_factory.mktemp("hf"), tiny_dataset / "tokenizer.json"
    vocab = json.loads((tiny_dataset / "meta.json").read_text())["vocab_size"]
    models = {"gpt2": gpt2(vocab), "llama-tied": llama(vocab, True), "llama-untied": llama(vocab, False),
              "llama-sharded": llama(vocab, False)}
    found = {}
    for name, model in models.items():
        extra = {"max_shard_size": "40KB"} if name == "llama-sharded" else {}
        found[name] = (save(model, root / name, tokenizer, **extra), model)
    assert (root / "llama-sharded" / "model.safetensors.index.json").is_file()
    return found


@pytest.fixture(scope="module")
def imported(sources, tmp_path_factory) -> dict[str, Path]:
    from nanopt.importer.run import import_model

    root = tmp_path_factory.mktemp("runs")
    return {name: import_model(str(directory), root / name) and root / name
            for name, (directory, _) in sources.items()}


def _nanopt_logits(run: Path, tokens: torch.Tensor) -> torch.Tensor:
    from nanopt.model.transformer import Transformer
    from nanopt.train import checkpoint as ckpt

    found = ckpt.verify(run / "checkpoints" / "step-000000")
    model = Transformer(found.model)
    missing, unexpected = model.load_state_dict(ckpt.load_model_state(found), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        return model.eval()(tokens)


def _tokens(tiny_dataset: Path) -> torch.Tensor:
    from tokenizers import Tokenizer

    return torch.tensor([Tokenizer.from_file(str(tiny_dataset / "tokenizer.json")).encode(TEXT).ids[:24]])


@pytest.mark.parametrize("name", ["gpt2", "llama-tied", "llama-untied", "llama-sharded"])
def test_logits_equal_transformers_and_survive_export(name, sources, imported, tiny_dataset, tmp_path):
    from nanopt.export.hf import export_hf
    from nanopt.train import checkpoint as ckpt

    tokens = _tokens(tiny_dataset)
    source_model = sources[name][1]
    with torch.no_grad():
        expected = source_model(tokens).logits
    ours = _nanopt_logits(imported[name], tokens)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)

    found = ckpt.verify(imported[name] / "checkpoints" / "step-000000")
    out = export_hf(found.model, ckpt.load_model_state(found), found.tokenizer_path, tmp_path / "export")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, expected, atol=1e-5, rtol=0)


def test_run_directory_contents(imported, sources, tiny_dataset):
    from tokenizers import Tokenizer

    from nanopt.config import load_run

    run = imported["llama-tied"]
    meta = json.loads((run / "checkpoints" / "step-000000" / "meta.json").read_text())
    assert meta["weights_only"] is True and meta["step"] == 0 and "optimizer_param_groups" not in meta
    assert set(meta["files"]) == {"model.safetensors", "tokenizer.json"}
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000000"
    train = json.loads((run / "train.json").read_text())
    assert train["learning_rate"] < 6e-4 and train["warmup_steps"] <= 100 and "SET ME" in train["data"]
    assert load_run(run).model.vocab_size == 512  # not padded
    # The carried tokenizer encodes as the source's does (transformers' fast tokenizer over the source's file).
    source_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(sources["llama-tied"][0] / "tokenizer.json"))
    carried = Tokenizer.from_file(str(run / "checkpoints" / "step-000000" / "tokenizer.json"))
    assert carried.encode(TEXT).ids == source_tok(TEXT)["input_ids"]
    assert not [p for p in run.parent.iterdir() if p.name.startswith(".")]  # no staging directory left


def test_cli_reports_what_it_did(sources, tmp_path, cli_in_process):
    result = cli_in_process("import", sources["gpt2"][0], "--run", tmp_path / "g", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["architecture"] == "gpt2" and report["source_dtypes"] == ["F32"]
    assert report["parameters"] == sum(p.numel() for p in sources["gpt2"][1].parameters())
    assert report["vocab_size"] == report["tokenizer_vocab_size"] == 512
    assert_user_error(cli_in_process("import", sources["gpt2"][0], "--run", tmp_path / "g"), "already exists")
    # The run directory also goes by the name every other command that writes one uses.
    for name in ("--out", "-o"):
        assert cli_in_process("import", sources["gpt2"][0], name, tmp_path / name).returncode == 0
        assert (tmp_path / name / "model.json").is_file()


def _copy_source(sources, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sources[name][0], tmp_path / f"src-{name}"))


@pytest.mark.parametrize(("key", "value"), [
    ("rope_scaling", {"rope_type": "yarn", "factor": 8.0}), ("hidden_act", "gelu"), ("head_dim", 16),
    ("sliding_window", 16),
])
def test_config_nanopt_cannot_represent_is_refused(key, value, sources, tmp_path, cli_in_process):
    source = _copy_source(sources, "llama-tied", tmp_path)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, key: value}))
    assert_user_error(cli_in_process("import", source, "--run", tmp_path / "r"), f"key '{key}'")
    assert not (tmp_path / "r").exists()


def test_pickle_weights_are_refused(sources, tmp_path, cli_in_process):
    source = _copy_source(sources, "gpt2", tmp_path)
    (source / "model.safetensors").unlink()
    (source / "pytorch_model.bin").write_bytes(b"not read: unpickling runs code")
    assert_user_error(cli_in_process("import", source, "--run", tmp_path / "r"), "pytorch_model.bin", "pickle")
    assert not (tmp_path / "r").exists()


def test_corrupt_shard_leaves_no_run(sources, tmp_path, cli_in_process):
    source = _copy_source(sources, "llama-sharded", tmp_path)
    last = sorted(source.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-100])  # truncated: the header promises bytes the file does not have
    assert_user_error(cli_in_process("import", source, "--run", tmp_path / "r"), last.name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]  # no run, no staging directory


def _overlap_last_tensor(header: dict, data: bytearray) -> None:
    """The file's last tensor moved back one element, into its neighbour's bytes; the file ends where it now does."""
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    header[name]["data_offsets"] = [offset - 4 for offset in header[name]["data_offsets"]]
    del data[-4:]


# Headers the importer once read as good, whose tensors still lie inside the file at their stated size: bytes two
# tensors share, bytes no tensor owns, metadata that is not text, and a buffer nanopt skips (GPT-2's attention
# mask) in a dtype nanopt does not read or of the wrong size; and a dtype that is not a string (once a traceback).
SOURCE_HEADERS = {
    "overlapping_tensors": (_overlap_last_tensor, "overlaps"),
    "bytes_after_the_last_tensor": (lambda header, data: data.extend(bytes(8)), "8 bytes after its last tensor"),
    "metadata_not_strings": (lambda header, data: header.update(__metadata__={"format": 1}),
                             "__metadata__ is {'format': 1}, not a map of strings"),
    "buffer_dtype_nanopt_does_not_read": (append_tensor("transformer.h.0.attn.bias", "F8_E4M3", [2], 2),
                                          "has dtype 'F8_E4M3'"),
    "integer_buffer_of_the_wrong_size": (append_tensor("transformer.h.0.attn.bias", "I64", [4], 8),
                                         "is I64 (4,), but 8 bytes are stored for it"),
    "dtype_a_list": (lambda header, data: header["transformer.wte.weight"].update(dtype=[]), "has dtype '[]'"),
}


@pytest.mark.parametrize("damage", list(SOURCE_HEADERS))
def test_a_crafted_header_is_refused_before_anything_is_written(damage, sources, tmp_path, cli_in_process):
    edit, fragment = SOURCE_HEADERS[damage]
    source = _copy_source(sources, "gpt2", tmp_path)
    rewrite(source / "model.safetensors", edit)
    assert_user_error(cli_in_process("import", source, "--run", tmp_path / "r"), "model.safetensors", fragment)
    assert not (tmp_path / "r").exists()


def test_continued_pretraining_lowers_the_loss(sources, tiny_dataset, tmp_path, cli_in_process):
    run = tmp_path / "cpt"
    assert cli_in_process("import", sources["llama-untied"][0], "--run", run).returncode == 0
    sets = ["--set", f"data={tiny_dataset}", "--set", "micro_batch_size=4", "--set", "seq_len=32",
            "--set", "global_batch_tokens=128", "--set", "max_steps=8", "--set", "warmup_steps=1",
            "--set", "learning_rate=3e-3", "--set", "eval_interval=0", "--set", "log_interval=1",
            "--set", "precision=fp32", "--set", "compile=false"]
    result = run_cli("train", run, *sets, "--allow-changed")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout + result.stderr
    logged = losses(run)
    assert min(logged) == 1 and logged[8] < logged[1]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume" and e.get("checkpoint") == "step-000000" for e in events)


def test_import_interrupted_while_writing_leaves_no_run(sources, tmp_path, monkeypatch):
    """Killed (Ctrl-C) after some tensors are written: the staging directory goes, and no run appears."""
    from nanopt.importer import weights
    from nanopt.importer.run import import_model

    real_read, calls = weights._read, []

    def interrupted(stored):
        calls.append(stored)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_read(stored)

    monkeypatch.setattr(weights, "_read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_model(str(sources["llama-sharded"][0]), tmp_path / "runs" / "r")
    assert len(calls) == 3 and list((tmp_path / "runs").iterdir()) == []
