"""What every record carries, how it is written (OUT/results.jsonl, one line the moment it exists), the commit it
names, and the compact lines the parent prints on stdout: on the GPU machine only OUT (at most 8 files) and the last
12,000 characters of stdout come back, so the figures must survive in either alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = "results.jsonl"
LOG = "session.log"
COMMIT_FILE = REPO / "bench" / "COMMIT"  # written before the tree is shipped: the GPU machine gets no .git
REQUIRED_KEYS = ("date", "gpu", "torch", "commit", "command", "workload", "tokens_per_s", "mfu",
                 "baseline_tokens_per_s", "peak_memory_gib", "predicted_memory_gib", "baseline", "allow_tf32",
                 "status")
COMMON_KEYS = ("date", "gpu", "torch", "commit", "command")  # the same on every line: printed once, not per record
# Left off stdout's line too (they are in results.jsonl): constant within a call, or read off the others.
QUIET_KEYS = (*COMMON_KEYS, "workload", "status", "smoke", "alloc_conf", "seq_len", "preset_accumulation",
              "precision", "compiled", "resident_before_gib", "alone", "tolerance", "projection")
GIB = 2**30
MAX_LINE = 400


@dataclasses.dataclass(frozen=True)
class Context:
    """What every step's process knows: where to write, the shapes to use, and the fields every record carries."""

    out: Path
    work: Path  # scratch: datasets, run directories, traces, the graph counts
    smoke: bool
    commit: str
    gpu: str | None = None  # the parent's answer, from nvidia-smi: the parent never touches CUDA itself

    @property
    def data(self) -> Path:
        return self.work / "stdlib"

    def graphs_dir(self, step: str) -> Path:
        return self.work / "graphs" / step


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def base_record(ctx: Context, workload: str, command: str) -> dict[str, Any]:
    """The keys every line of results.jsonl has, measurement keys null until a step fills them; in a step's
    process (it reads this process's TF32 setting). It never initializes CUDA: a step that forks `nanopt` processes
    records between the forks, and a process forked after CUDA was initialized cannot use it; the device's name is
    torch's where this process already uses the device, else nvidia-smi's (the parent's)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_initialized() else ctx.gpu
    record = plain_record(ctx, workload, command, "ok")
    record.update(gpu=gpu, torch=torch.__version__, allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                  alloc_conf=os.environ.get("PYTORCH_ALLOC_CONF"))
    return record


def plain_record(ctx: Context, workload: str, command: str, status: str) -> dict[str, Any]:
    """base_record without importing torch: what the parent (which only schedules and kills) writes."""
    record: dict[str, Any] = {key: None for key in REQUIRED_KEYS}
    record.update(date=now(), gpu=ctx.gpu, torch=torch_version(), commit=ctx.commit, command=command,
                  workload=workload, status=status, smoke=ctx.smoke)
    return record


def torch_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001 (any failure: unknown)
        return None


def append_record(out: Path, record: dict[str, Any]) -> None:
    """One line, flushed at once: a step killed later keeps what it measured so far (the parent prints it)."""
    with open(out / RESULTS, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(out: Path) -> list[dict[str, Any]]:
    return read_jsonl(out / RESULTS)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file (results.jsonl, a run's metrics.jsonl); a line torn by a kill is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill
    return records


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


# ---------------------------------------------------------------------------------------------- the commit


def read_commit(given: str | None) -> tuple[str, str]:
    """(the commit measured, where it came from): --commit, else bench/COMMIT (written before shipping the tree),
    else git, else .git/HEAD read by hand, else "unknown". A bench/COMMIT that disagrees with git is still used
    (it is what was shipped) and said so."""
    if given:
        return given, "--commit"
    shipped = _commit_file()
    git = _git_head()
    if shipped:
        sha = shipped.split("-")[0]
        if git and not (sha.startswith(git) or git.startswith(sha)):
            # Either may be the stale one: a copied tree's .git can lag the commit that bench/COMMIT names (the
            # second window's did), or bench/COMMIT was written before the last commit.
            return shipped, (f"bench/COMMIT (WARNING: git here says {git}; if bench/COMMIT was written before the "
                             "last commit, its records name the wrong one)")
        return shipped, "bench/COMMIT"
    if git:
        return git, "git"
    return "unknown", ("WARNING: no bench/COMMIT, no git: every record says commit 'unknown'. Before shipping the "
                       "tree: git rev-parse --short HEAD > bench/COMMIT")


def _commit_file() -> str | None:
    try:
        with open(COMMIT_FILE, "rb") as f:
            text = f.read(200).decode("ascii", errors="replace").strip().splitlines()
    except OSError:
        return None
    first = text[0].strip() if text else ""
    return first if re.fullmatch(r"[0-9a-f]{4,40}(-dirty)?", first) else None


def _git_head() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=10)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:  # no git program: .git/HEAD by hand (a worktree's .git is a file naming its git directory)
        git = REPO / ".git"
        if git.is_file():
            git = (REPO / git.read_text().strip().removeprefix("gitdir: ")).resolve()
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            head = (git / head[5:]).read_text().strip()
        return head[:7] or None
    except OSError:
        return None


# -------------------------------------------------------------------------------------------- on stdout


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def compact(record: dict[str, Any]) -> str:
    """One line: the workload, its status, and every key that is set except the quiet ones; numbers before the
    dicts and lists (a long one is what the line's end cuts)."""
    shown = [(key, value) for key, value in record.items() if value is not None and key not in QUIET_KEYS]
    shown.sort(key=lambda item: isinstance(item[1], dict | list))
    fields = [f"{key}={_short(value)}" for key, value in shown]
    line = f"R {record.get('workload')} [{record.get('status')}] " + " ".join(fields)
    return line if len(line) <= MAX_LINE else line[:MAX_LINE - 3] + "..."


HEADLINE_KEYS = ("matmul_tflops", "compiled_step_s", "sdpa", "side", "baseline", "accumulation", "micro_batch",
                 "activation_checkpointing", "tokens_per_s",
                 "mfu", "ratio", "ratio_spread", "peak_memory_gib", "predicted_memory_gib", "predicted_error",
                 "predicted_micro_batch", "seconds", "compile_s", "reference", "early_max_abs_diff",
                 "late_rel_diff", "within_tolerance", "max_abs_diff_after_resume", "first_step_diff",
                 "nondeterminism_floor", "passed", "failed",
                 "speedup", "late_mean_loss", "loss_diff", "speed_ratio", "on_off_ratio", "health_share",
                 "idle_share", "cpu_overhead_share", "graphs", "budget_s", "step_ratio", "peak_ratio")
STATUS_CHARS = 60  # of a record's status in the summary's figures


def headline(record: dict[str, Any]) -> str:
    """The figures of a record that a reader of the summary needs, in one short line."""
    fields = [f"{key}={_short(record[key])}" for key in HEADLINE_KEYS if record.get(key) is not None]
    status = str(record.get("status", "?"))  # a refusal's whole line is in the R line and results.jsonl
    status = status if len(status) <= STATUS_CHARS else status[:STATUS_CHARS - 3] + "..."
    return f"{record.get('workload', '?'):26s} {status:10s} " + " ".join(fields)
