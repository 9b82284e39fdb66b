"""`nanopt profile` on the CPU: the Chrome trace, the summary's keys and shares, the data-wait label, the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clihelp import run_cli
from trainhelp import make_run

from nanopt.plan.profile import CATEGORIES, DATA_WAIT_LABEL, categorize

SUMMARY_KEYS = {"run", "device", "precision", "compiled", "world_size", "micro_batch_size", "grad_accum", "seq_len",
                "tokens_per_step", "schedule", "step_time_s", "busy_s", "idle_s", "busy_share", "idle_share",
                "busy_measure", "cpu_overhead_s", "cpu_overhead_share", "host_bound", "data_wait_s",
                "data_wait_share", "categories", "top_ops", "peak_memory_bytes", "peak_memory_measure",
                "tokens_per_s", "mfu", "peak_flops", "peak_source", "compile", "trace", "tensorboard_dir",
                "summary_path"}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> tuple[Path, dict]:
    """One real `nanopt profile --json` of a tiny run with gradient accumulation 2."""
    run = make_run(tmp_path_factory.mktemp("profile"), tiny_dataset, micro_batch_size=2,
                   global_batch_tokens=2 * 32 * 2)
    result = run_cli("profile", run, "--json", "--wait", "1", "--warmup", "1", "--steps", "2", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return run, json.loads(result.stdout)


def test_summary_has_every_key_and_is_saved(profiled):
    run, summary = profiled
    assert SUMMARY_KEYS <= set(summary)
    assert summary["device"] == "cpu" and summary["grad_accum"] == 2 and summary["tokens_per_step"] == 128
    assert summary["schedule"] == {"wait": 1, "warmup": 1, "active": 2}
    assert json.loads((run / "profile" / "summary.json").read_text()) == summary
    assert summary["compile"]["enabled"] is False and summary["compile"]["note"] == "compile off"
    assert summary["tokens_per_s"] > 0 and summary["peak_memory_bytes"] > 0
    assert summary["mfu"] is None and summary["peak_source"]  # no peak FLOP/s for a CPU: said, not invented


def test_shares_are_consistent(profiled):
    _, s = profiled
    assert {c["category"] for c in s["categories"]} == set(CATEGORIES)
    assert sum(c["share"] for c in s["categories"]) == pytest.approx(1.0, abs=1e-6)
    assert 0.0 <= s["data_wait_share"] <= 1.0 and s["data_wait_s"] > 0
    assert 0.0 < s["busy_share"] <= 1.0 and s["busy_share"] + s["idle_share"] == pytest.approx(1.0)
    assert s["busy_s"] + s["idle_s"] == pytest.approx(s["step_time_s"])
    shares = {c["category"]: c["share"] for c in s["categories"]}
    assert shares["matmul"] > 0 and shares["attention"] > 0 and shares["optimizer"] > 0
    assert shares["communication"] == 0  # one process: nothing to communicate
    assert [op["seconds_per_step"] for op in s["top_ops"]] == sorted((op["seconds_per_step"] for op in s["top_ops"]),
                                                                      reverse=True)
    assert {op["name"]: op["category"] for op in s["top_ops"]}.get("aten::mm", "matmul") == "matmul"


def test_trace_is_a_chrome_trace_with_the_data_wait_label(profiled):
    run, summary = profiled
    trace_path = run / "profile" / "trace.json"
    assert summary["trace"] == str(trace_path)
    trace = json.loads(trace_path.read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert DATA_WAIT_LABEL in names and "aten::mm" in names
    # Two active steps of accumulation 2: four labelled loader calls.
    assert sum(1 for e in trace["traceEvents"] if e.get("name") == DATA_WAIT_LABEL and e.get("ph") == "X") == 4
    copies = list((run / "profile" / "tensorboard").glob("rank0.*.pt.trace.json"))
    assert len(copies) == 1 and json.loads(copies[0].read_text()) == trace


def test_tables_render(profiled, capsys, monkeypatch):
    from nanopt.cli.profile import render

    monkeypatch.setenv("COLUMNS", "200")
    render(profiled[1])
    text = capsys.readouterr().out
    for fragment in ("data-loader wait", "CPU in operators (busy)", "compile off", "matmul", "aten::mm"):
        assert fragment in text


@pytest.mark.parametrize(("name", "category"), [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"), ("triton_poi_fused_add_mul_silu_3", "elementwise/norm/activation"),
    ("aten::_foreach_add_", "optimizer"), ("Optimizer.step#AdamW.step", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("gloo:all_reduce", "communication"), (DATA_WAIT_LABEL, "data loading/copies"),
    ("Memcpy HtoD (Pageable -> Device)", "data loading/copies"), ("aten::copy_", "data loading/copies"),
    ("aten::mul", "elementwise/norm/activation"), ("aten::_log_softmax", "elementwise/norm/activation"),
    ("aten::view", "other"), ("autograd::engine::evaluate_function: MmBackward0", "other"),
    ("## Call CompiledFxGraph fwf3czd33blknq2g7yxraorfraszcw32yoyhh55q4rjbs7 ##", "elementwise/norm/activation"),
])
def test_categories_of_real_operator_and_kernel_names(name: str, category: str):
    assert categorize(name) == category


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_profile_with_compile(tmp_path: Path, tiny_dataset: Path):
    run = make_run(tmp_path, tiny_dataset, micro_batch_size=4, global_batch_tokens=4 * 32, compile=True)
    result = run_cli("profile", run, "--json", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    s = json.loads(result.stdout)
    assert s["device"] == "cuda" and s["busy_measure"].startswith("GPU")
    assert 0 < s["busy_share"] <= 1
    assert s["mfu"] is not None or s["peak_source"].startswith("unknown GPU")
    assert s["compile"]["enabled"] and s["compile"]["graphs"] >= 1
    shares = {c["category"]: c["share"] for c in s["categories"]}
    assert shares["matmul"] > 0 and sum(shares.values()) == pytest.approx(1.0)
