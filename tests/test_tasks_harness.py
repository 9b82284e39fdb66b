"""The differential test: a tiny trained nanopt model, exported, scored by nanopt and by lm-evaluation-harness's
`hf` model on the same local task data (the harness's own task files, with only the dataset pointed at a
fixture), agrees on every choice's log-likelihood (fp32, 1e-4) and on acc and acc_norm for every task type:
multiple choice, partial scoring (Winogrande) and the last word (LAMBADA). Skipped where lm_eval (with
accelerate) is not installed: `pip install lm_eval accelerate`."""

from __future__ import annotations

from pathlib import Path

import pytest
from faulthelp import Launcher
from taskdata import RECORDS, write_task_data
from trainhelp import make_run

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

HARNESS_TASKS = {"hellaswag": "hellaswag/hellaswag.yaml", "arc_easy": "arc/arc_easy.yaml",
                 "arc_challenge": "arc/arc_challenge.yaml", "piqa": "piqa/piqa.yaml",
                 "lambada_openai": "lambada/lambada_openai.yaml", "winogrande": "winogrande/default.yaml"}


def harness_results(export: Path, task_data: Path, yaml_dir: Path) -> dict:
    """lm_eval.simple_evaluate on the `hf` model; each task is the harness's YAML with the dataset replaced."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    yaml_dir.mkdir()
    for name, harness_yaml in HARNESS_TASKS.items():
        data = task_data / f"{name}.jsonl"
        splits = "".join(f"    {split}: {data}\n" for split in ("train", "validation", "test"))
        (yaml_dir / f"local_{name}.yaml").write_text(
            f"include: {tasks_dir / harness_yaml}\ntask: local_{name}\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n{splits}")
    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32",
                                   tasks=[f"local_{n}" for n in HARNESS_TASKS], device="cpu", batch_size=4,
                                   task_manager=TaskManager(include_path=str(yaml_dir)), log_samples=True)


def nanopt_scores(run: Path, task_data: Path) -> dict:
    import torch

    from nanopt.evaluate.tasks.catalog import TASKS, render
    from nanopt.evaluate.tasks.metrics import task_metrics
    from nanopt.evaluate.tasks.scorer import encode_pairs, score_requests
    from nanopt.evaluate.tasks.sources import load_records
    from nanopt.evaluate.trained import load_model, open_trained
    from nanopt.runtime import Runtime

    trained = open_trained(run, for_loss=False)
    model = load_model(trained, torch.device("cpu"))
    rt = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1, precision="fp32")
    positions = trained.run.model.max_position_embeddings
    out = {}
    for name, task in TASKS.items():
        examples = render(task, load_records(task, task_data, None)[0], name)
        requests = encode_pairs(trained.tokenizer(), [p for e in examples for p in e.pairs], trained.eos_id,
                                positions)
        scores = score_requests(model, rt, requests, 3, positions)
        out[name] = (scores, task_metrics(task, examples, scores))
    return out


@pytest.mark.slow
def test_nanopt_agrees_with_lm_evaluation_harness(tmp_path: Path, tiny_dataset: Path, launcher: Launcher,
                                                  cli_in_process):
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=4, eval_interval=0, checkpoint_interval=4)
    launcher.train(run)
    assert cli_in_process("export", run, "--out", tmp_path / "hf").returncode == 0
    task_data = write_task_data(tmp_path / "tasks")
    harness = harness_results(tmp_path / "hf", task_data, tmp_path / "yaml")
    ours = nanopt_scores(run, task_data)
    for name in HARNESS_TASKS:
        scores, metrics = ours[name]
        samples = sorted(harness["samples"][f"local_{name}"], key=lambda s: s["doc_id"])
        assert len(samples) == len(RECORDS[name]) == metrics["n"]
        theirs = [resp[0] for s in samples for resp in s["resps"]]  # (log-likelihood, is_greedy) per choice
        assert len(theirs) == len(scores)
        for (ll, greedy), mine in zip(theirs, scores, strict=True):
            assert mine.loglikelihood == pytest.approx(ll, abs=1e-4), name
            assert mine.greedy == greedy, name
        result = harness["results"][f"local_{name}"]
        assert metrics["acc"]["value"] == result["acc,none"], name
        if "acc_norm,none" in result:
            assert metrics["acc_norm"]["value"] == result["acc_norm,none"], name
        if name == "lambada_openai":
            assert metrics["perplexity"] == pytest.approx(result["perplexity,none"], rel=1e-4)


@pytest.mark.parametrize("line", [b'{"goal": "' + b"x" * (2 << 20) + b'"}', b"{not json", b'{"label": Infinity}x'])
def test_the_harness_gets_only_a_task_file_nanopts_reader_would_take(line: bytes, tmp_path: Path):
    """lm_eval reads --task-data's TASK.jsonl itself, whole: a line past nanopt's bounds, or one that is not
    JSON, is refused before it gets there (no lm_eval needed: the check comes first)."""
    from nanopt.errors import DataError
    from nanopt.evaluate.tasks.harness import HarnessOptions, check_task_data

    (tmp_path / "piqa.jsonl").write_bytes(b'{"goal": "a", "sol1": "b", "sol2": "c", "label": 0}\n' + line + b"\n")
    with pytest.raises(DataError, match=r"piqa\.jsonl line 2"):
        check_task_data(HarnessOptions(names=("piqa",), task_data=tmp_path))
