"""The first two steps. preflight: what the machine is, and whether the path every later step takes works at all
(CUDA, the allocator setting, one big matmul as the MFU ceiling, one compiled bf16 step of a tiny nanopt model,
which SDPA kernel nanopt's attention gets), in seconds, failing the call fast when it does not. data: the built-in
corpus tokenized, as a user without `datasets` and without internet would.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import time
import traceback
from typing import Any

from gpusession.isolation import run_nanopt
from gpusession.presets import gpt2_micro, preset
from gpusession.records import Context, append_record, base_record

# What gpu_session.sh exports: the allocator setting, the warnings and logs a first GPU run needs, the NVML check.
ENV_KEYS = ("PYTORCH_ALLOC_CONF", "TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS", "TORCH_LOGS",
            "PYTORCH_NVML_BASED_CUDA_CHECK")
PACKAGES = ("torch", "triton", "numpy", "typer", "rich", "tokenizers", "safetensors", "pytest", "hypothesis",
            "transformers", "datasets", "torchao")
ATTENTION_WORDS = ("scaled_dot_product", "flash", "fmha", "cudnn", "attention", "sdpa")


def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def datasets_importable() -> bool:
    try:
        return importlib.util.find_spec("datasets") is not None
    except (ImportError, ValueError):  # sys.modules["datasets"] = None, as the smoke test blocks it
        return False


def nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "nvidia-smi: not available"


def matmul_tflops(device: Any) -> float:
    """One square matmul, timed: 8192^3 in bf16 on a GPU (the ceiling MFU is read against), small on a CPU."""
    import torch

    n, dtype, reps = (8192, torch.bfloat16, 20) if device.type == "cuda" else (256, torch.float32, 5)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(2):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return round(2 * n**3 * reps / (time.perf_counter() - start) / 1e12, 2)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def expandable_segments(device: Any) -> bool | None:
    """Whether the CUDA allocator really made expandable segments (a torch that ignores PYTORCH_ALLOC_CONF still
    reports it set); None on a CPU or where the snapshot does not say."""
    import torch

    if device.type != "cuda":
        return None
    probe = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    snapshot = torch.cuda.memory._snapshot()
    del probe
    flags = [s["is_expandable"] for s in snapshot.get("segments", []) if "is_expandable" in s]
    if flags:
        return any(flags)
    return (snapshot.get("allocator_settings") or {}).get("expandable_segments")


def compiled_tiny_step(ctx: Context) -> dict[str, Any]:
    """Two optimizer steps of a tiny Llama (grouped-query attention, the chunked loss) through nanopt's real step,
    compiled, in the run's precision (bf16 on a GPU): seconds of the first (compilation) and both losses."""
    from bench_train import build_nanopt, with_shape

    from nanopt.config import load_run
    from nanopt.runtime import init_runtime

    run = with_shape(load_run(preset(ctx, "tiny")), 2, compile_setting=True)
    rt = init_runtime(run.train.precision)
    side = build_nanopt(run, rt)
    start = time.perf_counter()
    first = side.run_step()
    _sync(rt.device)
    compile_s = time.perf_counter() - start
    second = side.run_step()
    losses = [round(float(first[0]), 4), round(float(second[0]), 4)]
    return {"compiled_step_s": round(compile_s, 2), "compiled_losses": losses, "precision": rt.precision,
            "compiled_ok": all(math.isfinite(x) for x in losses)}


