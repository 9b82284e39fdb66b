"""`nanopt profile` on the CPU: the Chrome trace, the summary's keys and shares, the data-wait label, the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clihelp import run_cli
from trainhelp import HIDE_CUDA, make_run

from nanopt.plan.profile_events import CATEGORIES, DATA_WAIT_LABEL, categorize, collect, device_wait

SUMMARY_KEYS = {"run", "device", "precision", "tf32", "compiled", "world_size", "micro_batch_size", "grad_accum",
                "seq_len",
                "tokens_per_step", "schedule", "step_time_s", "busy_s", "idle_s", "busy_share", "idle_share",
                "busy_measure", "cpu_overhead_s", "cpu_overhead_share", "cpu_wait_s", "host_bound", "data_wait_s",
                "data_wait_share", "categories", "kernel_overlap", "streams", "kernels_listed_twice_per_step",
                "notes", "top_ops", "peak_memory_bytes", "peak_memory_measure",
                "tokens_per_s", "mfu", "peak_flops", "peak_source", "compile", "trace", "tensorboard_dir",
                "summary_path"}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> tuple[Path, dict]:
    """One real `nanopt profile --json` of a tiny run with gradient accumulation 2."""
    run = make_run(tmp_path_factory.mktemp("profile"), tiny_dataset, micro_batch_size=2,
                   global_batch_tokens=2 * 32 * 2)
    result = run_cli("profile", run, "--json", "--wait", "1", "--warmup", "1", "--steps", "2", timeout=180,
                     env=HIDE_CUDA)  # the CPU profile this module checks, on a GPU host too
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
    # The CPU's peak, as estimate --gpu cpu works it out (nanopt.devices.device_peak_flops), or said why none.
    assert summary["peak_source"] and (summary["mfu"] is not None) == (summary["peak_flops"] is not None)


def test_shares_are_consistent(profiled):
    run, s = profiled
    assert {c["category"] for c in s["categories"]} == set(CATEGORIES)
    assert sum(c["share"] for c in s["categories"]) == pytest.approx(1.0, abs=1e-6)
    assert 0.0 < s["busy_share"] <= 1.0 and s["busy_share"] + s["idle_share"] == pytest.approx(1.0)
    assert s["busy_s"] + s["idle_s"] == pytest.approx(s["step_time_s"])
    seconds = {c["category"]: c["seconds_per_step"] for c in s["categories"]}
    shares = {c["category"]: c["share"] for c in s["categories"]}
    # A tiny Llama step multiplies matrices, attends, runs AdamW, normalizes and reads batches; one process has
    # nothing to communicate.
    for category in ("matmul", "attention", "optimizer", "elementwise/norm/activation", "data loading/copies"):
        assert seconds[category] > 0 and shares[category] > 0, category
    assert seconds["communication"] == 0 and shares["communication"] == 0
    # A share is its category's part of the operator time, and on the CPU that time is the busy time.
    whole = sum(seconds.values())
    for category in CATEGORIES:
        assert shares[category] == pytest.approx(seconds[category] / whole, rel=1e-9, abs=1e-12)
    if s["busy_share"] < 1.0:  # busy is capped at the step time; below the cap it is exactly the operator time
        assert whole == pytest.approx(s["busy_s"], rel=1e-6)
    # The top operators are the largest first, each counted in its category: together never more than it.
    top = s["top_ops"]
    assert [op["seconds_per_step"] for op in top] == sorted((op["seconds_per_step"] for op in top), reverse=True)
    for category in CATEGORIES:
        listed = sum(op["seconds_per_step"] for op in top if op["category"] == category)
        assert listed <= seconds[category] * (1 + 1e-9) + 1e-12, category
    for op in top:
        assert op["share"] == pytest.approx(op["seconds_per_step"] / whole, rel=1e-9, abs=1e-12)
        # Its own category, or that of the optimizer step, attention call, collective or loader wait it ran in.
        assert op["category"] in {categorize(op["name"]), "optimizer", "attention", "communication",
                                  "data loading/copies"}, op
    # The matrix products dominate a step on the CPU: aten::mm is listed, as matmul. (Not necessarily first: on a
    # loaded machine a preempted aten::linear's own time can exceed it, which made this test fail under load.)
    matmuls = [op["name"] for op in top if op["category"] == "matmul"]
    assert "aten::mm" in matmuls
    # The data wait is the wall time around each loader call, per active step: at least the time the trace recorded
    # inside those labelled calls, and a part of the step. (No upper bound: on a busy machine the wall time around
    # a call can exceed the labelled time several times over.)
    assert s["data_wait_share"] == pytest.approx(s["data_wait_s"] / s["step_time_s"], rel=1e-9)
    events = json.loads((run / "profile" / "trace.json").read_text())["traceEvents"]
    labelled = [e["dur"] * 1e-6 for e in events if e.get("name") == DATA_WAIT_LABEL and e.get("ph") == "X"]
    traced = sum(labelled) / s["schedule"]["active"]
    assert 0 < traced <= s["data_wait_s"] * (1 + 1e-6) + 1e-6 and s["data_wait_s"] < s["step_time_s"]
    # What those calls did inside the label counts as data loading.
    assert seconds["data loading/copies"] >= traced * (1 - 1e-3)


def _profiled_session(device: str, accum: int):
    """What summarize() reads of a training session: a 128-token step of 2 x 32, on `device` ("cpu": fp32 with no
    known peak; "cuda": bf16 on a GPU nanopt has no peak for)."""
    from types import SimpleNamespace

    cuda = device == "cuda"
    train = SimpleNamespace(global_batch_tokens=128, parallelism="ddp", activation_checkpointing=False,
                            micro_batch_size=2, seq_len_stages=None)
    return SimpleNamespace(run=SimpleNamespace(run_dir="runs/x", seq_len=32, train=train), accum=accum,
                           rt=SimpleNamespace(device=torch.device(device), precision="bf16" if cuda else "fp32",
                                              tf32=cuda, world_size=1),
                           flops_per_token=1000, peak_flops=None,
                           peak_source="unknown GPU" if cuda else "no peak for CPUs",
                           memory=SimpleNamespace(peak=lambda: (1 << 30) if cuda else (123 << 20)))


def test_summary_of_known_events():
    """Profiler events with known self times, through the same collection and summary as a real profile: what
    ran inside an optimizer step, an attention call or a loader wait counts for it, and every number per step."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from nanopt.plan.profile import ProfileOptions, summarize

    def event(name: str, self_us: float, parent=None):
        return SimpleNamespace(name=name, self_cpu_time_total=self_us, cpu_parent=parent,
                               device_type=DeviceType.CPU, is_async=False, kernels=[])

    step = event("ProfilerStep#3", 50)  # the glue between operators: idle, not an operator
    adamw = event("Optimizer.step#AdamW.step", 10, step)
    attention = event("aten::scaled_dot_product_attention", 5, step)
    wait = event(DATA_WAIT_LABEL, 7, step)
    events = [step, adamw, event("aten::mul", 30, adamw), attention, event("aten::mm", 40, attention), wait,
              event("aten::index", 20, wait), event("aten::mul", 11, step), event("aten::mm", 60, step)]
    collected = collect(SimpleNamespace(events=lambda: events), on_cuda=False)
    assert sorted(collected["host"]) == sorted([
        ("Optimizer.step#AdamW.step", "optimizer", 10), ("aten::mul", "optimizer", 30),
        ("aten::scaled_dot_product_attention", "attention", 5), ("aten::mm", "attention", 40),
        (DATA_WAIT_LABEL, "data loading/copies", 7), ("aten::index", "data loading/copies", 20),
        ("aten::mul", "elementwise/norm/activation", 11), ("aten::mm", "matmul", 60)])

    session = _profiled_session("cpu", accum=2)
    # Two active steps of 300 and 500 us that waited 20 and 60 us for the loader; 183 us of operators in all.
    s = summarize(session, ProfileOptions(wait=1, warmup=1, active=2, top=3), collected, [300e-6, 500e-6],
                  [20e-6, 60e-6], compiled=False)
    assert s["step_time_s"] == pytest.approx(400e-6)
    assert s["busy_s"] == pytest.approx(91.5e-6) and s["busy_share"] == pytest.approx(91.5 / 400)
    assert s["idle_s"] == pytest.approx(308.5e-6) and s["cpu_overhead_s"] == pytest.approx(308.5e-6)
    assert s["data_wait_s"] == pytest.approx(40e-6) and s["data_wait_share"] == pytest.approx(0.1)
    assert s["tokens_per_s"] == pytest.approx(128 / 400e-6) and s["mfu"] is None
    categories = {c["category"]: (c["seconds_per_step"], c["share"]) for c in s["categories"]}
    expected = {"matmul": 60, "attention": 45, "optimizer": 40, "data loading/copies": 27,
                "elementwise/norm/activation": 11, "communication": 0, "other": 0}
    assert set(categories) == set(expected)
    for category, micros in expected.items():
        assert categories[category] == pytest.approx((micros / 2 * 1e-6, micros / 183)), category
    assert [(op["name"], op["category"]) for op in s["top_ops"]] == [
        ("aten::mm", "matmul"), ("aten::mm", "attention"), ("aten::mul", "optimizer")]
    assert [op["seconds_per_step"] for op in s["top_ops"]] == pytest.approx([30e-6, 20e-6, 15e-6])
    assert [op["share"] for op in s["top_ops"]] == pytest.approx([60 / 183, 40 / 183, 30 / 183])
    assert [op["calls_per_step"] for op in s["top_ops"]] == [0.5, 0.5, 0.5]


