"""Checkpoint saves against world size: the old full-gather path and the sharded one, side by side.

    python bench/bench_checkpoint.py             # ~98M parameters, world 1, 2, 4: about 10 minutes on 2 CPU cores
    python bench/bench_checkpoint.py --quick     # ~12M parameters: a smoke run, about 6 minutes
    python bench/bench_checkpoint.py --worlds 1 2 --methods old sync

For each world size (gloo ranks on the CPU, started with torch.multiprocessing; FSDP2 on more than one rank, as
`parallelism: "fsdp"` trains) and each method, a fresh group of processes builds a real training session on a small
dataset (nanopt.train.session.build_session; the dataset only feeds the one step, the model's size is its own), takes
one optimizer step so that AdamW's moments exist, and saves one checkpoint:

- old:   the full-gather path nanopt used before sharded checkpoints: full_model_state + full_optimizer_state
         (a collective: rank 0 receives every tensor), then rank 0 writes the two safetensors files
         (nanopt.train.checkpoint.write_checkpoint);
- sync:  what the training loop now writes, but in the foreground: on several ranks every rank writes the shards it
         holds (nanopt.train.checkpoint.sharded.save of tensors_only(sharded_state(...))) and rank 0 publishes the
         directory; in one process the full layout from the state as it is (write_full, publish; there is nothing to
         gather);
- async: the real background save the loop uses (nanopt.train.checkpoint.save.save_checkpoint), twice: "blocked"
         is how long the training step waits for it, "done" how long until the checkpoint is published (the second
         save's, once the checkpoint process group exists; the first's is in the JSON). blocked / sync is the share of a
         synchronous save the step still pays (target: under 10%).

Memory is measured as nanopt measures it on the CPU (nanopt.runtime's VmRSS / VmHWM helpers): before a save the
kernel's peak is reset to the current resident set, and "RSS +MiB" is how far the peak rose above it during the
save (for async, until the first save is published), on rank 0 and the largest on any rank. "peak MiB" is rank 0's
highest resident set over its whole life (model, step and save). Rank 0's increase should stay flat, or shrink, as
the world grows: no rank holds more than its shards. Each method runs in fresh processes, and tensors of 1 MiB and
more are mapped and unmapped one by one (nanopt.data.tokenize.heap.fix_mmap_threshold), so that memory the model's
construction, the step or another save freed cannot hide what a save needs.

Everything is written under a temporary directory that is removed at the end. Prints a table, then one JSON line
with every figure, for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from nanopt.config import ModelConfig, load_run
from nanopt.data.tokenize.heap import fix_mmap_threshold
from nanopt.data.tokenize.pipeline import build_dataset
from nanopt.devices import _reset_rss_peak, _rss_bytes
from nanopt.model.flops import count_params
from nanopt.rundir import RunDir
from nanopt.runtime import (
    all_gather_object,
    broadcast_object,
    init_runtime,
    new_cpu_group,
    quiesce,
    shutdown,
)
from nanopt.train import checkpoint as ckpt
from nanopt.train.checkpoint import sharded
from nanopt.train.checkpoint.save import save_checkpoint, wait_for_save
from nanopt.train.parallel.wrap import full_model_state, full_optimizer_state, sharded_state, tied_aliases
from nanopt.train.session import build_session
from nanopt.train.step import step

MIB = 2**20
# GPT-2 small's shape with a smaller vocabulary (tied embeddings, as GPT-2): 98,425,344 parameters.
FULL_MODEL = {"architecture": "gpt2", "vocab_size": 16384, "hidden_size": 768, "num_hidden_layers": 12,
              "num_attention_heads": 12, "max_position_embeddings": 1024}
QUICK_MODEL = {"architecture": "gpt2", "vocab_size": 4096, "hidden_size": 384, "num_hidden_layers": 6,
               "num_attention_heads": 6, "max_position_embeddings": 256}
SEQ_LEN = 32  # the one step only has to create AdamW's state: a few tokens per rank are enough
METHODS = ("old", "sync", "async")
_WORDS = ("model", "token", "layer", "shard", "rank", "batch", "write", "read", "save", "step", "loss", "disk",
          "memory", "gather", "every", "the", "a", "of", "to", "and", "checkpoint", "optimizer", "moment", "weight")


# ---------------------------------------------------------------------------------------------- the run


def make_dataset(root: Path) -> Path:
    """A small dataset made by nanopt's own pipeline (a 512-token BPE on ~1 MB of made-up sentences)."""
    import random

    rng = random.Random(0)
    corpus = root / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for number in range(400):
            text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(100, 500)))
            f.write(json.dumps({"text": f"Note {number}. {text}."}) + "\n")
    out = root / "data"
    build_dataset(out, str(corpus), vocab_size=512, val_fraction=0.1, test_fraction=0.1)
    return out


def make_run(root: Path, dataset: Path, model: dict[str, Any], max_world: int) -> Path:
    run = root / "run"
    run.mkdir()
    train = {"data": str(dataset), "micro_batch_size": 1, "global_batch_tokens": SEQ_LEN * max_world,
             "seq_len": SEQ_LEN, "max_steps": 100, "warmup_steps": 1, "eval_interval": 0, "checkpoint_interval": 0,
             "keep_checkpoints": 10, "parallelism": "fsdp", "compile": False, "precision": "fp32", "seed": 1}
    (run / "model.json").write_text(json.dumps(model))
    (run / "train.json").write_text(json.dumps(train))
    return run


# ------------------------------------------------------------------------------------------- measuring


class RssWatch:
    """Rank 0's (any rank's) resident set: the rise of its peak during one save, and its highest over the process's
    life (the kernel's peak is reset before each save, so the life peak is kept here)."""

    def __init__(self) -> None:
        self.life_peak = _rss_bytes("VmHWM")
        self.before = 0

    def start(self) -> None:
        self.life_peak = max(self.life_peak, _rss_bytes("VmHWM"))
        _reset_rss_peak()
        self.before = _rss_bytes("VmRSS")

    def rise(self) -> int:
        peak = _rss_bytes("VmHWM")
        self.life_peak = max(self.life_peak, peak)
        return peak - self.before


def save_old(s: Any, watch: RssWatch) -> dict[str, float]:
    """The full-gather save nanopt made before sharded checkpoints (its save_checkpoint, minus the metrics line)."""
    watch.start()
    started = time.perf_counter()
    model_state = full_model_state(s.prepared)
    optimizer_state = full_optimizer_state(s.prepared, s.optimizer)
    path = None
    if s.rt.is_main:
        tied = tied_aliases(s.prepared.raw)  # the same names the old save's storage comparison found
        weights = {k: v for k, v in model_state.items() if k not in tied}
        path = ckpt.write_checkpoint(s.run.run_dir, s.state.step, weights, optimizer_state, _meta(s, tied),
                                     tokenizer=s.dataset.tokenizer_path)
    path = broadcast_object(s.rt, path)  # every rank learns the outcome, as the old save did
    return {"seconds": time.perf_counter() - started, "rss_rise": watch.rise(), "bytes": _size(path)}


def save_sync(s: Any, watch: RssWatch) -> dict[str, float]:
    """The checkpoint the training loop writes now, written while the step waits."""
    group = new_cpu_group(s.rt)  # made once per run by the loop: outside the timing
    watch.start()
    started = time.perf_counter()
    state = sharded_state(s.prepared, s.optimizer)
    meta = {**_meta(s, tied_aliases(s.prepared.raw)), "optimizer_param_groups": state["optimizer"]["param_groups"]}
    if not s.rt.distributed:
        groups = ckpt.write_full(s.run.run_dir, s.state.step, ckpt.begin(s.run.run_dir, s.state.step),
                                 state["model"], state["optimizer"])
        path = ckpt.publish(s.run.run_dir, s.state.step, {**meta, "layout": ckpt.FULL,
                                                           "optimizer_param_groups": groups},
                            tokenizer=s.dataset.tokenizer_path)
    else:
        tmp = broadcast_object(s.rt, ckpt.begin(s.run.run_dir, s.state.step) if s.rt.is_main else None)
        sharded.save(sharded.tensors_only(state), tmp, group)
        path = None
        if s.rt.is_main:
            path = ckpt.publish(s.run.run_dir, s.state.step, {**meta, "layout": ckpt.SHARDED},
                                tokenizer=s.dataset.tokenizer_path)
        path = broadcast_object(s.rt, path)
    return {"seconds": time.perf_counter() - started, "rss_rise": watch.rise(), "bytes": _size(path)}


def save_async(s: Any, watch: RssWatch) -> dict[str, float]:
    """nanopt.train.checkpoint.save.save_checkpoint as the loop calls it, twice (the first also makes the checkpoint
    process group); each time the main thread then waits for the background work, as the next save would."""
    watch.start()
    first_blocked, first_done = _one_async_save(s)
    rise = watch.rise()
    s.state.step += 1
    blocked, done = _one_async_save(s)
    return {"blocked": blocked, "done": done, "first_blocked": first_blocked, "first_done": first_done,
            "rss_rise": rise, "bytes": _size(RunDir(s.run.run_dir).step_dir(s.state.step) if s.rt.is_main else None)}


def _one_async_save(s: Any) -> tuple[float, float]:
    """(seconds the step was blocked, seconds until this rank's part (rank 0: the published checkpoint) was done)."""
    started = time.perf_counter()
    blocked = save_checkpoint(s)
    s.pending_save.future.result()
    done = time.perf_counter() - started
    wait_for_save(s)  # the collective that tells every rank the outcome
    return blocked, done


def _meta(s: Any, tied: dict[str, str]) -> dict[str, Any]:
    return {"world_size": s.rt.world_size, "tied": tied, "tokenizer_sha256": s.dataset.tokenizer_sha256,
            "eos_id": s.dataset.eos_id}


def _size(path: Path | None) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path is not None else 0


SAVES = {"old": save_old, "sync": save_sync, "async": save_async}


def worker(rank: int, world: int, port: int, run_dir: str, method: str, threads: int, results: Any) -> None:
    """One rank: a real session, one optimizer step, one measured save; rank 0 reports every rank's figures."""
    # Written, not read: nanopt.runtime.ranks() reads them, as under torchrun.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    # Tensors of 1 MiB and more get their own mappings, returned to the system when freed: otherwise glibc serves a
    # save from memory that the model's construction or the step freed, and the rise would depend on that history.
    fix_mmap_threshold()
    watch = RssWatch()
    rt = init_runtime("fp32")
    s = build_session(load_run(run_dir), rt)
    step(s)
    figures = SAVES[method](s, watch)
    figures["life_peak"] = watch.life_peak
    every = all_gather_object(rt, figures)
    if rt.is_main:
        results.put(every)
    quiesce(rt)
    shutdown(rt)


def launch(world: int, run_dir: Path, method: str, threads: int) -> list[dict[str, float]]:
    """Every rank's figures for one method at one world size, from fresh processes."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(worker, args=(world, _free_port(), str(run_dir), method, threads, results), nprocs=world,
                       start_method="spawn")
    every = results.get()
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return every


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------------------------------------- report


def summarize(world: int, figures: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """One row: rank 0's figures and the largest over all ranks."""
    row: dict[str, Any] = {"world": world}
    for method, ranks in figures.items():
        zero = ranks[0]
        row[method] = {key: round(value, 4) if isinstance(value, float) else value for key, value in zero.items()}
        row[method]["max_rss_rise"] = max(r["rss_rise"] for r in ranks)
        row[method]["max_life_peak"] = max(r["life_peak"] for r in ranks)
    if "sync" in row and "async" in row:
        row["blocked_share"] = round(row["async"]["blocked"] / row["sync"]["seconds"], 4)
    return row


COLUMNS = ("world", "old s", "old RSS +MiB (max)", "sync s", "sync RSS +MiB (max)", "async blocked s",
           "async done s", "async RSS +MiB", "blocked/sync", "rank-0 peak MiB")


def table_row(row: dict[str, Any]) -> list[str]:
    def get(method: str, key: str, scale: float = 1.0, spec: str = ".2f") -> str:
        return format(row[method][key] / scale, spec) if method in row else "-"

    def rss(method: str) -> str:
        return f"{get(method, 'rss_rise', MIB, '.0f')} ({get(method, 'max_rss_rise', MIB, '.0f')})"

    peaks = [row[m]["life_peak"] for m in METHODS if m in row]
    share = f"{100 * row['blocked_share']:.1f}%" if "blocked_share" in row else "-"
    return [str(row["world"]), get("old", "seconds"), rss("old"), get("sync", "seconds"), rss("sync"),
            get("async", "blocked", spec=".3f"), get("async", "done"), get("async", "rss_rise", MIB, ".0f"), share,
            f"{max(peaks) / MIB:.0f}"]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~12M-parameter model instead of ~98M")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default: 1 2 4)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads per rank (default: the machine's cores shared among the ranks)")
    args = parser.parse_args()
    if any(w < 1 for w in args.worlds):
        parser.error("--worlds: every world size must be at least 1")

    model = QUICK_MODEL if args.quick else FULL_MODEL
    params = count_params(ModelConfig(**model)).total
    cores, revision = os.cpu_count() or 1, commit()
    print(f"command : python {shlex.join(sys.argv)}")
    print(f"machine : {cores} CPU cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"torch {torch.__version__}, commit {revision}")
    print(f"model   : {model['architecture']} {model['num_hidden_layers']} x {model['hidden_size']}, vocab "
          f"{model['vocab_size']}: {params:,} parameters (fp32 weights {4 * params / MIB:,.0f} MiB, AdamW moments "
          f"{8 * params / MIB:,.0f} MiB)")
    rows, summary = [], []
    with tempfile.TemporaryDirectory(prefix="nanopt-bench-checkpoint-") as tmp:
        root = Path(tmp)
        run_dir = make_run(root, make_dataset(root), model, max(args.worlds))
        for world in args.worlds:
            threads = args.threads or max(1, cores // world)
            figures = {}
            for method in args.methods:
                began = time.perf_counter()
                figures[method] = launch(world, run_dir, method, threads)
                print(f"  world {world} {method:5s}: {time.perf_counter() - began:.0f} s with start-up", flush=True)
            summary.append(summarize(world, figures))
            rows.append(table_row(summary[-1]))
    print()
    print_table(rows)
    print("RSS +MiB: rank 0's peak resident set during the save above the set before it (largest on any rank);")
    print("async: the second save (the first also creates the checkpoint process group; both are in the JSON).")
    print(json.dumps({"params": params, "model": model, "cores": cores, "load_average": os.getloadavg(),
                      "torch": torch.__version__, "commit": revision, "rows": summary}))


if __name__ == "__main__":
    main()
