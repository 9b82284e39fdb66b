"""The downstream tasks' datasets and prompts, held to lm-evaluation-harness 0.4.x's task files
(lm_eval/tasks/{hellaswag,arc,piqa,lambada,winogrande}), with invented records in each dataset's schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from taskdata import RECORDS, write_task_data

from nanopt.errors import DataError
from nanopt.evaluate.tasks.catalog import TASKS, parse_tasks, render
from nanopt.evaluate.tasks.sources import load_records


def test_datasets_configs_and_splits_are_the_harnesss():
    table = {name: (t.path, t.config, t.split, t.kind, t.baseline) for name, t in TASKS.items()}
    assert table == {
        "hellaswag": ("Rowan/hellaswag", None, "validation", "choice", 0.25),
        "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test", "choice", 0.25),
        "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test", "choice", 0.25),
        "piqa": ("baber/piqa", None, "validation", "choice", 0.5),
        "lambada_openai": ("EleutherAI/lambada_openai", "default", "test", "last_word", 0.0),
        "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", "partial", 0.5),
    }


def rendered(name: str, i: int = 0):
    return render(TASKS[name], [RECORDS[name][i]], "test")[0]


def test_hellaswag_preprocessing():
    e = rendered("hellaswag")
    # activity_label: ctx_a ctx_b.capitalize(), brackets removed, " [title]" becomes ". ", double spaces single.
    assert e.pairs[0] == ("Baking bread: A man kneads dough on a table. He", " shapes it into a loaf and waits.")
    assert [c for _, c in e.pairs] == [" shapes it into a loaf and waits.", " throws it at the wall.",
                                       " paints the dough blue.", " sings to the oven. and bows."]
    assert e.gold == 0 and e.norm_chars == (32, 22, 22, 28)
    assert rendered("hellaswag", 1).gold == 1  # the hub stores the label as text


def test_arc_and_piqa_ask_question_answer():
    e = rendered("arc_easy", 1)
    assert e.pairs[1] == ("Question: What do plants take in?\nAnswer:", " carbon dioxide")
    assert e.gold == 1 and len(e.pairs) == 4  # answerKey "2" is the second label
    assert rendered("arc_challenge").pairs[0][0] == "Question: Why does a pond freeze on top first?\nAnswer:"
    p = rendered("piqa", 1)
    assert p.pairs == (("Question: Cool soup quickly\nAnswer:", " Cover it with a blanket."),
                       ("Question: Cool soup quickly\nAnswer:", " Stir it in a wide bowl."))
    assert p.gold == 1


def test_lambada_scores_the_last_word():
    e = rendered("lambada_openai")
    assert e.pairs == (("She opened the old box and found a letter from her", " grandmother"),)


def test_winogrande_scores_the_same_ending_after_each_option():
    e = rendered("winogrande")
    assert e.pairs == (("The cup fell off the shelf because the cup", " was too narrow."),
                       ("The cup fell off the shelf because the shelf", " was too narrow."))
    assert e.gold == 1 and rendered("winogrande", 1).gold == 0


def test_task_data_jsonl_with_a_limit(tmp_path: Path):
    data = write_task_data(tmp_path / "tasks")
    records, source = load_records(TASKS["piqa"], data, limit=1)
    assert records == RECORDS["piqa"][:1] and source == str(data / "piqa.jsonl")


@pytest.mark.parametrize("line, fragment", [
    ('{"goal": "g", "sol1": "a", "label": 0}', "no field 'sol2'"),
    ('{"goal": "g", "sol1": "a", "sol2": "b", "label": 5}', "answer 5 is not one of the 2 choices"),
    ('[1, 2]', "not a JSON object"),
    ('{"goal": "g", "sol1": "a", "sol2": ', "malformed JSON"),
])
def test_a_record_that_does_not_fit_is_one_data_error(tmp_path: Path, line: str, fragment: str):
    (tmp_path / "piqa.jsonl").write_text(line + "\n")
    with pytest.raises(DataError) as caught:
        records, source = load_records(TASKS["piqa"], tmp_path, None)
        render(TASKS["piqa"], records, source)
    assert fragment in caught.value.message


def test_a_missing_file_and_unknown_tasks(tmp_path: Path):
    with pytest.raises(DataError, match="task file not found"):
        load_records(TASKS["hellaswag"], tmp_path, None)
    assert parse_tasks("piqa, hellaswag,piqa") == ("piqa", "hellaswag")
    assert parse_tasks("all") == tuple(TASKS)
    with pytest.raises(DataError, match="unknown task 'mmlu'"):
        parse_tasks("piqa,mmlu")