def test_cuda_summary_of_known_events_leaves_out_annotations_and_waits():
    """A GPU step as the profiler reports it: the step's ProfilerStep#N annotation mirrored on the GPU timeline from
    its first kernel to its last (and listed among the kernels its CPU event launched), kernels with idle gaps
    between them, and the host blocked in CUDA calls (a .tolist() copy, a stream and a device synchronize).

    Busy is the kernels' and copies' time, not the annotation's span; the waits are not host overhead; so the step,
    whose GPU work is 5x the host's own time, is not host-bound. (Counted as before: busy 100%, overhead 1060 us
    against 1000 us busy, host-bound.)"""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from nanopt.plan.profile import ProfileOptions, summarize

    def cpu(name: str, self_us: float, parent=None, kernels=()):
        return SimpleNamespace(name=name, self_cpu_time_total=self_us, cpu_parent=parent, device_type=DeviceType.CPU,
                               is_async=False, kernels=[SimpleNamespace(name=n, duration=d) for n, d in kernels])

    def gpu(name: str, start: float, end: float, annotation: bool = False):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, is_async=False, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    gemm, add, copy = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "vectorized_elementwise_kernel", "Memcpy DtoH"
    step = cpu("ProfilerStep#3", 50, kernels=[("ProfilerStep#3", 1000)])
    mm = cpu("aten::mm", 30, step, kernels=[(gemm, 200)])
    item = cpu("aten::_local_scalar_dense", 5, step, kernels=[(copy, 10)])
    events = [step, mm, cpu("cudaLaunchKernel", 10, mm), cpu("aten::add", 15, step, kernels=[(add, 100)]), item,
              cpu("cudaMemcpyAsync", 300, item), cpu("cudaStreamSynchronize", 100, item),
              cpu("cudaDeviceSynchronize", 600),
              gpu("ProfilerStep#3", 0, 1000, annotation=True), gpu(gemm, 100, 300), gpu(add, 400, 500),
              gpu(copy, 700, 710)]
    collected = collect(SimpleNamespace(events=lambda: events), on_cuda=True)
    assert sorted(collected["waits"]) == [100, 300, 600]
    assert sorted(collected["intervals"]) == [(100, 300), (400, 500), (700, 710)]
    assert sorted(name for name, _, _ in collected["kernels"]) == sorted([gemm, add, copy])

    session = _profiled_session("cuda", accum=1)
    s = summarize(session, ProfileOptions(active=1, top=5), collected, [1200e-6], [0.0], compiled=False)
    assert s["busy_s"] == pytest.approx(310e-6) and s["idle_s"] == pytest.approx(890e-6)
    assert s["cpu_overhead_s"] == pytest.approx(60e-6) and s["cpu_wait_s"] == pytest.approx(1000e-6)
    assert s["host_bound"] is False
    assert [op["name"] for op in s["top_ops"]] == [gemm, add, copy]
    assert [op["launched_by"] for op in s["top_ops"]] == ["aten::mm", "aten::add", "aten::_local_scalar_dense"]
    shares = {c["category"]: c["share"] for c in s["categories"]}
    assert shares["matmul"] == pytest.approx(200 / 310) and shares["other"] == 0
    # One stream, each kernel once: the kernels' sum is the busy time, and nothing is said about overlap.
    assert s["kernel_overlap"] == pytest.approx(1.0) and s["notes"] == []


