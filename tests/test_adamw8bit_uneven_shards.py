"""8-bit AdamW under FSDP2 where a parameter's rows do not split evenly over the ranks (torch.chunk gives one rank
a row more): each rank steps its own shard, whatever another rank or an earlier run left in torch.compile's cache.

The compiled step's on-disk cache (AOTAutograd's, shared by every process of the user) keys a DTensor argument by
its global shape and layout only, not by the rank's shard (pytorch/pytorch#188390): two ranks holding 129 and 128
rows of the same parameter get the same key, and a rank that finds the other's entry runs a graph compiled for the
other shard, dies with "expected size 128==129" and leaves the other ranks waiting in their next collective. The
run to compare with fills a cache of its own (fresh for the test), so the sessions after it read that cache as a
second run on a user's machine does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import RankFailed, run_ranks
from test_memory_ladder import EIGHT_BIT, EIGHT_BIT_HANG_GUARD_S, EIGHT_BIT_MODEL, KILLED_AT, train_in_rank
from trainhelp import HIDE_CUDA, losses, make_run

from nanopt.config import load_run
from nanopt.errors import CheckpointError
from nanopt.train.optim.lowbit import quantizes, shard_rows

# MLP rows: 257 (129 + 128 on 2 ranks): fp32 moments, uneven DTensor shards. The attention matrices (128 rows, 64
# a rank) keep 8-bit moments, so both kinds of moment go through the compiled step.
UNEVEN_MODEL = {"hidden_size": 128, "intermediate_size": 257, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 16}


@pytest.mark.slow
def test_adamw8bit_under_fsdp2_with_uneven_shards_trains_and_resumes_exactly_from_a_warm_compile_cache(
        tmp_path: Path, tiny_dataset: Path):
    pytest.importorskip("torchao")
    assert shard_rows(257, 2) == [129, 128] and not quantizes((257, 128), 2) and quantizes((128, 128), 2)
    env = {**HIDE_CUDA, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile-cache")}
    settings = {**EIGHT_BIT, "parallelism": "fsdp", "global_batch_tokens": 4 * 16}
    straight = make_run(tmp_path, tiny_dataset, "straight", model=UNEVEN_MODEL, **settings)
    run_ranks(train_in_rank, straight, None, env=env, timeout=EIGHT_BIT_HANG_GUARD_S)  # compiles, fills the cache
    assert sorted(losses(straight)) == list(range(1, 7))
    resumed = make_run(tmp_path, tiny_dataset, "resumed", model=UNEVEN_MODEL, **settings)
    with pytest.raises(RankFailed):  # the SIGKILL at step 5; a rank's own error would be raised as itself
        run_ranks(train_in_rank, resumed, KILLED_AT, env=env, timeout=EIGHT_BIT_HANG_GUARD_S)
    assert max(losses(resumed)) == KILLED_AT - 1
    run_ranks(train_in_rank, resumed, None, env=env, timeout=EIGHT_BIT_HANG_GUARD_S)
    assert losses(resumed) == losses(straight)


def refusal_in_rank(run: Path) -> tuple[str, str] | None:
    """`nanopt train RUN` in each torchrun worker: the CheckpointError it refused with (message, hint), or None."""
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    try:
        train(load_run(run), TrainOptions())
    except CheckpointError as exc:
        return exc.message, exc.hint
    return None


@pytest.mark.slow
def test_adamw8bit_moments_that_another_world_size_cannot_hold_are_refused_on_every_rank(tmp_path: Path,
                                                                                       tiny_dataset: Path):
    """Rows of 128 values (two make a block): 2 ranks hold a 128-row projection in 8 bits (64 rows each), 3 ranks
    would split it 43/43/42 and hold it in fp32. Resuming on 3 what 2 wrote is refused before anything is read, in
    one line saying why and what to do, on all 3 ranks together: none dies alone and leaves the others waiting in
    a collective (this run once looked like a stall: one rank's compiled step died, see above)."""
    pytest.importorskip("torchao")
    assert quantizes((128, 128), 2) and not quantizes((128, 128), 3)
    settings = {**EIGHT_BIT, "parallelism": "fsdp", "max_steps": 2, "global_batch_tokens": 6 * 32}
    run = make_run(tmp_path, tiny_dataset, "run", model={**EIGHT_BIT_MODEL, "hidden_size": 128}, **settings)
    run_ranks(train_in_rank, run, None, env=HIDE_CUDA, timeout=EIGHT_BIT_HANG_GUARD_S)
    refusals = run_ranks(refusal_in_rank, run, world_size=3, env=HIDE_CUDA, timeout=EIGHT_BIT_HANG_GUARD_S)
    assert len(set(refusals)) == 1 and refusals[0] is not None, refusals
    message, hint = refusals[0]
    assert "is stored in 8 bits, and 3 rank(s) hold it in fp32" in message and "\n" not in message, message
    assert "resume on the number of ranks that wrote the checkpoint" in hint
