"""On the CPU nanopt chooses torch's intra-op threads from the cores this process may use and how busy they are
(or keeps the person's OMP_NUM_THREADS), says so in one line, and says once when the steps fall far below the pace
they kept earlier in the session (nanopt.cpu_threads, nanopt.hardware, nanopt.train.observe.pace).

The machine readers are tested on real files written here, malformed ones included; the decisions on the cores
and loads they stand for; the whole on real processes: a `nanopt preflight` and a `nanopt train` pinned to one CPU,
and (slow) a training that busy loops on its CPU slow down mid-run. The slowdown detector is also fed windows
measured on this project's shared 2-core machine (tokens/s and seconds of each log window, from metrics.jsonl).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from clihelp import REPO
from faulthelp import TINY_MODEL, Launcher, tiny_run
from trainhelp import HIDE_CUDA, make_run

from nanopt.cpu_threads import CPUThreads, choose_cpu_threads, set_cpu_threads, thread_setting
from nanopt.hardware import CPUCores, busy_elsewhere, cpu_cores, cpu_quota, cpu_ticks, other_work, physical_cores
from nanopt.train.observe import pace
from nanopt.train.observe.pace import SlowdownWatch

ONE_CPU = min(os.sched_getaffinity(0))  # a CPU this process may run on, to pin children to
# The environment of a person who set no thread count (the suite sets OMP_NUM_THREADS=1 for its own processes).
UNSET = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def cores(cpus: int, physical: int | None = None, quota: float | None = None, machine: int | None = None) -> CPUCores:
    return CPUCores(cpus=frozenset(range(cpus)), physical=physical or cpus, quota=quota, machine=machine or cpus)


def pinned() -> None:
    """preexec_fn: the child may run on one CPU only, as under `taskset -c N`."""
    os.sched_setaffinity(0, {ONE_CPU})


# ------------------------------------------------------------------------------------- the machine's files


def test_the_cgroup_quota_is_read_from_v2_or_v1_and_anything_else_is_no_quota(tmp_path: Path):
    v2, quota, period = tmp_path / "cpu.max", tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us"
    missing = (tmp_path / "none", tmp_path / "none")

    def v2_says(text: str) -> float | None:
        v2.write_text(text)
        return cpu_quota(v2, missing)

    assert v2_says("200000 100000\n") == 2.0
    assert v2_says("150000 100000") == 1.5  # docker run --cpus 1.5
    for malformed in ("max 100000", "", "garbage", "0 100000", "100000 0", "-5 100000", "1 2 3", "\x00\xff"):
        assert v2_says(malformed) is None, malformed
    v2.write_bytes(b"\xff\xfe 100000")  # not even text: still no quota, not a crash
    assert cpu_quota(v2, missing) is None
    quota.write_text("50000\n")
    period.write_text("100000\n")
    assert cpu_quota(tmp_path / "none", (quota, period)) == 0.5  # cgroup v1
    quota.write_text("-1")  # v1's "no quota"
    assert cpu_quota(tmp_path / "none", (quota, period)) is None
    assert cpu_quota(tmp_path / "none", missing) is None  # no cgroup files at all (macOS, a bare chroot)
    assert cpu_quota(tmp_path, missing) is None  # a directory where the file should be

    # A quota short of a whole CPU is still one thread; 1.5 CPUs are one (a second thread would be throttled).
    assert [cores(8, quota=q).usable for q in (0.5, 1.5, 2.0, 16.0, None)] == [1, 1, 2, 8, 8]


def test_physical_cores_count_hardware_threads_of_one_core_once(tmp_path: Path):
    for cpu, core in ((0, 0), (1, 0), (2, 1), (3, 1)):  # two cores with two hardware threads each
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert physical_cores(frozenset({0, 1, 2, 3}), tmp_path) == 2
    assert physical_cores(frozenset({0, 2}), tmp_path) == 2
    assert physical_cores(frozenset({0, 1}), tmp_path) == 1
    assert physical_cores(frozenset({0, 7}), tmp_path) == 2  # cpu7 unknown to sysfs: the logical count
    found = cpu_cores()
    assert found.cpus == frozenset(os.sched_getaffinity(0)) and 1 <= found.physical <= len(found.cpus)


STAT = """cpu  3000 10 600 9000 100 0 20 5 0 0
cpu0 1000 5 300 4000 50 0 10 3 0 0
cpu1 2000 5 300 5000 50 0 10 2 0 0
intr 8304841 0 0
ctxt 123
"""


def test_cpu_ticks_sum_the_cpus_asked_for_and_refuse_what_they_cannot_read(tmp_path: Path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    # busy: all but idle and iowait; steal counts as busy (a hypervisor gave the time to other machines)
    assert cpu_ticks(frozenset({0}), stat) == (1000 + 5 + 300 + 10 + 3, 1000 + 5 + 300 + 4000 + 50 + 10 + 3)
    both = cpu_ticks(frozenset({0, 1}), stat)
    assert both == (1318 + 2317, 5368 + 7367)
    assert cpu_ticks(frozenset({0, 5}), stat) is None  # a CPU without a line
    stat.write_text(STAT.replace("cpu1 2000", "cpu1 2x00"))
    assert cpu_ticks(frozenset({1}), stat) is None
    stat.write_text("cpu0 1 2 3\n")  # too few fields
    assert cpu_ticks(frozenset({0}), stat) is None
    stat.write_bytes(b"\xff\x00garbage")
    assert cpu_ticks(frozenset({0}), stat) is None
    assert cpu_ticks(frozenset({0}), tmp_path / "missing") is None
    assert other_work(frozenset({0}), 0.01, tmp_path / "missing") is None


def test_this_process_own_cpu_time_is_not_other_work():
    # 100 ticks a second, two CPUs, 0.5 s: 100 ticks in all, 80 of them busy, 0.3 s of them ours.
    assert busy_elsewhere((1000, 5000), (1080, 5100), 0.3, 2, 100) == pytest.approx(2 * 50 / 100)
    assert busy_elsewhere((1000, 5000), (1080, 5100), 0.0, 2, 100) == pytest.approx(1.6)
    assert busy_elsewhere((1000, 5000), (1080, 5100), 5.0, 2, 100) == 0.0  # never below nothing
    assert busy_elsewhere((1000, 5000), (1000, 5000), 0.0, 2, 100) is None  # no tick passed
    assert busy_elsewhere((1000, 5000), (900, 5100), 0.0, 2, 100) is None  # a counter went back


def test_a_busy_loop_on_our_cpu_is_seen_as_other_work():
    burner = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                              preexec_fn=pinned, stdout=subprocess.PIPE, text=True)
    try:
        assert burner.stdout.readline() == "spinning\n"  # started, however busy the machine
        busy = other_work(frozenset({ONE_CPU}), 0.5)
    finally:
        burner.kill()
        burner.wait()
    # The loop alone keeps the CPU busy at least half the time, whatever else shares it (which counts too).
    assert busy is not None and busy >= 0.5


# ------------------------------------------------------------------------------------------ the decision


@pytest.mark.parametrize("machine, busy, ranks, threads, words", [
    (cores(4), 0.1, 1, 4, "4 cores free of 4; OMP_NUM_THREADS to choose"),
    (cores(2), 1.0, 1, 1, "1 core free of 2, other work busy on the rest"),  # the issue's machine
    (cores(2), 0.2, 1, 2, "2 cores free of 2"),  # a shell or an agent leaves a core free
    (cores(2), 0.3, 1, 1, "1 core free of 2"),  # a third of a core taken: its thread would fall behind
    (cores(2), 2.0, 1, 1, "no core free of 2, other work busy on them all"),  # one thread is the fewest
    (cores(8, physical=4), 2.0, 1, 3, "3 cores free of 4"),  # hardware threads: 6 of 8 free = 3 cores
    (cores(64, quota=2.0), 10.0, 1, 2, "2 cores free of 2; CPU quota 2 of 64 CPUs"),
    (cores(1, machine=2), 0.0, 1, 1, "1 core free of 1; affinity: 1 of 2 CPUs"),
    (cores(8), 0.0, 3, 2, "8 cores free of 8 shared by 3 ranks"),  # torchrun's ranks divide the cores
    (cores(2), 0.0, 4, 1, "shared by 4 ranks"),
    (cores(4), None, 1, 4, "4 cores, how busy unknown: no /proc/stat"),  # fall back to the cores it may use
])
def test_threads_are_the_free_cores_shared_among_the_ranks(machine, busy, ranks, threads, words):
    decision = choose_cpu_threads(machine, busy, None, ranks)
    assert decision.chosen and decision.threads == threads and words in decision.reason, decision
    per_rank = " per rank" if ranks > 1 else ""
    assert decision.line().startswith(f"CPU: {threads} thread{'s' if threads > 1 else ''}{per_rank} ("), decision


def test_the_persons_own_setting_is_kept_and_said_with_a_warning_when_the_cores_are_busy():
    kept = choose_cpu_threads(cores(4), 0.0, ("OMP_NUM_THREADS", 3))
    assert (kept.threads, kept.chosen) == (3, False) and kept.line() == "CPU: 3 threads (OMP_NUM_THREADS=3)"
    crowded = choose_cpu_threads(cores(4), 3.0, ("OMP_NUM_THREADS", 3))
    assert crowded.threads == 3 and crowded.line() == ("CPU: 3 threads (OMP_NUM_THREADS=3, though 1 core of 4 is "
                                                       "free: fewer threads would wait less)")
    one = choose_cpu_threads(cores(2), None, ("OMP_NUM_THREADS", 1))
    assert one.line() == "CPU: 1 thread (OMP_NUM_THREADS=1)"


def test_thread_variables_are_read_as_torch_reads_them():
    assert thread_setting({"OMP_NUM_THREADS": "3"}) == ("OMP_NUM_THREADS", 3)
    assert thread_setting({"OMP_NUM_THREADS": " 4,2 "}) == ("OMP_NUM_THREADS", 4)  # an OpenMP list: the first
    assert thread_setting({"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "5"}) == ("OMP_NUM_THREADS", 2)
    assert thread_setting({"MKL_NUM_THREADS": "5"}) == ("MKL_NUM_THREADS", 5)
    for unusable in ("", "abc", "0", "-2", "1.5"):
        assert thread_setting({"OMP_NUM_THREADS": unusable}) is None, unusable
    assert thread_setting({}) is None


def test_torchruns_own_omp_num_threads_1_is_not_the_persons(tmp_path: Path):
    rank = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    without, with_it = tmp_path / "without", tmp_path / "with"
    without.write_bytes(b"HOME=/root\0PATH=/bin\0")  # torchrun's parent started without it: torchrun set it
    with_it.write_bytes(b"HOME=/root\0OMP_NUM_THREADS=1\0")  # the person's
    assert thread_setting(rank, without) is None
    assert thread_setting(rank, with_it) == ("OMP_NUM_THREADS", 1)
    assert thread_setting(rank, tmp_path / "unreadable") == ("OMP_NUM_THREADS", 1)  # in doubt, the person's
    assert thread_setting({**rank, "LOCAL_WORLD_SIZE": "1"}, without) == ("OMP_NUM_THREADS", 1)  # torchrun sets none
    assert thread_setting({**rank, "OMP_NUM_THREADS": "2"}, without) == ("OMP_NUM_THREADS", 2)
    no_agent = {k: v for k, v in rank.items() if k != "TORCHELASTIC_RUN_ID"}
    assert thread_setting(no_agent, without) == ("OMP_NUM_THREADS", 1)


def test_torchruns_default_is_told_from_the_parents_start_environment():
    """As torchrun does: a parent started without OMP_NUM_THREADS sets it in its own environment, then starts a
    rank with it. The rank sees OMP_NUM_THREADS=1 and still knows it was not the person's; with the person's own,
    the same chain keeps it."""
    rank = ("import os\nfrom nanopt.cpu_threads import thread_setting\n"
            "print(thread_setting(os.environ))")
    parent = textwrap.dedent(f"""
        import os, subprocess, sys
        os.environ.update(OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID="none", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2")
        sys.exit(subprocess.run([sys.executable, "-c", {rank!r}]).returncode)
    """)
    for start_env, expected in ((UNSET, "None"), ({**UNSET, "OMP_NUM_THREADS": "1"}, "('OMP_NUM_THREADS', 1)")):
        result = subprocess.run([sys.executable, "-c", parent], env={**start_env, "PYTHONPATH": str(REPO)},
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.strip() == expected, result


def test_set_cpu_threads_gives_torch_the_threads_it_says():
    import torch

    before, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        kept = set_cpu_threads({"OMP_NUM_THREADS": "3"})  # applied although torch was imported before
        assert not kept.chosen and kept.threads == torch.get_num_threads() == 3
        os.sched_setaffinity(0, {ONE_CPU})  # this thread, as `taskset -c N` gives a process
        chosen = set_cpu_threads({})
        assert chosen.chosen and chosen.threads == torch.get_num_threads() == 1, chosen
        shared = set_cpu_threads({"LOCAL_WORLD_SIZE": "4"})  # a rank of four on this machine (torchrun's variable)
        assert shared.ranks == 4 and shared.line().startswith("CPU: 1 thread per rank ("), shared
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------- real processes


def test_training_pinned_to_one_cpu_chooses_one_thread_or_keeps_the_persons(tmp_path: Path, tiny_dataset: Path,
                                                                            launcher: Launcher):
    """`nanopt train` as `taskset -c N` would start it, once with no thread count set and once with
    OMP_NUM_THREADS=2: one line right after the start-up line says how many threads and why."""
    runs = {name: tiny_run(tmp_path, tiny_dataset, name, max_steps=2, eval_interval=0, checkpoint_interval=0)
            for name in ("chosen", "kept")}
    machine, affinity = os.cpu_count(), os.sched_getaffinity(launcher.proc.pid)
    said = {}
    try:
        # The warm launcher's main thread forks each command: pinned, it starts them pinned.
        os.sched_setaffinity(launcher.proc.pid, {ONE_CPU})
        for name, threads in (("chosen", ""), ("kept", "2")):  # "": as if unset (the launcher has the suite's 1)
            child = launcher.run("train", runs[name], "--no-live", env={"OMP_NUM_THREADS": threads})
            assert child.status == 0, child.stderr[-3000:]
            lines = child.stderr.splitlines()
            cpu = [i for i, line in enumerate(lines) if line.startswith("CPU: ")]
            assert len(cpu) == 1 and "parameters," in lines[cpu[0] - 1], child.stderr  # after the start-up line
            said[name] = lines[cpu[0]]
    finally:
        os.sched_setaffinity(launcher.proc.pid, affinity)
    pinned_to = f"; affinity: 1 of {machine} CPUs" if machine > 1 else ""
    assert said["chosen"].startswith("CPU: 1 thread (") and said["chosen"].endswith(
        f"{pinned_to}; OMP_NUM_THREADS to choose)"), said
    # Kept, with a warning: two threads on one CPU wait for each other whether or not other work shares it.
    assert said["kept"].startswith("CPU: 2 threads (OMP_NUM_THREADS=2, though ") and said["kept"].endswith(
        f"free: fewer threads would wait less{pinned_to})"), said


def test_preflight_json_says_which_threads_measured_the_step(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = tiny_run(tmp_path, tiny_dataset, "measured")
    result = cli_in_process("preflight", run, "--steps", "2", "--warmup", "0", "--json")
    assert result.returncode in (0, 3), result.stderr[-3000:]  # 3: a check failed, which two steps may well do
    # The suite's OMP_NUM_THREADS=1, kept
    assert json.loads(result.stdout)["device"]["cpu_threads"] == {
        "threads": 1, "chosen": False, "ranks": 1, "reason": "OMP_NUM_THREADS=1" + (
            f"; affinity: {len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs"
            if len(os.sched_getaffinity(0)) < (os.cpu_count() or 1) else "")}


def test_a_step_measured_with_other_threads_does_not_predict_the_run(tmp_path: Path, tiny_dataset: Path,
                                                                    cli_in_process, monkeypatch: pytest.MonkeyPatch):
    # The preflight ran while other work kept a core busy (here: the suite's OMP_NUM_THREADS=1); training then gets
    # 2 threads. Its prediction is not the 1-thread rate: it says why and what it used instead, and which threads
    # it is for. `nanopt estimate`, which cannot know training's threads, keeps the measurement.
    import torch

    from nanopt.config import load_run
    from nanopt.plan.estimate import EstimateOptions, estimate

    run = tiny_run(tmp_path, tiny_dataset, "measured")
    measured = cli_in_process("preflight", run, "--steps", "2", "--warmup", "0")
    assert measured.returncode in (0, 3), measured.stderr[-3000:]
    config = load_run(run)
    for threads in (None, 1):
        assert estimate(config, EstimateOptions(gpu="cpu", cpu_threads=threads))["throughput_source"]["kind"] == \
            "preflight"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    try:
        trained = cli_in_process("train", run, "--no-live")
    finally:
        torch.set_num_threads(1)
    assert trained.returncode == 0, trained.stderr[-3000:]
    prediction = json.loads((run / "prediction.json").read_text())
    assert prediction["device"]["cpu_threads"] == 2 and prediction["throughput"]["source"] == "assumed"
    why = (f"{run / 'preflight.json'} was measured with 1 CPU thread, this run trains with 2 CPU threads (other work "
           "kept a different number of cores busy then); throughput assumed at MFU 0.4")
    assert prediction["throughput"]["note"] == why
    assert why in " ".join((trained.stdout + trained.stderr).split())


@pytest.mark.slow
def test_a_machine_made_busy_mid_run_is_said_once(tmp_path: Path, tiny_dataset: Path):
    """A training pinned to one CPU with no thread count set; once it has logged for a few seconds, three busy
    loops start on the same CPU (a quarter of it is left, or less). The note comes after they started, once, with
    its `slowdown` event in metrics.jsonl; the run then stops on SIGINT as usual.

    Other work on the machine that arrives before the busy loops could say it first: this test then fails, the
    reason it is marked slow (~15 s) rather than run by `make test`."""
    run = make_run(tmp_path, tiny_dataset, "busy", model=TINY_MODEL, micro_batch_size=2, global_batch_tokens=64,
                   max_steps=100_000, eval_interval=0, checkpoint_interval=0, log_interval=5, warmup_steps=3)
    out = tmp_path / "train.out"
    with open(out, "w") as sink:  # a file, not a pipe nobody reads while it runs: a full pipe would stop it
        child = subprocess.Popen([sys.executable, "-m", "nanopt", "train", run, "--no-live"], cwd=REPO,
                                 env={**UNSET, **HIDE_CUDA, "COLUMNS": "250"}, stdout=sink, stderr=sink,
                                 preexec_fn=pinned)
    burners: list[subprocess.Popen] = []
    busy_from, event, deadline = None, None, time.monotonic() + 120
    try:
        while event is None and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.2)
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
                if (run / "metrics.jsonl").exists() else []
            steps = [r["step"] for r in records if r["kind"] == "train"]
            event = next((r for r in records if r.get("event") == "slowdown"), None)
            if busy_from is None and steps and steps[-1] >= 5 * 100:  # ~4 s of log windows at this machine's pace
                busy_from = steps[-1]
                burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pinned)
                           for _ in range(3)]
        time.sleep(1.0)  # a few more windows: the note is said once only
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        child.send_signal(signal.SIGINT)  # the preemption path: a checkpoint, then exit 75
        child.wait(timeout=120)
    text = out.read_text()
    assert event is not None and busy_from is not None and event["step"] > busy_from, (busy_from, event, text[-3000:])
    assert event["tokens_per_s"] < 0.5 * event["reference_tokens_per_s"] and event["threads"] == 1
    notes = [line for line in text.splitlines() if "seems busy with other work" in line]
    assert len(notes) == 1 and notes[0].startswith(f"step {event['step']}: "), text[-3000:]
    assert "one thread is the fewest" in notes[0]
    assert child.returncode == 75, text[-3000:]


# ----------------------------------------------------------------------------------- the slowdown detector

# Log windows (seconds, tokens/s) of a `nanopt train` of faulthelp's TINY_MODEL, 64-token steps, log_interval 5, on
# the project's shared 2-core machine, pinned to one CPU: windows 1-53 as the machine was (other jobs came and went:
# 2,700-12,000 tokens/s), then three busy loops on the same CPU from step 265 (window 54) on.
BUSY_FROM_265 = [
    (0.5331, 600), (0.1139, 2811), (0.0939, 3409), (0.0883, 3626), (0.0285, 11232), (0.0267, 11980),
    (0.0272, 11764), (0.1108, 2888), (0.1031, 3104), (0.0734, 4359), (0.1183, 2706), (0.0987, 3241),
    (0.0732, 4371), (0.0703, 4553), (0.0929, 3446), (0.116, 2759), (0.1057, 3027), (0.103, 3105), (0.1172, 2730),
    (0.1147, 2790), (0.0918, 3487), (0.0643, 4977), (0.0778, 4115), (0.0846, 3783), (0.0969, 3301),
    (0.0709, 4515), (0.0631, 5071), (0.0753, 4251), (0.0715, 4479), (0.0652, 4911), (0.0621, 5155),
    (0.0794, 4030), (0.0717, 4460), (0.0632, 5066), (0.0744, 4301), (0.0759, 4215), (0.0627, 5101),
    (0.0774, 4134), (0.0623, 5139), (0.0878, 3645), (0.0644, 4970), (0.0729, 4389), (0.0745, 4295),
    (0.0791, 4047), (0.0643, 4979), (0.0724, 4417), (0.0715, 4473), (0.0719, 4449), (0.0734, 4362),
    (0.0748, 4275), (0.0872, 3669), (0.0728, 4398), (0.0699, 4576), (0.0644, 4966), (0.3104, 1031),
    (0.3664, 873), (0.3279, 976), (0.3176, 1007), (0.3171, 1009), (0.2923, 1095), (0.3384, 946), (0.249, 1285),
    (0.1875, 1707), (0.2716, 1178)]
# The same run, no busy loops of ours: at its pace of ~5,000 tokens/s, with quiet moments at 11,000, until other
# jobs on the machine took it to 2,100-3,300 (about 0.55 of it) from step 285 on: slower, not far below.
NO_LOOPS = [
    (0.3989, 802), (0.0767, 4174), (0.0712, 4494), (0.06, 5332), (0.0545, 5877), (0.0667, 4801), (0.0678, 4717),
    (0.0636, 5034), (0.0677, 4729), (0.0675, 4742), (0.0625, 5118), (0.0681, 4701), (0.0698, 4587),
    (0.0635, 5043), (0.065, 4921), (0.0628, 5099), (0.0686, 4668), (0.0623, 5139), (0.0637, 5026),
    (0.0679, 4712), (0.0628, 5094), (0.0675, 4743), (0.0637, 5025), (0.0725, 4416), (0.0664, 4818),
    (0.0621, 5153), (0.0612, 5230), (0.0668, 4789), (0.0637, 5026), (0.0289, 11074), (0.0282, 11338),
    (0.0285, 11232), (0.0491, 6516), (0.0696, 4601), (0.072, 4443), (0.0664, 4819), (0.0682, 4690),
    (0.0641, 4994), (0.0593, 5397), (0.0285, 11231), (0.0599, 5341), (0.066, 4847), (0.0651, 4913),
    (0.0658, 4867), (0.0695, 4605), (0.0369, 8666), (0.0354, 9049), (0.0408, 7835), (0.0697, 4591),
    (0.0577, 5546), (0.0278, 11490), (0.0295, 10830), (0.0288, 11096), (0.0275, 11626), (0.0588, 5442),
    (0.0747, 4283), (0.1295, 2472), (0.155, 2065), (0.1068, 2995), (0.1221, 2621), (0.1094, 2926),
    (0.1227, 2608), (0.1469, 2179), (0.1125, 2844), (0.1093, 2929), (0.1091, 2932), (0.117, 2734),
    (0.1058, 3024), (0.1239, 2583), (0.1355, 2361), (0.1224, 2614), (0.1146, 2793), (0.0964, 3320),
    (0.1502, 2130), (0.1176, 2721), (0.1193, 2682), (0.1218, 2626), (0.1015, 3153), (0.1012, 3161),
    (0.1151, 2781), (0.1145, 2794), (0.1045, 3061), (0.1076, 2974), (0.0986, 3246), (0.1199, 2670),
    (0.1134, 2821), (0.1261, 2538), (0.0963, 3323), (0.1107, 2890), (0.1201, 2665), (0.0994, 3219),
    (0.1097, 2917), (0.1245, 2571), (0.1121, 2853), (0.1132, 2828), (0.1268, 2523), (0.1354, 2364),
    (0.1193, 2681), (0.1234, 2594), (0.1111, 2881), (0.128, 2500), (0.1128, 2837), (0.1289, 2482),
    (0.1294, 2473), (0.1205, 2655), (0.1382, 2315), (0.1298, 2465), (0.1229, 2603), (0.1008, 3173),
    (0.1097, 2916), (0.1178, 2716), (0.1174, 2725), (0.1435, 2230), (0.121, 2644), (0.1182, 2708), (0.1063, 3010)]
# The issue's numbers: the demo's 12-step windows of 3,840-token steps, at 3,784 tokens/s, then at 1,342 and 1,356.
ISSUE = [(12.2, 3784), (12.4, 3721), (12.1, 3810), (34.3, 1342), (34.0, 1356)]


def feed(windows, every: int = 5, seq_len=None, disturbed=lambda step: False, watch=None):
    """Each window into a watch as the training loop's log step would; the slowdowns it reports."""
    watch = watch or SlowdownWatch()
    found = []
    for number, (seconds, rate) in enumerate(windows, start=1):
        step = number * every
        said = watch.observe(step, rate * seconds, seconds, seq_len(step) if seq_len else None, disturbed(step))
        found += [said] if said else []
    return found


def test_busy_loops_on_the_cpu_are_found_after_they_started_and_once():
    found = feed(BUSY_FROM_265)
    assert len(found) == 1, found
    slow = found[0]
    waited = sum(seconds for number, (seconds, _) in enumerate(BUSY_FROM_265, start=1) if 265 < 5 * number <= slow.step)
    # The span the loops start in (partly fast: not far below), then two slow ones: each a window past a second.
    assert slow.step > 265 and waited < 4 * pace.SPAN_S
    assert slow.tokens_per_s < 0.3 * slow.reference_tokens_per_s
    assert slow.reference_steps[1] < 265  # measured before the loops


def test_the_issues_slowdown_is_found_at_its_second_slow_window():
    found = feed(ISSUE, every=12)
    assert [(f.step, round(f.tokens_per_s), round(f.reference_tokens_per_s)) for f in found] == [(60, 1349, 3784)]


def test_a_pace_that_drifts_or_dips_but_stays_above_half_is_not_far_below():
    assert feed(NO_LOOPS) == []
    # One slow span (a second under the busy loops) amid the normal pace: not sustained, not said.
    one_dip = NO_LOOPS[:40] + BUSY_FROM_265[54:58] + NO_LOOPS[40:]
    assert feed(one_dip) == []


def test_a_new_seq_len_starts_a_new_reference():
    # Longer sequences cost more per token: the slower windows of a later stage are not a busy machine.
    assert feed(BUSY_FROM_265, seq_len=lambda step: 64 if step < 265 else 256) == []


def test_windows_beside_our_own_checkpoint_writing_count_neither_way():
    assert feed(BUSY_FROM_265, disturbed=lambda step: step > 265) == []
    # ... and the disturbed ones do not break a sustained slowdown's count either way: found again without them.
    assert len(feed(BUSY_FROM_265, disturbed=lambda step: step in (270, 275))) == 1


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.notes: list[str] = []

    def write(self, kind: str, **fields) -> None:
        self.events.append({"kind": kind, **fields})

    def note(self, text: str) -> None:
        self.notes.append(text)


def session(device: str = "cpu", threads: CPUThreads | None = None, pending_save=None, is_main=True):
    """The parts of a training session that pace.after_log reads."""
    recorder = Recorder()
    return SimpleNamespace(
        rt=SimpleNamespace(is_main=is_main, device=SimpleNamespace(type=device), cpu_threads=threads),
        metrics=recorder, observer=recorder, loader=SimpleNamespace(seq_len=64), run=SimpleNamespace(run_dir="runs/x"),
        pending_save=pending_save, slowdown=SlowdownWatch()), recorder


def replay(s, windows=BUSY_FROM_265) -> None:
    for number, (seconds, rate) in enumerate(windows, start=1):
        pace.after_log(s, {"step": number * 5, "tokens_per_s": rate}, seconds)


def test_after_log_writes_one_event_and_one_note_with_what_to_do():
    chosen = CPUThreads(threads=2, reason="2 cores free of 2; OMP_NUM_THREADS to choose", chosen=True)
    s, heard = session(threads=chosen)
    replay(s)
    replay(s)  # the same session slowing again: said once
    assert len(heard.notes) == 1 and len(heard.events) == 1, (heard.notes, heard.events)
    event = heard.events[0]
    assert event["event"] == "slowdown" and event["kind"] == "event" and event["threads"] == 2
    assert event["threads_chosen"] is True and event["device"] == "cpu" and event["reference_steps"][1] < 265
    note = heard.notes[0]
    assert note.startswith(f"step {event['step']}: ") and "under 50% of the" in note
    assert "this machine seems busy" in note and "Ctrl-C saves a checkpoint" in note
    assert "`nanopt train runs/x` resumes" in note and "OMP_NUM_THREADS=1" in note


def test_the_advice_follows_the_threads_and_the_device():
    kept = CPUThreads(threads=4, reason="OMP_NUM_THREADS=4", chosen=False, variable="OMP_NUM_THREADS")
    one = CPUThreads(threads=1, reason="OMP_NUM_THREADS=1", chosen=False, variable="OMP_NUM_THREADS")
    for threads, device, words in ((kept, "cpu", "with a lower OMP_NUM_THREADS"),
                                   (one, "cpu", "one thread is the fewest"),
                                   (None, "cuda", "nvidia-smi")):
        s, heard = session(device, threads)
        replay(s)
        assert len(heard.notes) == 1 and words in heard.notes[0], heard.notes


def test_nothing_is_said_beside_a_checkpoint_being_written_or_on_other_ranks():
    writing: Future = Future()  # a background save still running
    s, heard = session(pending_save=SimpleNamespace(future=writing))
    replay(s)
    assert heard.notes == [] and heard.events == []
    writing.set_result(SimpleNamespace(finished=time.perf_counter() - 3600))  # finished long ago: counts again
    replay(s)
    assert len(heard.notes) == 1
    s, heard = session(is_main=False)
    replay(s)
    assert heard.notes == [] and heard.events == []
