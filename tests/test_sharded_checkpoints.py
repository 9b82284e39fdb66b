"""Sharded checkpoints (several ranks write torch.distributed.checkpoint shards, in the background): a run moves
between 4, 2 and 1 ranks without skipping or repeating a sample, with its optimizer state resharded; eval and export
read the shards; a crafted shard index cannot run code. (Background saves: tests/test_background_saves.py.)

Every sample a rank reads is recorded by a small `sitecustomize` put on the ranks' PYTHONPATH: it wraps the real
loader's next_batch, writes (step, first global sample, micro-batch size), and changes nothing else.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from clihelp import REPO, run_cli
from faulthelp import TINY_MODEL, Launcher
from trainhelp import HIDE_CUDA, losses, make_run

from nanopt.errors import CheckpointError
from nanopt.train import checkpoint as ckpt

# The 4 -> 2 -> 1 -> 4 ranks ladder every test here reads (~30 s to build): CI's slow stage.
pytestmark = pytest.mark.slow

RECORDER = """
import os
if os.environ.get("SAMPLE_LOG"):
    from nanopt.data.loaders import loader

    _next_batch = loader.TrainLoader.next_batch

    def next_batch(self):
        with open(os.path.join(os.environ["SAMPLE_LOG"], f"{os.getpid()}.txt"), "a") as log:
            log.write(f"{self.step} {self._first_sample()} {self.micro_batch_size}\\n")
        return _next_batch(self)

    loader.TrainLoader.next_batch = next_batch