def _cuda_summary(events: list, step_us: float) -> dict:
    """summarize() of synthetic CUDA profiler events, for one active step of `step_us` microseconds."""
    from types import SimpleNamespace

    from nanopt.plan.profile import ProfileOptions, summarize

    session = _profiled_session("cuda", accum=1)
    collected = collect(SimpleNamespace(events=lambda: events), on_cuda=True)
    return summarize(session, ProfileOptions(active=1, top=5), collected, [step_us * 1e-6], [0.0], compiled=False)


def _cpu_event(name: str, parent=None, kernels=()):
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    return SimpleNamespace(name=name, self_cpu_time_total=5, cpu_parent=parent, device_type=DeviceType.CPU,
                           is_async=False, kernels=[SimpleNamespace(name=n, duration=d) for n, d in kernels])


def _gpu_event(name: str, start: float, end: float, stream: int = 7):
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, is_async=False, is_user_annotation=False,
                           time_range=SimpleNamespace(start=start, end=end), device_resource_id=stream)


GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
LPNORM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
          "TensorListMetadata<1>, at::native::LpNormFunctor<float, (at::native::NormType)1, float, float>, "
          "float*, int>")


def test_cuda_summary_counts_a_kernel_listed_under_two_operators_once():
    """The first 1B Llama profile on an H100 put 47% of the kernel time in the optimizer while its kernels added up to
    176% of the GPU's busy time: the profiler lists a kernel under every CPU event that carries its correlation id,
    and those ids can collide. The summary counts each kernel once, at its time on the device, says how many
    launches were listed twice, and names the operator that launched each top kernel."""
    from nanopt.plan.profile import short_kernel_name

    clip = _cpu_event("aten::_foreach_norm", kernels=[(LPNORM, 300)])
    # The same 300 us kernel listed under two CPU events: on the GPU timeline it ran once.
    events = [_cpu_event("aten::mm", kernels=[(GEMM, 400)]), clip,
              _cpu_event("aten::linalg_vector_norm", clip, [(LPNORM, 300)]),
              _gpu_event(GEMM, 0, 400), _gpu_event(LPNORM, 400, 700)]
    s = _cuda_summary(events, 800)
    assert s["busy_s"] == pytest.approx(700e-6) and s["streams"] == [7]
    seconds = {c["category"]: c["seconds_per_step"] for c in s["categories"]}
    assert seconds["optimizer"] == pytest.approx(300e-6) and seconds["matmul"] == pytest.approx(400e-6)
    assert s["kernel_overlap"] == pytest.approx(1.0)
    assert s["kernels_listed_twice_per_step"] == 1
    assert len(s["notes"]) == 1 and "listed 1 kernel launches per step under more than one operator" in s["notes"][0]
    top = {op["name"]: op for op in s["top_ops"]}
    assert top[short_kernel_name(LPNORM)]["calls_per_step"] == 1
    assert top[short_kernel_name(LPNORM)]["launched_by"] in {"aten::_foreach_norm", "aten::linalg_vector_norm"}
    assert top[GEMM]["launched_by"] == "aten::mm"
    # The functor that tells one foreach kernel from another is kept, the namespaces around it are not.
    assert short_kernel_name(LPNORM) == ("multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor<float, "
                                         "(NormType)1, float, float>, float*, int>")


