"""The GPU table: device names as torch reports them find the right card, peaks are dense, MFU is never > 100%,
and `nanopt estimate --gpu` takes the short names people type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error

from nanopt.hardware import GPUS, detect_gpu, get_gpu
from nanopt.model import flops

# torch.cuda.get_device_name() on each card (the driver's product name), and the table entry it must find.
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA GH200 480GB": "gh200",
    "NVIDIA B200": "b200",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA L4": "l4",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA A100 80GB PCIe": "a100-80gb",
    "NVIDIA A10": "a10",
    "NVIDIA A10G": "a10g",
    "NVIDIA A40": "a40",
    "NVIDIA RTX A6000": "rtx-a6000",
    "NVIDIA RTX 6000 Ada Generation": "rtx-6000-ada",
    "NVIDIA GeForce RTX 3090": "rtx-3090",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "NVIDIA GeForce RTX 5090": "rtx-5090",
    "Tesla T4": "t4",
    "Tesla V100-SXM2-16GB": "v100-16gb",
    "Tesla V100-PCIE-16GB": "v100-16gb",
    "Tesla V100-SXM2-32GB": "v100-32gb",
}

# Cards whose names contain a known card's name but whose peak differs: no MFU beats a wrong one.
NOT_IN_THE_TABLE = ["NVIDIA GeForce RTX 4090 Laptop GPU", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4090 D",
                    "Quadro RTX 6000", "NVIDIA RTX A4000", "NVIDIA GB200", "NVIDIA A30", "Tesla P100-PCIE-16GB",
                    "AMD Instinct MI300X", "NVIDIA A800 80GB PCIe", "NVIDIA H800"]


@pytest.mark.parametrize("device_name", DEVICE_NAMES)
def test_each_device_name_finds_its_own_card(device_name: str):
    gpu = detect_gpu(device_name)
    assert gpu is not None and gpu.key == DEVICE_NAMES[device_name]


@pytest.mark.parametrize("device_name", NOT_IN_THE_TABLE)
def test_a_card_that_is_not_in_the_table_is_not_taken_for_another(device_name: str):
    assert detect_gpu(device_name) is None


def test_every_card_in_the_table_is_detectable():
    assert set(DEVICE_NAMES.values()) == set(GPUS)


def test_the_cards_that_share_a_name_prefix_have_their_own_peaks():
    # Before: an L40S counted as an L4 (MFU 3x too high), an L40 too (1.5x), an H100 NVL as an H100 SXM.
    l4, l40, l40s = (detect_gpu(n) for n in ("NVIDIA L4", "NVIDIA L40", "NVIDIA L40S"))
    assert l40s.bf16_tflops == pytest.approx(3 * l4.bf16_tflops, rel=0.01)
    assert l40.bf16_tflops == pytest.approx(1.5 * l4.bf16_tflops, rel=0.01)
    assert detect_gpu("NVIDIA H100 NVL").bf16_tflops < detect_gpu("NVIDIA H100 80GB HBM3").bf16_tflops
    assert detect_gpu("NVIDIA H100 NVL").memory_bytes > detect_gpu("NVIDIA H100 80GB HBM3").memory_bytes


@pytest.mark.parametrize("key", GPUS)
def test_peaks_are_dense_tensor_core_figures(key: str):
    gpu = GPUS[key]
    # Dense TF32 runs at half the dense BF16 rate on every NVIDIA tensor core since Ampere; a sparse figure or
    # a mixed-up column breaks this ratio. Before Ampere (no bf16, no TF32: T4, V100) fp32 runs on the CUDA cores
    # at an eighth of the fp16 tensor-core rate.
    low, high = (0.45, 0.51) if gpu.bf16 else (0.12, 0.13)
    assert low <= gpu.tf32_tflops / gpu.bf16_tflops <= high
    assert gpu.memory_bytes >= 15 << 30 and gpu.usd_per_hour > 0 and gpu.name.startswith("NVIDIA")


# torch.cuda.get_device_properties(0).total_memory on the cards nanopt was run on, in MiB (the GPU windows'
# preflight records in bench/results.jsonl); nvidia-smi reports 81,559 and 143,771.
MEASURED_MIB = {"h100-sxm": 81_079, "h200": 143_156}


@pytest.mark.parametrize("key", MEASURED_MIB)
def test_the_table_holds_the_memory_the_card_reports(key: str):
    reported = MEASURED_MIB[key] << 20
    assert abs(GPUS[key].memory_bytes - reported) / reported < 0.02, (key, GPUS[key].memory_bytes / 2**30)


def test_estimate_on_the_h200_entry_agrees_with_the_cards_own_memory(cli_in_process):
    # The largest micro-batch the memory model fits, by the table and by the memory torch sees on the card (335
    # when the table said 141 GB), which find-batch's prediction on an H200 is judged against.
    by_table = cli_in_process("estimate", "runs/gpt2-small", "--set", "compile=false", "--gpu", "h200", "--json")
    by_card = cli_in_process("estimate", "runs/gpt2-small", "--set", "compile=false", "--gpu", "h200",
                             "--gpu-memory", "143156MiB", "--json")
    assert by_table.returncode == by_card.returncode == 0, by_table.stderr + by_card.stderr
    table, card = (json.loads(result.stdout)["max_micro_batch"] for result in (by_table, by_card))
    assert abs(table - card) / card < 0.02, (table, card)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_this_machines_gpu_is_detected_with_its_memory():
    name = torch.cuda.get_device_name(0)
    gpu = detect_gpu(name)
    assert gpu is not None, f"{name!r} is not in nanopt.hardware.GPUS"
    total = torch.cuda.get_device_properties(0).total_memory
    # Within 2%: the card keeps a little of its memory (an H100's 80 GiB reads 79.65); a table in GB where the
    # card counts GiB is 7% off, as the H200's 141 GB was (131.3 GiB against 140.4).
    assert abs(gpu.memory_bytes - total) / total < 0.02, (name, gpu.memory_bytes, total)


# ---------------------------------------------------------------------------------------------------- MFU


def test_mfu_above_100_percent_is_flagged_not_returned():
    mfu, mfu_note = flops.mfu, flops.mfu_note
    peak = GPUS["l4"].bf16_tflops * 1e12
    # What an L40S running at 50% of its own peak measured against the L4's peak looked like: 150%.
    tokens_per_s = 1.5 * peak / 6e9
    assert mfu(tokens_per_s, 6e9, 1, peak) is None
    assert mfu_note(mfu(tokens_per_s, 6e9, 1, peak), peak) == flops.IMPLAUSIBLE_MFU
    half = mfu(0.5 * peak / 6e9, 6e9, 1, peak)
    assert half == pytest.approx(0.5) and mfu_note(half, peak) is None
    assert mfu(1.5 * peak / 6e9, 6e9, 2, peak) == pytest.approx(0.75)  # the same rate over two GPUs is plausible
    assert mfu(1e6, 6e9, 1, None) is None and mfu_note(None, None) is None  # no peak: nothing to flag


def test_a_cpu_has_one_peak_for_estimate_preflight_find_batch_profile_and_train(tmp_path, tiny_dataset,
                                                                              cli_in_process, launcher,
                                                                              monkeypatch):
    """estimate --gpu cpu and preflight gave an MFU on the CPU while train and find-batch said "no peak for CPUs":
    every command now measures against the one peak nanopt.devices.device_peak_flops gives, shared by the ranks."""
    from faulthelp import TINY_MODEL
    from trainhelp import HIDE_CUDA, make_run

    from nanopt.devices import device_peak_flops
    from nanopt.hardware import cpu_peak

    if cpu_peak() is None:
        pytest.skip("this machine's /proc/cpuinfo does not give its peak")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    peak, source = device_peak_flops(torch.device("cpu"), "fp32")
    estimate = json.loads(cli_in_process("estimate", "--gpu", "cpu", "--params", "1e6", "--json").stdout)
    assert peak == pytest.approx(estimate["gpu"]["peak_tflops"] * 1e12) and source == estimate["gpu"]["peak_source"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this machine share its cores
    assert device_peak_flops(torch.device("cpu"), "fp32")[0] == pytest.approx(peak / 2)

    run = make_run(tmp_path, tiny_dataset, model=TINY_MODEL, max_steps=3, eval_interval=0, checkpoint_interval=3)
    launcher.train(run, env=HIDE_CUDA)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r.get("kind") == "train"]
    assert trained and all(r["mfu"] is not None and 0 < r["mfu"] <= 1 for r in trained), trained


@pytest.mark.parametrize(("vendor", "flags", "per_cycle"), [
    ("GenuineIntel", "fpu sse avx2 fma avx512f avx512bw", 64),  # two 512-bit FMA units
    ("AuthenticAMD", "fpu sse avx2 fma avx512f avx512bw", 32),  # Zen 4 runs AVX-512 on its 256-bit units
    ("GenuineIntel", "fpu sse avx2 fma", 32),
])
def test_a_cpus_peak_counts_its_widest_vector_units(tmp_path: Path, vendor: str, flags: str, per_cycle: int):
    from nanopt.hardware import cpu_peak

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu MHz\t\t: 2100.000\nflags\t\t: {flags}\n")
    peak = cpu_peak(cpuinfo)
    assert peak is not None and peak.flops_per_cycle == per_cycle
    assert peak.flops == pytest.approx(peak.cores * peak.ghz * 1e9 * per_cycle)


# ----------------------------------------------------------------------------------------- estimate --gpu


@pytest.mark.parametrize(("alias", "key"), [("h100", "h100-sxm"), ("H100", "h100-sxm"), ("a100", "a100-80gb"),
                                            ("a100-80", "a100-80gb"), ("a100-40", "a100-40gb"),
                                            ("4090", "rtx-4090"), ("rtx4090", "rtx-4090"), ("a6000", "rtx-a6000")])
def test_short_names_are_aliases(alias: str, key: str):
    assert get_gpu(alias).key == key


@pytest.mark.parametrize("key", ["l40s", "L40S", "h100_pcie", "H100 NVL", "gh200"])
def test_table_keys_in_any_spelling(key: str):
    assert get_gpu(key).key == key.lower().replace("_", "-").replace(" ", "-")


def test_estimate_with_an_alias_says_which_card_it_assumed(cli_in_process):
    result = cli_in_process("estimate", "runs/gpt2-small", "--gpu", "h100", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # the note goes to stderr: stdout stays one JSON object
    assert report["gpu"]["key"] == "h100-sxm"
    notes = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(notes) == 1 and "h100 -> NVIDIA H100 SXM" in notes[0] and "--gpu h100-pcie" in notes[0], notes

    exact = cli_in_process("estimate", "runs/gpt2-small", "--gpu", "l40s", "--json")
    assert exact.returncode == 0 and exact.stderr.strip() == ""  # a table key needs no note
    assert json.loads(exact.stdout)["gpu"]["peak_tflops"] == GPUS["l40s"].bf16_tflops


def test_an_unknown_gpu_lists_the_table(cli_in_process):
    result = cli_in_process("estimate", "runs/gpt2-small", "--gpu", "l41")
    assert_user_error(result, "unknown GPU 'l41'", "l40s", "--peak-tflops")