"""

# One sample per micro-batch: 4 samples a step (64 tokens of seq_len 16) are 4 ranks x 1, 2 x 2 or 1 x 4 micro-steps.
# A constant rate after warm-up: each session raises max_steps, which would move a cosine schedule.
STEPS_PER_SESSION = 3
TRAIN = {"micro_batch_size": 1, "global_batch_tokens": 64, "max_steps": STEPS_PER_SESSION,
         "checkpoint_interval": STEPS_PER_SESSION, "keep_checkpoints": 4, "eval_interval": 0, "warmup_steps": 2,
         "lr_schedule": "constant", "parallelism": "fsdp"}
SAMPLES_PER_STEP = 4


def train(launcher: Launcher, run: Path, ranks: int, max_steps: int, log: Path | None) -> str:
    """`nanopt train` with every sample recorded into `log` (None: not recorded); returns its stderr. Several ranks:
    forked from the warm launcher, whose torchrun starts fresh ranks that import the recorder. One process that is
    recorded: a fresh `python -m nanopt`, which imports it too."""
    options = ["--no-live", "--nproc-per-node", str(ranks), "--allow-changed", "--set", f"max_steps={max_steps}"]
    env = {}
    if log is not None:
        log.mkdir(exist_ok=True)
        env = {"PYTHONPATH": os.pathsep.join([str(log.parent / "site"), str(REPO)]), "SAMPLE_LOG": str(log)}
    if ranks == 1 and log is not None:
        result = run_cli("train", run, *options, env={**HIDE_CUDA, **env}, timeout=240)  # CPU numbers, as the ranks
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr
    return launcher.train(run, *options[1:], env=env).stderr


def consumed(log: Path) -> list[int]:
    """Every global sample index read, in no particular order, repeats kept."""
    samples = []
    for file in log.glob("*.txt"):
        for line in file.read_text().split("\n")[:-1]:
            _, first, size = map(int, line.split())
            samples += range(first, first + size)
    return samples


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> dict:
    """One run trained 3 steps at a time on 4, 2, 1, then 4 ranks (each session resumes the previous one's
    checkpoint), and the same run trained 12 steps in one process."""
    root = tmp_path_factory.mktemp("reshard")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(RECORDER)
    run = make_run(root, tiny_dataset, "chain", model=TINY_MODEL, **TRAIN)
    sessions = []
    for number, ranks in enumerate((4, 2, 1, 4), 1):
        stderr = train(launcher, run, ranks, number * STEPS_PER_SESSION, root / f"samples-{number}")
        sessions.append({"ranks": ranks, "stderr": stderr, "log": root / f"samples-{number}",
                         "checkpoint": ckpt.resolve(run, "latest")})
    whole = make_run(root, tiny_dataset, "whole", model=TINY_MODEL, **TRAIN)
    train(launcher, whole, 1, 4 * STEPS_PER_SESSION, None)
    return {"run": run, "whole": whole, "sessions": sessions, "root": root}


def test_every_sample_is_read_once_across_4_2_1_4_ranks(chain: dict):
    everything = []
    for number, session in enumerate(chain["sessions"]):
        samples = consumed(session["log"])
        first = number * STEPS_PER_SESSION * SAMPLES_PER_STEP
        # Each session reads exactly the samples of its own steps: none of the earlier session's, none skipped.
        assert sorted(samples) == list(range(first, first + STEPS_PER_SESSION * SAMPLES_PER_STEP)), session["ranks"]
        everything += samples
    assert sorted(everything) == list(range(4 * STEPS_PER_SESSION * SAMPLES_PER_STEP))


def test_each_resume_reads_the_shards_of_another_world_size_and_says_so(chain: dict):
    for before, after in zip(chain["sessions"], chain["sessions"][1:], strict=False):
        assert before["checkpoint"].layout == (ckpt.SHARDED if before["ranks"] > 1 else ckpt.FULL)
        assert before["checkpoint"].meta["world_size"] == before["ranks"]
        said = f"the checkpoint was written by {before['ranks']} rank(s), this run has {after['ranks']}"
        assert said in after["stderr"], after["stderr"][-2000:]
    shards = {p.name for p in chain["sessions"][0]["checkpoint"].path.iterdir()}
    assert {"__0_0.distcp", "__3_0.distcp", ".metadata", "meta.json"} <= shards  # every rank wrote its own part


def test_the_resharded_run_trains_like_one_process(chain: dict):
    """Weights and optimizer moments carried through every change of world size: the losses of each step match
    the uninterrupted run up to the order in which sums are reduced (a lost or misplaced optimizer state would
    show at the first step after a resume)."""
    resharded, whole = losses(chain["run"]), losses(chain["whole"])
    assert sorted(resharded) == sorted(whole) == list(range(1, 4 * STEPS_PER_SESSION + 1))
    for step, loss in whole.items():
        assert resharded[step] == pytest.approx(loss, rel=2e-5), step


def test_background_saves_record_how_long_the_step_was_blocked(chain: dict):
    records = [json.loads(line) for line in (chain["run"] / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if r.get("event") == "checkpoint"]
    assert [r["step"] for r in saves] == [3, 6, 9, 12]
    for save in saves:
        assert 0 < save["blocked_s"] <= save["write_s"], save


def test_eval_and_export_read_a_checkpoint_written_by_4_ranks(chain: dict, tmp_path: Path, cli_in_process):
    sharded_run, whole = chain["run"], chain["whole"]
    assert ckpt.resolve(sharded_run, "latest").layout == ckpt.SHARDED
    scores = []
    for run in (sharded_run, whole):
        result = cli_in_process("eval", run, "--json", "--no-samples", "--tokens", "2048")
        assert result.returncode == 0, result.stderr[-2000:]
        scores.append(json.loads(result.stdout)["test_loss"])
    assert scores[0] == pytest.approx(scores[1], rel=1e-4)
    exported = cli_in_process("export", sharded_run, "--out", tmp_path / "hf", "--json")
    assert exported.returncode == 0, exported.stderr[-2000:]
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    consolidated = ckpt.load_model_state(ckpt.resolve(sharded_run, "latest"))
    assert weights["model.embed_tokens.weight"].equal(consolidated["embed_tokens.weight"])


def test_a_crafted_shard_index_is_refused_without_running_it(chain: dict, tmp_path: Path):
    copy = tmp_path / "step-000003"
    shutil.copytree(chain["sessions"][0]["checkpoint"].path, copy)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (copy / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="not a readable shard index"):
        ckpt.load_model_state(ckpt.Checkpoint(copy, json.loads((copy / "meta.json").read_text())))
    assert not marker.exists()


def test_a_sharded_checkpoint_is_checked_against_its_snapshot_from_the_index(chain: dict, tmp_path: Path):
    """The shard index's sizes stand for the weights and the optimizer state, read without loading a shard: a
    snapshot they do not match, or an index whose table is not one, is refused before anything is allocated."""
    from torch.distributed.checkpoint.metadata import Metadata

    copy = Path(shutil.copytree(chain["sessions"][0]["checkpoint"].path, tmp_path / "step-000003"))
    meta = json.loads((copy / "meta.json").read_text())
    assert meta["layout"] == "sharded"
    (copy / "meta.json").write_text(json.dumps({**meta, "config": {**meta["config"], "model": {
        **meta["config"]["model"], "intermediate_size": 48}}}))
    with pytest.raises(CheckpointError, match=r"weights do not match its own model config \(layers\.0\.mlp\."):
        ckpt.verify(copy)
    (copy / "meta.json").write_text(json.dumps(meta))
    ckpt.verify(copy)  # the untouched copy reads
    index = pickle.dumps(Metadata(state_dict_metadata=[1, 2]))
    (copy / ".metadata").write_bytes(index)
    meta["files"][".metadata"] = ckpt.sha256(copy / ".metadata")
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"state_dict_metadata is a list, not a table"):
        ckpt.verify(copy)