def sdpa_kernels(ctx: Context) -> dict[str, list[str]]:
    """The attention operators and kernels one forward and backward of nanopt's Attention ran, at each workload's
    training shape (the SDPA backend depends on the shape and on grouped-query attention)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanopt.config import load_run
    from nanopt.model.transformer import Attention
    from nanopt.runtime import init_runtime

    found = {}
    for name, micro in (("gpt2-small", gpt2_micro(ctx)), ("llama-1b", 2 if ctx.smoke else 8)):
        run = load_run(preset(ctx, name))
        rt = init_runtime(run.train.precision)
        with torch.device(rt.device):
            attention = Attention(run.model, 0)
            x = torch.randn(micro, run.seq_len, run.model.hidden_size, requires_grad=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            with rt.autocast():
                out = attention(x, None)
            out.float().sum().backward()
            _sync(rt.device)
        names = {event.key for event in prof.key_averages()}
        found[name] = sorted(n[:90] for n in names if any(w in n.lower() for w in ATTENTION_WORDS))[:8]
        del attention, x, out
    return found


def step_preflight(ctx: Context) -> None:
    """Fails (and the session stops) when CUDA is missing on a GPU run or the compiled step does not work; every
    other probe that fails is noted in the record and the session goes on."""
    import torch

    record = base_record(ctx, "preflight", "bash bench/gpu_session.sh (preflight)")
    versions = package_versions()
    cuda = torch.cuda.is_available()
    record.update(versions=versions, cuda=torch.version.cuda, datasets_importable=datasets_importable(),
                  cuda_available=cuda, env={key: os.environ.get(key) for key in ENV_KEYS},
                  cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    problems, notes = [], []
    if not ctx.smoke and not cuda:
        problems.append("torch sees no CUDA device")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        props = torch.cuda.get_device_properties(device)
        record.update(device_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}")
    probes = (("expandable_segments", lambda: expandable_segments(device)),
              ("matmul_tflops", lambda: matmul_tflops(device)),
              ("compiled", lambda: compiled_tiny_step(ctx)),
              ("sdpa", lambda: sdpa_kernels(ctx)))
    for key, probe in probes:
        start = time.perf_counter()
        try:
            value = probe()
        except Exception as exc:  # noqa: BLE001 (each probe's failure is a finding; the traceback is in the log)
            traceback.print_exc()
            value = None
            (problems if key == "compiled" else notes).append(f"{key}: {type(exc).__name__}: {exc}"[:300])
        record.update(value if isinstance(value, dict) and key == "compiled" else {key: value})
        print(f"preflight {key}: {value} ({time.perf_counter() - start:.1f} s)", flush=True)
    if record.get("compiled_ok") is False:
        problems.append(f"the compiled step's loss is not finite: {record.get('compiled_losses')}")
    record.update(problems=problems or None, notes=notes or None, status="failed" if problems else "ok")
    lines = [f"{k} {v}" for k, v in versions.items()] + [f"commit {ctx.commit}", f"cuda {torch.version.cuda}",
                                                          json.dumps({k: record.get(k) for k in probes_keys()})]
    (ctx.out / "env.txt").write_text("\n".join(lines) + "\n\n" + nvidia_smi())
    append_record(ctx.out, record)
    if problems:
        raise SystemExit("preflight failed: " + "; ".join(problems))


def probes_keys() -> tuple[str, ...]:
    return ("device_memory_bytes", "capability", "expandable_segments", "matmul_tflops", "compiled_step_s",
            "compiled_losses", "sdpa", "datasets_importable", "problems", "notes")


# ------------------------------------------------------------------------------------------------ data


def step_data(ctx: Context) -> None:
    """The built-in corpus (Python's standard library) tokenized with a tokenizer trained on it: no `datasets`,
    no network. 4M tokens: bf16-vs-fp32's 100 steps of 32 x 1024 read 3.3M."""
    args = ["tokenize", "--out", str(ctx.data), "--max-tokens", "50k" if ctx.smoke else "4M", "--json"]
    if ctx.smoke:
        args += ["--tokenizer-sample-mb", "1"]
    start = time.perf_counter()
    code, stdout = run_nanopt(*args)
    seconds = time.perf_counter() - start
    record = base_record(ctx, "tokenize:stdlib", shlex.join(["nanopt", *args]).replace(str(ctx.data), "data/stdlib"))
    record.update(seconds=round(seconds, 2), datasets_importable=datasets_importable(),
                  status="ok" if code == 0 else f"failed (exit {code})")
    if code == 0:
        summary = json.loads(stdout)
        record.update(vocab_size=summary.get("vocab_size"), train_tokens=summary.get("budget", {}).get("train_tokens"))
    append_record(ctx.out, record)
    if code != 0:
        raise SystemExit(f"tokenize failed (exit {code})")
