"""The batch script `nanopt slurm` writes: one job that trains a run, in as many requeued pieces as its time needs.

How a piece ends, and what the script does then (nanopt's exit statuses, nanopt.cli.launch):
- some minutes before the time limit SLURM sends USR1 to the script alone (`--signal=B:USR1@LEAD`), which passes
  USR1 on to the ranks through srun; they finish the step, save one checkpoint and exit 75 (STOPPED_EARLY). Not
  SIGTERM: srun answers a SIGTERM by killing the tasks (SIGKILL), with no time to save;
- SLURM ending the job itself (scancel, `scontrol requeue`, a preemption, the time limit) sends SIGTERM to every
  process of the job, the ranks included, which save and exit 75 the same way within KillWait; the script then
  leaves the job to SLURM, which requeues it or not as it was asked (a requeue from the script would bring back a
  job the user cancelled);
- 75: the run is unfinished and its state saved: the script requeues the job (`scontrol requeue`), which starts
  again, under the same job id and into the same log, and resumes from the newest checkpoint;
- 0: the run is complete; 2: a mistake to fix (the line above says which), which a requeue would only meet again;
- anything else (a crash, a lost node): requeued too, but at most MAX_REQUEUES times in all, so that a crash that
  recurs does not hold the queue forever.
The status is the ranks' own, not srun's: srun exits with the highest of its tasks', and once one rank fails it
stops the others (SIGTERM, 143), which would turn a mistake (2) into a crash. Each task keeps its rank's status in
the run directory (STATUSES), and the script reads them as nanopt's own launcher does: a stopped rank is no news, a
crash wins over the lost contact (2) it causes in the others, and otherwise the highest verdict.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from nanopt.errors import ConfigError

SIGNAL_LEAD_S = 300  # the checkpoint is written within this; a large model's save takes a minute or two
RESUME_S = 300  # what each piece spends before its first step: start-up, loading the checkpoint, compiling
MARGIN = 1.2  # the estimate is of the training steps; evaluation and checkpoints add to it
SPARE_REQUEUES = 3  # requeues past the planned pieces, for preemptions and crashes
STATUSES = ".slurm-ranks"  # in the run directory, while a piece runs: each rank's exit status (the script's verdict)


@dataclass(frozen=True)
class JobPlan:
    run_dir: Path  # absolute
    nodes: int
    gpus_per_node: int
    estimate_s: float  # the estimate's training time
    time_limit_s: int
    pieces: int
    partition: str | None = None
    account: str | None = None
    cpu: bool = False  # ranks on CPU cores: no GPUs asked of SLURM

    @property
    def max_requeues(self) -> int:
        return self.pieces - 1 + SPARE_REQUEUES


def plan_job(run_dir: Path, nodes: int, gpus_per_node: int, estimate_s: float, time_s: int | None,
             **options: object) -> JobPlan:
    """The time limit and pieces: the estimate with its margin in one piece, or pieces of --time each."""
    need = estimate_s * MARGIN
    if time_s is None:
        limit = int(math.ceil((need + RESUME_S + SIGNAL_LEAD_S) / 60) * 60)
        return JobPlan(run_dir, nodes, gpus_per_node, estimate_s, limit, 1, **options)  # type: ignore[arg-type]
    useful = time_s - RESUME_S - SIGNAL_LEAD_S
    if useful <= 0:
        raise ConfigError(f"--time {format_time(time_s)} leaves no time to train: each piece needs "
                          f"{format_time(RESUME_S)} to start and stops {format_time(SIGNAL_LEAD_S)} before its limit",
                          "give at least --time 00:15:00")
    pieces = max(1, math.ceil(need / useful))
    return JobPlan(run_dir, nodes, gpus_per_node, estimate_s, time_s, pieces, **options)  # type: ignore[arg-type]


def parse_time(text: str) -> int:
    """SLURM's time forms nanopt takes: HH:MM:SS, MM:SS, D-HH:MM:SS, or minutes."""
    days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = clock.split(":")
    if not (days.isdigit() and 1 <= len(parts) <= 3 and all(p.isdigit() for p in parts)):
        raise ConfigError(f"--time {text!r} is not a SLURM time", "e.g. --time 24:00:00, --time 2-00:00:00")
    if len(parts) == 1:  # minutes, as sbatch reads a bare number
        seconds = int(parts[0]) * 60
    else:
        seconds = sum(int(p) * 60 ** i for i, p in enumerate(reversed(parts)))
    seconds += int(days) * 86400
    if seconds <= 0:
        raise ConfigError(f"--time {text!r} is no time at all", "e.g. --time 24:00:00")
    return seconds


