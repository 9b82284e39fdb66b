"""Cross-document attention masking (model.json document_masking): a packed row computes what each of its
documents computes alone; training with it (and qk_norm) resumes exactly; a wrong EOS id is refused."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from trainhelp import eval_losses, final_weights_hash, losses, make_run

from nanopt.config import ModelConfig
from nanopt.model.documents import document_positions
from nanopt.model.transformer import Transformer

EOS = 3


def tiny(architecture: str, **overrides) -> ModelConfig:
    base = dict(architecture=architecture, vocab_size=97, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, document_masking=True, eos_token_id=EOS)
    if architecture == "llama":
        base["num_key_value_heads"] = 2
    cfg = ModelConfig(**{**base, **overrides})
    cfg.validate()
    return cfg


def documents(lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Documents of these lengths, each ending with EOS but the last (a row ends mid-document)."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for i, length in enumerate(lengths):
        doc = torch.randint(EOS + 1, 97, (length,), generator=generator)
        if i < len(lengths) - 1:
            doc[-1] = EOS
        docs.append(doc)
    return docs


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_packed_logits_equal_each_document_alone(architecture, qk_norm):
    torch.manual_seed(0)
    model = Transformer(tiny(architecture, qk_norm=qk_norm)).eval()
    rows = [documents([7, 1, 20, 12], seed=1), documents([40], seed=2), documents([2, 30, 8], seed=3)]
    packed = torch.stack([torch.cat(row) for row in rows])
    with torch.no_grad():
        logits = model(packed)
        for r, row in enumerate(rows):
            start = 0
            for doc in row:
                alone = model(doc[None])[0]
                torch.testing.assert_close(logits[r, start:start + len(doc)], alone, rtol=0, atol=2e-5)
                start += len(doc)
    # and without the option, the same packed row is not its documents (the test can tell)
    plain = Transformer(tiny(architecture, qk_norm=qk_norm, document_masking=False)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        crossing = plain(packed)[0, 8:28]
        alone = plain(rows[0][2][None])[0]
    assert (crossing - alone).abs().max() > 1e-3


def test_document_positions_restart_after_each_eos():
    ids = torch.tensor([[5, EOS, 6, 7, EOS, EOS, 8]])
    document, position = document_positions(ids, EOS)
    assert document.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert position.tolist() == [[0, 1, 0, 1, 2, 0, 0]]


def test_loss_and_gradients_under_bf16_autocast():
    model = Transformer(tiny("llama"))
    ids = torch.cat(documents([10, 22], seed=4))[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, ids)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


OPTIONS = {"document_masking": True, "qk_norm": True, "init": "fan_in"}


def with_eos(dataset: Path) -> dict:
    return {**OPTIONS, "eos_token_id": json.loads((dataset / "meta.json").read_text())["eos_id"]}


def test_training_with_the_options_resumes_exactly_after_a_kill(tmp_path, tiny_dataset, launcher, cli_in_process):
    settings = dict(model=with_eos(tiny_dataset), max_steps=6, checkpoint_interval=2, eval_interval=3)
    straight = make_run(tmp_path, tiny_dataset, "straight", **settings)
    launcher.train(straight)
    # SIGKILLed as it reads step 4's first batch, once its step-2 checkpoint is complete; then started again
    killed = make_run(tmp_path, tiny_dataset, "killed", **settings)
    child = launcher.start("train", killed, "--no-live", kill_at_step={
        "step": 4, "checkpoints": str(killed / "checkpoints"), "latest": "step-000002"})
    assert launcher.wait(child) == -signal.SIGKILL, "the run ended before it could be killed"
    resumed = launcher.train(killed)
    assert "resumed from" in resumed.stderr and "step 2" in resumed.stderr
    assert [losses(straight)[s] for s in range(3, 7)] == [losses(killed)[s] for s in range(3, 7)]
    assert eval_losses(straight) == eval_losses(killed)
    assert final_weights_hash(killed) == final_weights_hash(straight)
    # an option of the model cannot change on resume
    model = json.loads((killed / "model.json").read_text())
    (killed / "model.json").write_text(json.dumps({**model, "qk_norm": False}))
    refused = cli_in_process("train", killed, "--set", "max_steps=8", "--allow-changed")
    assert refused.returncode == 2 and "model.qk_norm: True -> False" in refused.stderr


def test_an_eos_id_that_is_not_the_datasets_is_refused(tmp_path, tiny_dataset, cli_in_process):
    eos = json.loads((tiny_dataset / "meta.json").read_text())["eos_id"]
    run = make_run(tmp_path, tiny_dataset, model={**OPTIONS, "eos_token_id": eos + 1}, max_steps=2)
    result = cli_in_process("train", run)
    assert result.returncode == 2 and "eos_token_id" in result.stderr and f'"eos_token_id": {eos}' in result.stderr
    assert not (run / "checkpoints").exists()


def test_memory_model_counts_the_mask_autograd_keeps():
    from test_model_options import saved_bytes

    from nanopt.model import memory as memory_model

    ids = torch.stack([torch.cat(documents([20, 44], seed=5)), torch.cat(documents([64], seed=6))])
    for architecture in ("llama", "gpt2"):
        masked = tiny(architecture, vocab_size=97)
        plain = tiny(architecture, vocab_size=97, document_masking=False)
        measured = saved_bytes(masked, ids) - saved_bytes(plain, ids)
        predicted = 2 * memory_model.document_mask_bytes(masked, 4, 64)  # fp32 on the CPU, two sequences
        # the plain run's one [T, head_dim] cos / sin pair (shared by the rows, too small for the model to count)
        shared_rope = 2 * 4 * 64 * 16 if architecture == "llama" else 0
        # beyond the model: the [B, T] document indices and positions (int64)
        assert 0 <= measured + shared_rope - predicted <= 2 * 2 * 64 * 8, (architecture, measured, predicted)


def test_generation_continues_the_prompts_last_document():
    from nanopt.model.generate import generate

    torch.manual_seed(0)
    model = Transformer(tiny("llama"))
    with torch.no_grad():  # weights far from their init, so the next token depends on what the model attends to
        for param in model.parameters():
            param.add_(0.5 * torch.randn_like(param))
    first, last = documents([9, 5], seed=7)
    for prompt in (torch.cat([first, last]).tolist(), first.tolist()):  # the last document; a prompt ending at EOS
        own = prompt[len(first):] if len(prompt) > len(first) else prompt
        cached = generate(model, prompt, 12, temperature=0, use_cache=True)
        assert cached == generate(model, prompt, 12, temperature=0, use_cache=False)
        assert cached == generate(model, own, 12, temperature=0, use_cache=True)