def test_cuda_summary_says_when_kernels_on_two_streams_overlap():
    """Kernels on two streams at once (a side stream's copy under a matmul): their times add up to more than the
    busy union, and the summary says its shares are of that sum."""
    copy = "Memcpy HtoD (Pinned -> Device)"
    events = [_cpu_event("aten::mm", kernels=[(GEMM, 400)]), _cpu_event("aten::copy_", kernels=[(copy, 200)]),
              _gpu_event(GEMM, 0, 400, stream=7), _gpu_event(copy, 100, 300, stream=9)]
    s = _cuda_summary(events, 500)
    assert s["busy_s"] == pytest.approx(400e-6) and s["streams"] == [7, 9]
    assert s["kernel_overlap"] == pytest.approx(1.5) and s["kernels_listed_twice_per_step"] == 0
    assert s["notes"] == ["kernels ran on 2 streams at once: their times add up to 150% of the GPU's busy time, and "
                          "the category shares are of that sum, not of the step"]


def test_a_kernel_inside_the_optimizer_step_and_outside_it_is_split_between_them():
    """A generic kernel (an elementwise template) launched inside the optimizer step and outside it: its time on the
    device is split between the two categories as its launches were."""
    add = "vectorized_elementwise_kernel<4, AddFunctor<float>>"
    adamw = _cpu_event("Optimizer.step#AdamW.step")
    events = [adamw, _cpu_event("aten::add_", adamw, [(add, 10)]), _cpu_event("aten::add", kernels=[(add, 10)]),
              _cpu_event("aten::add", kernels=[(add, 10)]), _gpu_event(add, 0, 100), _gpu_event(add, 100, 160),
              _gpu_event(add, 160, 300)]
    s = _cuda_summary(events, 300)
    seconds = {c["category"]: c["seconds_per_step"] for c in s["categories"]}
    assert seconds["optimizer"] == pytest.approx(100e-6) and seconds["elementwise/norm/activation"] == pytest.approx(
        200e-6)
    assert s["notes"] == [] and s["kernels_listed_twice_per_step"] == 0


