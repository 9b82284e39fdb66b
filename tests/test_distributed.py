"""tests/distributed.py, the helper that runs a function on two gloo ranks: each rank sees torchrun's environment,
results come back in rank order, a rank's exception is raised in the test with its message, and a rank that dies or
hangs fails the test instead of blocking it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from distributed import RankFailed, run_ranks

from nanopt.errors import ConfigError
from nanopt.runtime import ranks


def _where_am_i() -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://, from MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE alone
    total = torch.tensor([ranks().rank + 1.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {"ranks": tuple(ranks()), "sum": total.item(), "threads": torch.get_num_threads(),
            "rendezvous": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
            "local_world_size": os.environ["LOCAL_WORLD_SIZE"]}


def test_each_rank_has_torchrun_environment_and_results_come_back_in_rank_order():
    rank0, rank1 = run_ranks(_where_am_i)
    assert rank0["ranks"] == (0, 0, 2) and rank1["ranks"] == (1, 1, 2)  # rank, local rank, world size
    assert rank0["sum"] == rank1["sum"] == 1.0 + 2.0  # a real all-reduce over both
    assert rank0["rendezvous"] == rank1["rendezvous"] and rank0["local_world_size"] == "2"
    assert rank0["threads"] == rank1["threads"] == 1  # as torchrun's OMP_NUM_THREADS=1


def _refuse_on_rank_1() -> str:
    if ranks().rank == 1:
        raise ConfigError("train.json: key 'seed' is wrong on rank 1", "fix the seed")
    return "fine"


def test_an_exception_in_a_rank_is_raised_in_the_test_with_its_message_and_traceback():
    with pytest.raises(ConfigError, match="key 'seed' is wrong on rank 1") as raised:
        run_ranks(_refuse_on_rank_1)
    assert raised.value.hint == "fix the seed"
    cause = str(raised.value.__cause__)
    assert "in rank 1" in cause and "_refuse_on_rank_1" in cause  # where in the rank it was raised


def _exit_on_rank_1() -> None:
    if ranks().rank == 1:
        os._exit(3)


def test_a_rank_that_dies_without_a_result_fails_the_test():
    with pytest.raises(RankFailed, match="rank 1 exited with status 3"):
        run_ranks(_exit_on_rank_1)


def _hang_on_rank_0() -> None:
    if ranks().rank == 0:
        threading.Event().wait()  # forever: only the helper's timeout can end this test


def test_a_hung_rank_fails_the_test_instead_of_blocking_it():
    with pytest.raises(RankFailed, match="rank 0 still running after 3 s"):
        run_ranks(_hang_on_rank_0, timeout=3)


def _fail_on_rank_1_while_rank_0_goes_on(marker: str) -> None:
    import time

    if ranks().rank == 1:  # e.g. a crash before a collective that rank 0 is already waiting in
        raise ConfigError("train.json: rank 1 stops before the collective", "fix rank 1")
    time.sleep(60)  # rank 0, waiting for a peer that will never come
    Path(marker).write_text("rank 0 was left running")


def test_the_ranks_left_waiting_for_a_failed_rank_are_stopped_as_torchrun_stops_them(tmp_path: Path):
    """torchrun stops every worker once one fails; so does the helper, after a grace for the others' own errors, and
    the test fails with the failed rank's error instead of waiting for its hang guard."""
    marker = tmp_path / "went-on"
    with pytest.raises(ConfigError, match="rank 1 stops before the collective"):
        run_ranks(_fail_on_rank_1_while_rank_0_goes_on, str(marker), peer_failed_grace=1)
    assert not marker.exists()


def _env_var(name: str) -> str:
    return os.environ[name]


def test_extra_environment_reaches_every_rank():
    assert run_ranks(_env_var, "NANOPT_PG_TIMEOUT_S", env={"NANOPT_PG_TIMEOUT_S": "7"}) == ["7", "7"]
