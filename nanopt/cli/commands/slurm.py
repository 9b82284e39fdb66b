"""`nanopt slurm`: a SLURM batch script for a run, from its estimate, that requeues itself until the run is done."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import typer
from rich.markup import escape

from nanopt.cli.app import SET_HELP, app, console, load_run_config
from nanopt.cli.helptext import epilog
from nanopt.cli.launch import STOPPED_EARLY
from nanopt.files import replace_file
from nanopt.parsing import check_option

ABOUT = """
Writes RUN/slurm.sbatch and prints the sbatch line that submits it. The job runs `nanopt train RUN` with srun, one
task per GPU (each task a rank, its place from SLURM), its output appended to RUN/slurm-JOBID.out.

The time limit: without --time, the estimate's training time (`nanopt estimate` on --nodes x --gpus-per-node GPUs,
or what `nanopt preflight` measured) with a margin, in one job; with --time, pieces of that length. Five minutes
before a piece's limit SLURM sends USR1 to the script, which passes it on to the ranks: they save one checkpoint
and exit 75, and the script requeues the job (`scontrol requeue`), which resumes from that checkpoint. It is not
requeued once the run is complete (0) or after a mistake to fix (2); after a crash, it is, a few times at most.
When SLURM ends the job itself (scancel, scontrol requeue, a preemption), its SIGTERM makes the ranks save and exit
too, and the script leaves the job to SLURM: a requeued job resumes, a cancelled one stays ended.
"""

EXAMPLES = """
nanopt slurm runs/gpt2-small --nodes 1 --gpus-per-node 8                 # one job, its time from the estimate
nanopt slurm runs/llama-3.2-1b --nodes 4 --gpus-per-node 8 --partition gpu --account proj --time 24:00:00
nanopt slurm runs/demo --nodes 1 --gpus-per-node 2 --cpu                  # two ranks on CPU cores
"""


@app.command("slurm", epilog=epilog(ABOUT, EXAMPLES))
def slurm_command(
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory with model.json and train.json."),
    nodes: int = typer.Option(..., "--nodes", metavar="N", help="Nodes to ask SLURM for."),
    gpus_per_node: int = typer.Option(..., "--gpus-per-node", metavar="N", help="GPUs per node, one rank each."),
    partition: str | None = typer.Option(None, "--partition", metavar="NAME", help="SLURM partition (sbatch -p)."),
    account: str | None = typer.Option(None, "--account", metavar="NAME", help="SLURM account (sbatch -A)."),
    time: str | None = typer.Option(None, "--time", metavar="HH:MM:SS", help="Each job's time limit (the "
                                    "partition's maximum, say): the run is split into requeued pieces of it. "
                                    "Default: the estimate's time with a margin, in one job."),
    gpu: str | None = typer.Option(None, "--gpu", metavar="GPU", help="GPU of the nodes, for the estimate (as "
                                   "`nanopt estimate --gpu`)."),
    cpu: bool = typer.Option(False, "--cpu/--no-cpu", help="Ranks on CPU cores: ask SLURM for no GPUs."),
    sets: list[str] | None = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
) -> None:
    """Write a SLURM job script for a run (time limit from its estimate, requeued until done); print `sbatch`."""
    from nanopt.slurm_script import format_time, job_script, parse_time, plan_job

    check_option("--nodes", nodes, 1, 100_000, "machines to ask for, e.g. --nodes 2")
    check_option("--gpus-per-node", gpus_per_node, 1, 1024, "GPUs on each node, e.g. --gpus-per-node 8")
    time_s = parse_time(time) if time is not None else None
    run = load_run_config(run_dir, sets)
    estimate_s = _estimate_s(run, nodes * gpus_per_node, "cpu" if cpu else gpu)
    plan = plan_job(run.run_dir.resolve(), nodes, gpus_per_node, estimate_s, time_s, partition=partition,
                    account=account, cpu=cpu)
    script = plan.run_dir / "slurm.sbatch"
    replace_file(script, job_script(plan, sys.executable, Path.cwd(), STOPPED_EARLY))  # never through a link
    os.chmod(script, 0o755)
    say = console(stderr=True)
    say.print(escape(f"wrote {script}: {plan.pieces} job piece(s) of {format_time(plan.time_limit_s)} for an estimated "
                     f"{format_time(int(estimate_s))} of training on {nodes} x {gpus_per_node} rank(s)"),
              soft_wrap=True)
    console().print(escape(shlex.join(["sbatch", str(script)])), soft_wrap=True)


def _estimate_s(run: object, gpus: int, gpu: str | None) -> float:
    from nanopt.plan.estimate import EstimateOptions, estimate

    # CPU ranks share this one machine's cores: its estimate is of the machine, whatever the ranks.
    options = EstimateOptions(gpu=gpu) if gpu == "cpu" else EstimateOptions(gpu=gpu, num_gpus=gpus)
    return float(estimate(run, options)["train_seconds"])