@pytest.mark.parametrize(("name", "waits"), [
    ("cudaDeviceSynchronize", True), ("cudaStreamSynchronize", True), ("cudaEventSynchronize", True),
    ("cudaMemcpy", True), ("cudaMemcpyAsync", True), ("cuStreamSynchronize", True), ("hipDeviceSynchronize", True),
    ("cudaLaunchKernel", False), ("cudaMemsetAsync", False), ("cudaStreamWaitEvent", False), ("aten::copy_", False),
    ("aten::_local_scalar_dense", False), ("cudaGetDeviceProperties", False)])
def test_which_runtime_calls_are_the_host_waiting_for_the_gpu(name: str, waits: bool):
    assert device_wait(name) is waits


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
    from nanopt.cli.commands.profile import render

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
    # bf16 with compile, as a GPU run is by default (make_run's own runs are fp32 for CPU numbers).
    run = make_run(tmp_path, tiny_dataset, micro_batch_size=4, global_batch_tokens=4 * 32, compile=True,
                   precision="auto")
    result = run_cli("profile", run, "--json", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    s = json.loads(result.stdout)
    assert s["device"] == "cuda" and s["busy_measure"].startswith("GPU")
    assert 0 < s["busy_share"] <= 1
    # The synchronize after each profiled step is the host waiting, counted apart; no annotation is a kernel.
    assert s["cpu_wait_s"] > 0 and not any(op["name"].startswith("ProfilerStep") for op in s["top_ops"])
    assert s["mfu"] is not None or s["peak_source"].startswith("unknown GPU")
    assert s["compile"]["enabled"] and s["compile"]["graphs"] >= 1
    shares = {c["category"]: c["share"] for c in s["categories"]}
    assert shares["matmul"] > 0 and sum(shares.values()) == pytest.approx(1.0)
    # Each kernel once, from the device timeline: on nanopt's one stream the kernels add up to the busy time (the
    # third H100 window's 1B profile summed the profiler's listings to 176% of it), and the top kernels name the
    # operators that launched them.
    kernel_s = sum(c["seconds_per_step"] for c in s["categories"])
    assert kernel_s <= s["busy_s"] * 1.05 and s["kernel_overlap"] <= 1.05, (kernel_s, s["busy_s"], s["streams"])
    assert any(op["launched_by"] for op in s["top_ops"]) and s["kernels_listed_twice_per_step"] >= 0
