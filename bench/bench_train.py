"""Training throughput of nanopt's real step against a plain nanoGPT-style baseline, side by side in one run.

    python bench/bench_train.py --run runs/gpt2-small --micro-batch 32            # one H100: the headline
    python bench/bench_train.py --run runs/llama-3.2-1b --micro-batch 8
    python bench/bench_train.py --run runs/demo --steps 4 --warmup 1              # CPU smoke run

Both sides get the same model shape, micro-batch, sequence length and random tokens, and are timed after
warm-up (compilation included in warm-up) with a device synchronisation around the timed steps. nanopt runs
its actual `nanopt.train.loop.step` (compile per train.json, fused AdamW, bf16 autocast, chunked loss); the baseline
is bench/baseline.py. Prints tokens/s, MFU (PaLM FLOPs against the GPU's dense peak), peak memory and the ratio,
and the exact command, for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline import BaselineGPT  # noqa: E402

from nanopt.config import load_run  # noqa: E402
from nanopt.model.flops import flops_per_token, mfu, mfu_note  # noqa: E402
from nanopt.model.transformer import Transformer  # noqa: E402
from nanopt.runtime import MemoryProbe, device_peak_flops, init_runtime  # noqa: E402
from nanopt.train.events import Silent  # noqa: E402
from nanopt.train.metrics import MetricsLog  # noqa: E402
from nanopt.train.optim import build_optimizer  # noqa: E402
from nanopt.train.parallel import prepare, resolve_compile  # noqa: E402
from nanopt.train.session import Session, TrainOptions  # noqa: E402
from nanopt.train.state import TrainState  # noqa: E402
from nanopt.train.step import step  # noqa: E402


class RandomTokens:
    """A loader of pinned random token batches: measures the step, not the disk."""

    def __init__(self, vocab: int, batch: int, seq: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        if device.type == "cuda":
            data = data.pin_memory()
        self.inputs, self.targets = data[:, :-1], data[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> MemoryProbe:
    """A fresh peak-memory probe, measured as nanopt measures it everywhere (reserved + context on CUDA)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    probe = MemoryProbe(device)
    probe.reset()
    return probe


def time_steps(run_step, warmup: int, steps: int, device: torch.device) -> float:
    for _ in range(warmup):
        run_step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        run_step()
    sync(device)
    return (time.perf_counter() - start) / steps


def bench_nanopt(run, rt, args) -> tuple[float, int]:
    probe = reset_memory(rt.device)
    torch.manual_seed(0)
    prepared = prepare(Transformer(run.model), rt, run.train)
    optimizer = build_optimizer(prepared.raw, run.train, rt.device)
    loader = RandomTokens(run.model.vocab_size, args.micro_batch, run.seq_len, rt.device)
    session = Session(run=run, rt=rt, opts=TrainOptions(), prepared=prepared, optimizer=optimizer, dataset=None,
                      accum=1, total_steps=10**9, metrics=MetricsLog(run.run_dir, enabled=False), observer=Silent(),
                      flops_per_token=0, peak_flops=None, peak_source="", memory=probe,
                      train_state=TrainState(loader))
    seconds = time_steps(lambda: step(session), args.warmup, args.steps, rt.device)
    peak = probe.peak()
    return seconds, peak


def bench_baseline(run, rt, args) -> tuple[float, int]:
    probe = reset_memory(rt.device)
    torch.manual_seed(0)
    model = BaselineGPT(run.model).to(rt.device)
    fused = rt.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.train.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=fused)
    loader = RandomTokens(run.model.vocab_size, args.micro_batch, run.seq_len, rt.device)

    def one_step() -> None:
        x, y = (t.to(rt.device, non_blocking=True) for t in loader.next_batch())
        with rt.autocast():
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = time_steps(one_step, args.warmup, args.steps, rt.device)
    peak = probe.peak()
    return seconds, peak


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/gpt2-small", help="run directory whose model.json / train.json to use")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: train.json's micro_batch_size")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side; the best counts")
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()

    run = load_run(args.run)
    args.micro_batch = args.micro_batch or run.train.micro_batch_size
    compile_setting = {"auto": run.train.compile, "on": True, "off": False}[args.compile]
    train_cfg = dataclasses.replace(run.train, micro_batch_size=args.micro_batch, compile=compile_setting,
                                    global_batch_tokens=args.micro_batch * run.seq_len)
    run = dataclasses.replace(run, train=train_cfg)
    rt = init_runtime(run.train.precision)
    peak_flops, peak_source = device_peak_flops(rt.device, rt.precision)
    fpt = flops_per_token(run.model, run.seq_len)
    tokens = args.micro_batch * run.seq_len

    device_name = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "CPU"
    compiled = resolve_compile(compile_setting, rt.device)
    print(f"command : python {shlex.join(sys.argv)}")
    print(f"device  : {device_name}, torch {torch.__version__}, commit {commit()}, {rt.precision}, "
          f"compile {'on' if compiled else 'off'} (nanopt only; the baseline is eager)")
    print(f"shape   : {args.run}, micro-batch {args.micro_batch} x seq {run.seq_len}, {fpt / 1e9:.3f} GFLOP/token "
          f"(PaLM), MFU against {peak_source}")
    sides = {"nanopt": bench_nanopt} if args.skip_baseline else {"nanopt": bench_nanopt, "baseline": bench_baseline}
    # Alternate the sides over several rounds and keep each side's best: on a shared machine the load changes
    # between measurements, and whichever side always ran first would otherwise pay for it.
    rounds: dict[str, list[tuple[float, int]]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, bench in sides.items():
            rounds[name].append(bench(run, rt, args))
    results = {name: (min(r[0] for r in runs), max(r[1] for r in runs)) for name, runs in rounds.items()}
    print(f"rounds  : {args.rounds} alternating rounds of {args.steps} timed steps; best round per side")
    for name, (seconds, peak) in results.items():
        tps = tokens / seconds
        utilization = mfu(tps, fpt, 1, peak_flops)
        mfu_text = f"{100 * utilization:.1f}%" if utilization is not None else (mfu_note(utilization, peak_flops)
                                                                                 or "-")
        print(f"{name:9s}: {tps:12,.0f} tokens/s  MFU {mfu_text:>6s}  step {1000 * seconds:8.1f} ms  "
              f"peak memory {peak / 2**30:6.2f} GiB")
    if "baseline" in results:
        print(f"ratio    : nanopt / baseline = {results['baseline'][0] / results['nanopt'][0]:.2f}x tokens/s")


if __name__ == "__main__":
    main()
