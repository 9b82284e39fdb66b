"""Training throughput of nanopt's real step against plain nanoGPT-style baselines, side by side in one run.

    python bench/bench_train.py --run runs/gpt2-small --micro-batch 32            # one H100: the headline
    python bench/bench_train.py --run runs/llama-3.2-1b --micro-batch 8 --accum 1 8
    python bench/bench_train.py --run runs/demo --steps 4 --warmup 1              # CPU smoke run

Every side gets the same model shape, micro-batch, sequence length and random tokens, and is timed after
warm-up (compilation included in warm-up) with a device synchronisation around the timed steps. nanopt runs
its actual `nanopt.train.step.step` (compile per train.json, fused AdamW, bf16 autocast, chunked loss); the
baselines are bench/baseline.py, eager (`nanogpt-eager`) and under torch.compile (`nanogpt-compiled`, the honest
one). Each side is timed at every `--accum` (micro-batches per optimizer step; the presets accumulate, so the
step training runs is the one with accumulation > 1). Prints tokens/s, MFU (PaLM FLOPs against the GPU's dense
peak), peak memory and the ratios, and the exact command, for bench/RESULTS.md. bench/gpu_session.py calls the
functions below.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline import BaselineGPT  # noqa: E402

from nanopt.config import RunConfig, load_run  # noqa: E402
from nanopt.devices import MemoryProbe, device_peak_flops
from nanopt.model.flops import flops_per_token, mfu, mfu_note  # noqa: E402
from nanopt.model.transformer import Transformer  # noqa: E402
from nanopt.runtime import Runtime, init_runtime  # noqa: E402
from nanopt.train.observe.events import Silent  # noqa: E402
from nanopt.train.observe.metrics import MetricsLog  # noqa: E402
from nanopt.train.optim.optimizer import build_optimizer  # noqa: E402
from nanopt.train.parallel.wrap import prepare, resolve_compile  # noqa: E402
from nanopt.train.session import Session, TrainOptions  # noqa: E402
from nanopt.train.state import TrainState  # noqa: E402
from nanopt.train.step import step  # noqa: E402

BASELINES = ("nanogpt-eager", "nanogpt-compiled")


class RandomTokens:
    """A loader of pinned random token batches: measures the step, not the disk."""

    def __init__(self, vocab: int, batch: int, seq: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        if device.type == "cuda":
            data = data.pin_memory()
        self.inputs, self.targets = data[:, :-1], data[:, 1:]
        self.batch, self.step, self.accum = batch, 0, 1  # nanopt's step reads its accumulation from the loader

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets

    # What nanopt's step asks of its loader (nanopt/train/step.py; TrainLoader answers the same), nothing more.

    def plan_ahead(self) -> None:
        """Nothing to read ahead (TrainLoader plans its next read here, before the step's host sync)."""

    def accum_at(self, step: int) -> int:
        """Micro-batches per optimizer step, as nanopt.data.loaders.loader.TrainLoader answers (one process, no
        warmup)."""
        return self.accum

    def samples_in(self, step: int) -> int:
        return self.accum * self.batch

    def tokens_in(self, step: int) -> int:
        """Tokens of optimizer step `step` (TrainLoader: under sequence-length stages, of the step's stage)."""
        return self.samples_in(step) * self.inputs.shape[1]


@dataclasses.dataclass(frozen=True)
class Measured:
    """One side at one accumulation: seconds per optimizer step and the memory the whole side needed."""

    accum: int
    seconds_per_step: float
    tokens_per_step: int
    peak_bytes: int  # nanopt's definition (nanopt.devices.MemoryProbe): reserved + CUDA context; peak RSS on a CPU
    max_allocated_bytes: int | None  # torch.cuda.max_memory_allocated; None on a CPU
    max_reserved_bytes: int | None  # torch.cuda.max_memory_reserved; None on a CPU
    warmup_s: float | None = None  # wall time of the warm-up steps (compilation included), where there were any

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds_per_step


@dataclasses.dataclass
class Side:
    """One side, built and ready to step: its optimizer step, and how to change its accumulation."""

    name: str
    run_step: Callable[[], object]
    set_accum: Callable[[int], None]
    tokens_per_micro: int


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> MemoryProbe:
    """A fresh peak-memory probe, measured as nanopt measures it everywhere (reserved + context on CUDA)."""
    torch._dynamo.reset()  # compiled graphs of the side before may hold on to its buffers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    probe = MemoryProbe(device)
    probe.reset()
    return probe


def time_steps(run_step: Callable[[], object], warmup: int, steps: int, device: torch.device) -> float:
    for _ in range(warmup):
        run_step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        run_step()
    sync(device)
    return (time.perf_counter() - start) / steps


def with_shape(run: RunConfig, micro_batch: int, compile_setting: bool | str | None = None,
               activation_checkpointing: bool | None = None) -> RunConfig:
    """The run at this micro-batch (global batch = one micro-batch; each side sets its own accumulation)."""
    changes = {"micro_batch_size": micro_batch, "global_batch_tokens": micro_batch * run.seq_len}
    if compile_setting is not None:
        changes["compile"] = compile_setting
    if activation_checkpointing is not None:
        changes["activation_checkpointing"] = activation_checkpointing
    return dataclasses.replace(run, train=dataclasses.replace(run.train, **changes))


def measure(side: Side, accums: list[int], warmup: int, steps: int | Callable[[int], int], probe: MemoryProbe,
            device: torch.device) -> list[Measured]:
    """Time `side` at each accumulation. The warm-up (compilation) runs first and is timed apart; then the
    allocator's cache is emptied and the peak reset, so the peak is a training step's, not what compiling and
    Inductor's benchmarking of kernels held; one more untimed step grows the cache back before the timing."""
    side.set_accum(accums[0])
    warmup_s = None
    if warmup:
        start = time.perf_counter()
        for _ in range(warmup):
            side.run_step()
        sync(device)
        warmup_s = time.perf_counter() - start
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    probe.reset()
    if warmup:
        side.run_step()
    timed = []
    for accum in accums:
        side.set_accum(accum)
        count = steps(accum) if callable(steps) else steps
        timed.append((accum, time_steps(side.run_step, 0, count, device)))
    peak = probe.peak()
    allocated = reserved = None
    if device.type == "cuda":
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return [Measured(accum, seconds, accum * side.tokens_per_micro, peak, allocated, reserved, warmup_s)
            for accum, seconds in timed]


def random_token_session(run: RunConfig, rt: Runtime) -> Session:
    """nanopt's training session on random tokens (a RandomTokens loader), as `nanopt train` builds its model,
    optimizer and step; the model built on the device (a 1B model initialized on the CPU first costs seconds)."""
    torch.manual_seed(0)
    with torch.device(rt.device):
        model = Transformer(run.model)
    prepared = prepare(model, rt, run.train)
    optimizer = build_optimizer(prepared.raw, run.train, rt.device)
    loader = RandomTokens(run.model.vocab_size, run.train.micro_batch_size, run.seq_len, rt.device)
    return Session(run=run, rt=rt, opts=TrainOptions(), prepared=prepared, optimizer=optimizer, dataset=None,
                   accum=1, total_steps=10**9, metrics=MetricsLog(run.run_dir, enabled=False), observer=Silent(),
                   flops_per_token=0, peak_flops=None, peak_source="", memory=MemoryProbe(rt.device),
                   train_state=TrainState(loader), price_per_hour=None, price_source="")


def build_nanopt(run: RunConfig, rt: Runtime) -> Side:
    """nanopt's own optimizer step (nanopt.train.step.step) on random tokens, as `nanopt train` runs it."""
    session = random_token_session(run, rt)

    def set_accum(accum: int) -> None:
        session.accum = session.loader.accum = accum

    return Side("nanopt", lambda: step(session), set_accum, run.train.micro_batch_size * run.seq_len)


def build_baseline(run: RunConfig, rt: Runtime, compile_backend: str | None) -> Side:
    """bench/baseline.py: eager when `compile_backend` is None, else under torch.compile with that backend
    ("inductor" on a GPU; "eager" exercises the same path in a CPU smoke run without generating code)."""
    torch.manual_seed(0)
    with torch.device(rt.device):
        model = BaselineGPT(run.model)
    forward = model if compile_backend is None else torch.compile(model, backend=compile_backend)
    fused = rt.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.train.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=fused)
    loader = RandomTokens(run.model.vocab_size, run.train.micro_batch_size, run.seq_len, rt.device)
    accumulation = {"n": 1}

    def one_step() -> None:
        for _ in range(accumulation["n"]):
            x, y = (t.to(rt.device, non_blocking=True) for t in loader.next_batch())
            with rt.autocast():
                loss = forward(x, y)
            (loss / accumulation["n"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def set_accum(accum: int) -> None:
        accumulation["n"] = accum

    name = "nanogpt-eager" if compile_backend is None else "nanogpt-compiled"
    return Side(name, one_step, set_accum, run.train.micro_batch_size * run.seq_len)


def build_side(name: str, run: RunConfig, rt: Runtime, compile_backend: str = "inductor") -> Side:
    """One side by its name: "nanopt" or one of BASELINES."""
    if name == "nanopt":
        return build_nanopt(run, rt)
    return build_baseline(run, rt, None if name == "nanogpt-eager" else compile_backend)


def bench_nanopt(run: RunConfig, rt: Runtime, accums: list[int], warmup: int,
                 steps: int | Callable[[int], int]) -> list[Measured]:
    probe = reset_memory(rt.device)
    return measure(build_nanopt(run, rt), accums, warmup, steps, probe, rt.device)


def bench_side(name: str, run: RunConfig, rt: Runtime, accums: list[int], warmup: int,
               steps: int | Callable[[int], int], compile_backend: str = "inductor") -> list[Measured]:
    """One side by its name, built afresh and measured alone."""
    probe = reset_memory(rt.device)
    return measure(build_side(name, run, rt, compile_backend), accums, warmup, steps, probe, rt.device)


def commit() -> str:
    """bench/COMMIT (written before a tree is shipped to a machine without git), else git, else unknown."""
    shipped = Path(__file__).resolve().parent / "COMMIT"
    if shipped.is_file():
        return shipped.read_text().strip()[:40] or "unknown"
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/gpt2-small", help="run directory whose model.json / train.json to use")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: train.json's micro_batch_size")
    parser.add_argument("--accum", type=int, nargs="+", default=[1],
                        help="micro-batches per optimizer step, each timed (e.g. 1 16)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side; the best counts")
    parser.add_argument("--baselines", nargs="*", choices=BASELINES, default=list(BASELINES),
                        help="baselines to measure beside nanopt (none: nanopt alone)")
    parser.add_argument("--fp8", choices=["off", "head", "all"], default=None,
                        help="nanopt's train.json fp8 (default: the run's); the baselines stay bf16")
    args = parser.parse_args()

    run = load_run(args.run)
    micro_batch = args.micro_batch or run.train.micro_batch_size
    compile_setting = {"auto": run.train.compile, "on": True, "off": False}[args.compile]
    run = with_shape(run, micro_batch, compile_setting)
    if args.fp8 is not None:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, fp8=args.fp8))
    rt = init_runtime(run.train.precision)
    peak_flops, peak_source = device_peak_flops(rt.device, rt.precision)
    fpt = flops_per_token(run.model, run.seq_len)

    device_name = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "CPU"
    compiled = resolve_compile(compile_setting, rt.device)
    print(f"command : python {shlex.join(sys.argv)}")
    print(f"device  : {device_name}, torch {torch.__version__}, commit {commit()}, {rt.precision}, "
          f"nanopt compile {'on' if compiled else 'off'}")
    print(f"shape   : {args.run}, micro-batch {micro_batch} x seq {run.seq_len}, {fpt / 1e9:.3f} GFLOP/token "
          f"(PaLM), MFU against {peak_source}")
    sides = ["nanopt", *args.baselines]
    backend = "inductor" if rt.device.type == "cuda" else "eager"
    # Alternate the sides over several rounds and keep each side's best: on a shared machine the load changes
    # between measurements, and whichever side always ran first would otherwise pay for it.
    best: dict[tuple[str, int], Measured] = {}
    for _ in range(args.rounds):
        for name in sides:
            for m in bench_side(name, run, rt, args.accum, args.warmup, args.steps, backend):
                key = (name, m.accum)
                if key not in best or m.seconds_per_step < best[key].seconds_per_step:
                    best[key] = m
    print(f"rounds  : {args.rounds} alternating rounds of {args.steps} timed steps; best round per side")
    for (name, accum), m in best.items():
        utilization = mfu(m.tokens_per_s, fpt, 1, peak_flops)
        mfu_text = f"{100 * utilization:.1f}%" if utilization is not None else (mfu_note(utilization, peak_flops)
                                                                                 or "-")
        print(f"{name:16s} accum {accum:3d}: {m.tokens_per_s:12,.0f} tokens/s  MFU {mfu_text:>6s}  "
              f"step {1000 * m.seconds_per_step:8.1f} ms  peak memory {m.peak_bytes / 2**30:6.2f} GiB")
    for accum in args.accum:
        for name in args.baselines:
            ratio = best[(name, accum)].seconds_per_step / best[("nanopt", accum)].seconds_per_step
            print(f"ratio    : accum {accum}: nanopt / {name} = {ratio:.2f}x tokens/s")


if __name__ == "__main__":
    main()
