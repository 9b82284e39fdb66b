"""Small invented records in each downstream task's hub schema (written for these tests, not copied from the
datasets), and a --task-data directory holding them as TASK.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

RECORDS = {
    "hellaswag": [
        {"ind": 1, "activity_label": "Baking bread", "ctx_a": "A man kneads dough on a table.", "ctx_b": "he",
         "ctx": "A man kneads dough on a table. he", "endings": ["shapes it into a loaf [step] and waits.",
                                                               "throws it at the wall.", "paints  the dough blue.",
                                                               "sings to the oven [title] and bows."],
         "source_id": "invented~1", "split": "val", "split_type": "indomain", "label": "0"},
        {"ind": 2, "activity_label": "Fixing a bike", "ctx_a": "A woman turns the bike over.", "ctx_b": "she",
         "ctx": "A woman turns the bike over. she", "endings": ["eats the tire.", "removes the wheel.",
                                                              "flies away.", "reads the chain."],
         "source_id": "invented~2", "split": "val", "split_type": "zeroshot", "label": "1"},
    ],
    "arc_easy": [
        {"id": "inv-1", "question": "Which object is warmest at noon?",
         "choices": {"text": ["a stone in the sun", "snow", "an ice cube"], "label": ["A", "B", "C"]},
         "answerKey": "A"},
        {"id": "inv-2", "question": "What do plants take in?",
         "choices": {"text": ["gravel", "carbon dioxide", "steel", "plastic"], "label": ["1", "2", "3", "4"]},
         "answerKey": "2"},
    ],
    "arc_challenge": [
        {"id": "inv-3", "question": "Why does a pond freeze on top first?",
         "choices": {"text": ["ice is less dense", "fish push it up", "wind is cold", "mud is warm"],
                     "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
    ],
    "piqa": [
        {"goal": "Keep a door from slamming", "sol1": "Put a rubber stopper under it.",
         "sol2": "Paint it red.", "label": 0},
        {"goal": "Cool soup quickly", "sol1": "Cover it with a blanket.", "sol2": "Stir it in a wide bowl.",
         "label": 1},
    ],
    "lambada_openai": [
        {"text": "She opened the old box and found a letter from her grandmother"},
        {"text": "The dog waited by the door every evening for the postman"},
    ],
    "winogrande": [
        {"sentence": "The cup fell off the shelf because _ was too narrow.", "option1": "the cup",
         "option2": "the shelf", "answer": "2"},
        {"sentence": "Anna lent Maria a pen because _ had two of them.", "option1": "Anna", "option2": "Maria",
         "answer": "1"},
    ],
}


def write_task_data(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, records in RECORDS.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory
