"""Golden numbers: `nanopt train` on the CPU reproduces per-step losses recorded from the current code.

A silent change to the model, the loss, the optimizer, the learning-rate schedule or the data loader changes the
loss of some step of a 20-step run by far more than the tolerance, so one of these tests fails. An intended change
(a new init, a new default) fails them too: check that the change is meant, then paste the new numbers, which the
failure message prints.

Every setting the numbers depend on is spelled out here (not taken from `make_run`'s defaults), and the dataset
is the session's `tiny_dataset`; `test_the_dataset_is_the_one_the_numbers_were_recorded_on` says so first when the
tokenized corpus itself changed (for instance a new version of the tokenizer library).

Also here: gradient clipping must clip (the gradient the optimizer received is read back from its state), and a
run with dropout resumed from a checkpoint must equal the uninterrupted run bit for bit (the RNG state is restored).

All runs are forked from the session's warm process that has imported torch (tests/faulthelp.py), with CUDA hidden
from each command and its ranks: the numbers are float32 CPU numbers.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from faulthelp import Child, Launcher
from trainhelp import eval_losses, final_weights_hash, losses, make_run

# Tolerance on each loss, in nats. CPU float32 training is deterministic run to run on one machine (repeated runs
# agree bit for bit, with 1 or 2 threads), but another CPU or library build may pick other vectorized kernels and
# round differently. Forcing the portable (non-AVX2) kernels or the BLAS library's reproducible mode moved a loss
# here by at most 1.4e-6, three float32 ulps (an ulp is 4.8e-7 at losses between 4 and 8); scaling the initial
# weights by 1 + 1e-7 moved one by at most two ulps. The smallest real changes tried (the exact GELU in place of
# the tanh one, a hard-coded RMSNorm epsilon) move some loss by 1.8e-4, most others by 1e-3 or more. 1e-5 is seven
# times the largest rounding difference seen and eighteen times below the smallest real change.
TOL = 1e-5

SEED = 7
# initializer_range is larger than the default 0.02 on purpose. With weights that small, attention is almost
# uniform and GELU's inputs stay near 0, so a wrong RoPE (another theta, the other rotation) or the exact GELU in
# place of GPT-2's tanh approximation would move no loss by more than a few ulps. Here they move some loss by
# 1e-4 or more; the GPT-2 run also gets a higher learning rate, which lets its MLP inputs grow.
LLAMA = {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "rope_theta": 10000.0,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "dropout": 0.0, "initializer_range": 0.1}
GPT2 = {"architecture": "gpt2", "hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 32, "layer_norm_eps": 1e-5,
        "tie_word_embeddings": True, "dropout": 0.0, "initializer_range": 0.2}
GPT2_LEARNING_RATE = 1e-2
# 20 steps of 256 tokens (micro-batch 4 x 32 x accumulation 2 on one rank), warmup 3 then cosine to 0.1 x peak,
# AdamW with weight decay on matrices only, clipping at 1.0; eval twice, the final checkpoint only.
TRAIN = {"micro_batch_size": 4, "global_batch_tokens": 4 * 32 * 2, "max_steps": 20, "learning_rate": 3e-3,
         "min_lr_ratio": 0.1, "lr_schedule": "cosine", "warmup_steps": 3, "weight_decay": 0.1, "beta1": 0.9,
         "beta2": 0.95, "adam_eps": 1e-8, "grad_clip": 1.0, "precision": "fp32", "eval_interval": 10,
         "eval_tokens": 1024, "checkpoint_interval": 0, "keep_checkpoints": 1, "log_interval": 1, "seed": SEED}

# Recorded from the code at the time this file was written: the loss of steps 1..20 and the val loss at 10 and 20.
GOLDEN_LLAMA = [6.401495933532715, 6.4205851554870605, 6.3374223709106445, 6.164708614349365, 6.155113697052002,
                6.101139068603516, 5.889564514160156, 5.847553253173828, 5.838116645812988, 5.783439636230469,
                5.545338153839111, 5.605542182922363, 5.5274810791015625, 5.547540664672852, 5.433272361755371,
                5.409067630767822, 5.2922043800354, 5.432826042175293, 5.413405418395996, 5.37363338470459]
GOLDEN_LLAMA_VAL = {10: 5.6061012744903564, 20: 5.303045809268951}
GOLDEN_GPT2 = [6.9070539474487305, 6.641946315765381, 6.365220069885254, 6.039003372192383, 6.031179428100586,
               5.709227561950684, 5.529293060302734, 5.4534196853637695, 5.256343841552734, 5.206630706787109,
               5.0775837898254395, 4.974462509155273, 5.0244903564453125, 4.921847343444824, 4.854654312133789,
               4.830139636993408, 4.800945281982422, 4.861861228942871, 4.807722091674805, 4.819915771484375]
GOLDEN_GPT2_VAL = {10: 5.001809000968933, 20: 4.713496208190918}

# What the tiny corpus tokenizes to (meta.json's train shards), so a changed dataset is reported as such.
GOLDEN_TRAIN_SHARDS = ["3020fcd6f1938289a8e9ca5736c66c488596ba2575c87a59ba92a04ca5cb5df4",
                       "f43e26aac5851f09b564fd8034b9653c2df44c00aeb37b4b9e8a61c2868c5f8e",
                       "ecb2651a6217215b5e49f71f246fdb487b734192e69a13ccb9c094072a36a9fd"]


class CpuLauncher:
    """The session's warm launcher, each `nanopt train` it forks (and torchrun's ranks) seeing no GPU. The launcher
    never initializes CUDA itself, so the variable set in the forked command still decides what it sees."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    def train(self, run: Path, *args: str) -> Child:
        return self.launcher.train(run, *args, env={"CUDA_VISIBLE_DEVICES": ""})


@pytest.fixture
def cpu_launcher(launcher: Launcher) -> CpuLauncher:
    return CpuLauncher(launcher)


def golden_run(root: Path, dataset: Path, name: str, model: dict, **train) -> Path:
    return make_run(root, dataset, name, model=model, **{**TRAIN, **train})


def loss_list(run: Path) -> list[float]:
    found = losses(run)
    assert sorted(found) == list(range(1, len(found) + 1)), sorted(found)
    return [found[step] for step in sorted(found)]


def assert_golden(run: Path, expected: list[float], expected_val: dict[int, float]) -> None:
    actual, actual_val = loss_list(run), eval_losses(run)
    worst = max((abs(a - e) for a, e in zip(actual, expected, strict=False)), default=math.inf)
    message = (f"per-step losses moved from the recorded ones (largest difference {worst:.3g}, tolerance {TOL}); "
               f"if the change is intended, record:\n{actual!r}\n{actual_val!r}")
    assert len(actual) == len(expected) and worst <= TOL, message
    assert sorted(actual_val) == sorted(expected_val), message
    assert all(abs(actual_val[s] - expected_val[s]) <= TOL for s in expected_val), message


# ------------------------------------------------------------------------------------------------ golden losses


def test_the_dataset_is_the_one_the_numbers_were_recorded_on(tiny_dataset: Path):
    shards = json.loads((tiny_dataset / "meta.json").read_text())["splits"]["train"]["shards"]
    assert [s["sha256"] for s in shards] == GOLDEN_TRAIN_SHARDS, (
        "the test corpus tokenizes differently now (tokenizer training or the data pipeline changed), so every "
        "golden loss below moves too; record them again only if that change is intended")


def test_llama_one_process(tmp_path: Path, tiny_dataset: Path, cpu_launcher: CpuLauncher):
    run = golden_run(tmp_path, tiny_dataset, "llama", LLAMA)
    cpu_launcher.train(run)
    assert_golden(run, GOLDEN_LLAMA, GOLDEN_LLAMA_VAL)


def test_llama_two_gloo_ranks(tmp_path: Path, tiny_dataset: Path, cpu_launcher: CpuLauncher):
    # DDP over 2 ranks x accumulation 1 trains on the same samples as 1 rank x accumulation 2: the same numbers.
    run = golden_run(tmp_path, tiny_dataset, "llama", LLAMA)
    cpu_launcher.train(run, "--nproc-per-node", "2")
    assert_golden(run, GOLDEN_LLAMA, GOLDEN_LLAMA_VAL)


def test_gpt2_one_process(tmp_path: Path, tiny_dataset: Path, cpu_launcher: CpuLauncher):
    run = golden_run(tmp_path, tiny_dataset, "gpt2", GPT2, learning_rate=GPT2_LEARNING_RATE)
    cpu_launcher.train(run)
    assert_golden(run, GOLDEN_GPT2, GOLDEN_GPT2_VAL)