def format_time(seconds: int) -> str:
    days, rest = divmod(int(seconds), 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def sbatch_lines(plan: JobPlan) -> list[str]:
    out = plan.run_dir / "slurm-%j.out"
    lines = [f"--job-name=nanopt-{plan.run_dir.name}", f"--nodes={plan.nodes}",
             f"--ntasks-per-node={plan.gpus_per_node}", f"--time={format_time(plan.time_limit_s)}",
             f"--signal=B:USR1@{SIGNAL_LEAD_S}", "--requeue", "--open-mode=append", f"--output={out}",
             f"--error={out}"]
    if not plan.cpu:
        lines.insert(3, f"--gpus-per-node={plan.gpus_per_node}")
    lines += [f"--partition={plan.partition}"] if plan.partition else []
    lines += [f"--account={plan.account}"] if plan.account else []
    return [f"#SBATCH {_quoted(line)}" for line in lines]


def _quoted(option: str) -> str:
    """sbatch splits a #SBATCH line into words, and refuses the script for a word it does not know (a run directory
    `run x` gave `x`): a value with a space goes in double quotes, which sbatch takes off."""
    name, _, value = option.partition("=")
    if not any(char.isspace() for char in value):
        return option
    if '"' in value or any(char in value for char in "\r\n"):
        raise ConfigError(f"{value!r}: sbatch cannot read this in a #SBATCH line (a double quote or line break with "
                          "spaces)", "rename the run directory (or the --partition / --account value)")
    return f'{name}="{value}"'


BODY = """
# What to do with how the training ended (nanopt's exit statuses): see `nanopt slurm --help`.
set -u
cd {cwd}
# Each rank's own exit status, kept on the run's file system (the nodes share it): once one rank fails, srun stops
# the others with SIGTERM, and its own status, the highest, would be their 143, not the first one's 2 (a mistake).
# The wrapper outlives the signals SLURM sends to every process of the step; the rank takes them itself.
ranks={statuses}/$SLURM_JOB_ID
rm -rf "$ranks" && mkdir -p "$ranks"
srun --kill-on-bad-exit=1 bash -c 'trap : USR1 TERM; "$@"; s=$?; echo $s > "$0/$SLURM_PROCID"; exit $s' "$ranks" \\
  {train} &
step=$!
# USR1, the time limit is near: srun passes USR1 on to every rank as it is (a SIGTERM it would turn into SIGKILL).
trap 'echo "nanopt-slurm: the time limit is near: every rank saves a checkpoint"; kill -USR1 "$step" 2>/dev/null' USR1
# SIGTERM: SLURM is ending the job and has sent SIGTERM to the ranks too; whether the job comes back is SLURM's call.
ended=""
trap 'ended=1; echo "nanopt-slurm: SLURM is ending the job: every rank saves a checkpoint and exits"' TERM
while kill -0 "$step" 2>/dev/null; do wait "$step"; done
wait "$step"
status=$?
# A rank srun stopped (143) is no news. The first status that is no verdict (a crash, a kill) wins, else the highest.
own=$(cat "$ranks"/* 2>/dev/null | grep -vx 143 | sort -un)
rm -rf "$ranks"; rmdir {statuses} 2>/dev/null
if [ -n "$own" ]; then
  crash=$(echo "$own" | grep -vxE '0|2|{stopped}' | head -n 1)
  status=${{crash:-$(echo "$own" | tail -n 1)}}
fi
if [ -n "$ended" ]; then
  echo "nanopt-slurm: exit status $status; not requeued by this script: SLURM ended the job, and requeues it or not"
  exit "$status"
fi
requeues=${{SLURM_RESTART_COUNT:-0}}
case $status in
  0) echo "nanopt-slurm: the run is complete"; exit 0 ;;
  2) echo "nanopt-slurm: not requeued: a mistake to fix (the line above); then sbatch this script again"; exit 2 ;;
  {stopped}) echo "nanopt-slurm: the run is unfinished and saved: requeued ($((requeues + 1)) so far)" ;;
  *) if [ "$requeues" -ge {max_requeues} ]; then
       echo "nanopt-slurm: exit status $status after $requeues requeues: not requeued again"; exit "$status"
     fi
     echo "nanopt-slurm: exit status $status: requeued, to resume from the newest checkpoint" ;;
esac
scontrol requeue "$SLURM_JOB_ID"
exit {stopped}
"""


def job_script(plan: JobPlan, python: str, cwd: Path, stopped_early: int) -> str:
    """`stopped_early`: the status nanopt train exits with once it saved before its end (nanopt.cli.launch)."""
    train = shlex.join([python, "-m", "nanopt", "train", str(plan.run_dir), "--no-live"])
    header = [f"# nanopt slurm: estimated training {format_time(int(plan.estimate_s))}; {plan.pieces} piece(s) of "
              f"at most {format_time(plan.time_limit_s)}, each stopped {SIGNAL_LEAD_S} s before its limit"]
    body = BODY.format(cwd=shlex.quote(str(cwd)), train=train, max_requeues=plan.max_requeues, stopped=stopped_early,
                       statuses=shlex.quote(str(plan.run_dir / STATUSES)))
    return "\n".join(["#!/bin/bash", *sbatch_lines(plan), *header]) + "\n" + body