# --------------------------------------------------------------------------------------------- gradient clipping


def first_step_gradient_norm(run: Path, beta1: float) -> float:
    """The norm of the gradient AdamW received at step 1, read back from the step-1 checkpoint: after one step
    its first moment is exactly (1 - beta1) x that gradient."""
    from safetensors.torch import load_file

    state = load_file(str(run / "checkpoints" / "step-000001" / "optimizer.safetensors"))
    moments = [tensor.double() for key, tensor in state.items() if key.endswith("/exp_avg")]
    assert moments
    return math.sqrt(sum(float((m * m).sum()) for m in moments)) / (1 - beta1)


def logged_grad_norms(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in records if r["kind"] == "train"}


def test_gradient_clipping_clips_and_a_huge_bound_changes_nothing(tmp_path: Path, tiny_dataset: Path,
                                                                  cpu_launcher: CpuLauncher):
    runs = {}
    for clip in (0.0, 1e9, 1e-3):
        runs[clip] = golden_run(tmp_path, tiny_dataset, f"clip-{clip:g}", LLAMA, max_steps=6, grad_clip=clip,
                                eval_interval=0, checkpoint_interval=1, keep_checkpoints=6)
        cpu_launcher.train(runs[clip])
    off, huge, tiny = runs[0.0], runs[1e9], runs[1e-3]
    # The logged norm is the one before clipping: the same in all three runs at step 1, and far above 1e-3.
    pre_clip = logged_grad_norms(off)[1]
    assert pre_clip > 0.1
    assert logged_grad_norms(huge)[1] == logged_grad_norms(tiny)[1] == pre_clip
    # What the optimizer was given: the whole gradient without clipping (or under a bound it never reaches) ...
    assert first_step_gradient_norm(off, TRAIN["beta1"]) == pytest.approx(pre_clip, rel=1e-5)
    assert first_step_gradient_norm(huge, TRAIN["beta1"]) == pytest.approx(pre_clip, rel=1e-5)
    # ... and the gradient scaled down to norm 1e-3 under that bound.
    assert first_step_gradient_norm(tiny, TRAIN["beta1"]) == pytest.approx(1e-3, rel=1e-4)
    # The same through the whole run: a bound never reached is no clipping at all, bit for bit. A bound always
    # reached changes the trajectory, though only a little: AdamW divides out most of the gradient's scale, and
    # what is left is its epsilon weighing more against the smaller gradients.
    assert losses(huge) == losses(off) and final_weights_hash(huge) == final_weights_hash(off)
    assert losses(tiny)[1] == losses(off)[1]
    assert max(abs(losses(tiny)[s] - losses(off)[s]) for s in range(2, 7)) > 10 * TOL, (losses(tiny), losses(off))


# ---------------------------------------------------------------------------------- exact resume with dropout


def test_resume_with_dropout_equals_the_uninterrupted_run(tmp_path: Path, tiny_dataset: Path,
                                                          cpu_launcher: CpuLauncher):
    """With dropout every training step draws from the torch RNG, so resuming is exact only if the checkpoint's
    RNG state is restored: a fresh process that merely re-seeds would draw step 1's dropout masks at step 11."""
    model = {**LLAMA, "dropout": 0.1}
    straight = golden_run(tmp_path, tiny_dataset, "straight", model, checkpoint_interval=10, keep_checkpoints=5)
    cpu_launcher.train(straight)
    dropped = loss_list(straight)
    assert max(abs(a - b) for a, b in zip(dropped, GOLDEN_LLAMA, strict=True)) > 100 * TOL, dropped  # dropout acts
    # The state a run interrupted after its step-10 checkpoint leaves: the run directory and that checkpoint.
    resumed = golden_run(tmp_path, tiny_dataset, "resumed", model, checkpoint_interval=10, keep_checkpoints=5)
    (resumed / "checkpoints").mkdir()
    shutil.copytree(straight / "checkpoints" / "step-000010", resumed / "checkpoints" / "step-000010")
    child = cpu_launcher.train(resumed)
    assert "resumed from" in child.stderr and "step 10" in child.stderr, child.stderr[-2000:]
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == list(range(11, 21))
    assert [a[s] for s in range(11, 21)] == [b[s] for s in range(11, 21)]
    assert eval_losses(resumed)[20] == eval_losses(straight)[20]
    assert final_weights_hash(resumed) == final_weights_hash(straight)

