"""The tasks, exactly as lm-evaluation-harness 0.4.x defines them (lm_eval/tasks/*/ YAML files and utils):
the dataset on the Hugging Face hub, its config and the split scored, and how one record becomes prompts.

Every choice is one (context, continuation) pair; the continuation starts with the harness's target delimiter,
a space. Multiple choice puts the choices in the continuation; Winogrande ("partial scoring") puts them in the
context and scores the same continuation after each; LAMBADA scores the last word after the rest of the passage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nanopt.errors import DataError, NanoptError
from nanopt.parsing import show_value
from nanopt.untrusted_text import printable

DELIMITER = " "  # the harness's default target_delimiter, between context and continuation
# Every choice repeats its record's context, and the scorer tokenizes each pair whole (about 50 bytes of memory a
# character), so the prompts' total is what scoring costs, not the records' size: a record of a million one-letter
# choices would make a million copies of its context. HellaSwag validation, the largest task, renders about 20
# million characters (its 10,042 records, 11 MB in all, each context scored four times); this is over three
# times that.
MAX_PROMPT_CHARS = 1 << 26


@dataclass(frozen=True)
class Example:
    """One record, rendered: a (context, continuation) pair per choice and the index of the right one."""

    pairs: tuple[tuple[str, str], ...]
    gold: int
    # Characters of each choice as the harness counts them for acc_norm: len(choice), without the delimiter.
    norm_chars: tuple[int, ...]


@dataclass(frozen=True)
class Task:
    name: str
    path: str  # dataset on the hub
    config: str | None
    split: str  # the harness scores test_split when the task has one, else validation_split
    kind: str  # "choice" (the choices are continuations), "partial" (Winogrande), "last_word" (LAMBADA)
    baseline: float  # accuracy of random guessing, for the centered (CORE-style) accuracy
    render: Callable[[Mapping[str, Any]], Example]


def _text(record: Mapping[str, Any], key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise TypeError(f"field {key!r} is {type(value).__name__}, not text")
    return _encodable(value, key)


def _encodable(text: str, key: str) -> str:
    """`text`, unless JSON's \\ud800-style escapes left a lone surrogate in it, which no tokenizer can encode."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"field {key!r} holds a lone surrogate (a \\ud800-style escape), not text") from None
    return text


def _choices(texts: list[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    return tuple(DELIMITER + t for t in texts), tuple(len(t) for t in texts)


def _choice_example(context: str, texts: list[str], gold: int) -> Example:
    if not 0 <= gold < len(texts):
        raise ValueError(f"answer {gold} is not one of the {len(texts)} choices")
    continuations, chars = _choices(texts)
    return Example(pairs=tuple((context, c) for c in continuations), gold=gold, norm_chars=chars)


def hellaswag_preprocess(text: str) -> str:
    """lm_eval/tasks/hellaswag/utils.py preprocess: WikiHow's bracketed artifacts removed."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = "\n".join(_drop_brackets(line) for line in text.split("\n"))
    return text.replace("  ", " ")


def _drop_brackets(line: str) -> str:
    """re.sub(r"\\[.*?\\]", "", line), as the harness writes it, in linear time: the regex tries every '[' of a
    line without a ']' again up to the line's end, hours for a line of a million '['."""
    kept, i = [], 0
    while (start := line.find("[", i)) != -1 and (close := line.find("]", start)) != -1:
        kept.append(line[i:start])
        i = close + 1
    kept.append(line[i:])
    return "".join(kept)


def render_hellaswag(record: Mapping[str, Any]) -> Example:
    context = _text(record, "ctx_a") + " " + _text(record, "ctx_b").capitalize()
    query = hellaswag_preprocess(_text(record, "activity_label") + ": " + context)
    endings = [hellaswag_preprocess(e) for e in _string_list(record["endings"], "endings")]
    return _choice_example(query, endings, int(record["label"]))


def render_arc(record: Mapping[str, Any]) -> Example:
    choices = record["choices"]
    texts, labels = _string_list(choices["text"], "choices.text"), _string_list(choices["label"], "choices.label")
    if len(texts) != len(labels):
        raise ValueError("choices.text and choices.label differ in length")
    answer = _text(record, "answerKey")
    if answer not in labels:
        raise ValueError(f"answerKey {answer!r} is not among the labels {labels}")
    return _choice_example(f"Question: {_text(record, 'question')}\nAnswer:", texts, labels.index(answer))


def render_piqa(record: Mapping[str, Any]) -> Example:
    texts = [_text(record, "sol1"), _text(record, "sol2")]
    return _choice_example(f"Question: {_text(record, 'goal')}\nAnswer:", texts, int(record["label"]))


def render_lambada(record: Mapping[str, Any]) -> Example:
    words = _text(record, "text").split(" ")
    if len(words) < 2:
        raise ValueError("a passage of one word has no context")
    target = DELIMITER + words[-1]
    return Example(pairs=((" ".join(words[:-1]), target),), gold=0, norm_chars=(len(target),))


def render_winogrande(record: Mapping[str, Any]) -> Example:
    """lm_eval/tasks/winogrande/preprocess_winogrande.py: the blank filled by each option is the context; what
    follows the blank is the one continuation scored after each."""
    sentence = _text(record, "sentence")
    blank = sentence.index("_")  # ValueError without a blank
    options = [_text(record, "option1"), _text(record, "option2")]
    contexts = [sentence[:blank] + option for option in options]
    continuation = DELIMITER + sentence[blank + 1:].strip()
    answer = str(record["answer"])
    if answer not in ("1", "2"):
        raise ValueError(f"answer {show_value(record['answer'])} is not \"1\" or \"2\"")
    gold = int(answer) - 1
    return Example(pairs=tuple((c, continuation) for c in contexts), gold=gold,
                   norm_chars=tuple(len(c) for c in contexts))


def _string_list(value: Any, key: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
        raise TypeError(f"field {key!r} is not a list of texts")
    return [_encodable(v, key) for v in value]


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("hellaswag", "Rowan/hellaswag", None, "validation", "choice", 0.25, render_hellaswag),
    Task("arc_easy", "allenai/ai2_arc", "ARC-Easy", "test", "choice", 0.25, render_arc),
    Task("arc_challenge", "allenai/ai2_arc", "ARC-Challenge", "test", "choice", 0.25, render_arc),
    Task("piqa", "baber/piqa", None, "validation", "choice", 0.5, render_piqa),
    Task("lambada_openai", "EleutherAI/lambada_openai", "default", "test", "last_word", 0.0, render_lambada),
    Task("winogrande", "allenai/winogrande", "winogrande_xl", "validation", "partial", 0.5, render_winogrande),
)}


def parse_tasks(text: str, where: str = "--tasks", error: type[NanoptError] = DataError) -> tuple[str, ...]:
    """Comma-separated task names, in order, each once; `all` for every task. `where` names the option or key."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return tuple(TASKS)
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        shown = ", ".join(printable(repr(n)) for n in unknown) or "(none)"
        raise error(f"{where}: unknown task {shown}", f"use some of {', '.join(TASKS)}, comma-separated, or all")
    return tuple(dict.fromkeys(names))


def render(task: Task, records: list[Mapping[str, Any]], where: str) -> list[Example]:
    """Every record rendered; one that does not fit the task's schema is a DataError naming it, and so are records
    whose prompts total more than MAX_PROMPT_CHARS."""
    examples, chars = [], 0
    for i, record in enumerate(records):
        example = _render_one(task, record, f"{where}: record {i + 1}")
        chars += sum(len(context) + len(continuation) for context, continuation in example.pairs)
        if chars > MAX_PROMPT_CHARS:
            raise DataError(f"{where}: the prompts of its first {i + 1:,} records total more than "
                            f"{MAX_PROMPT_CHARS:,} characters, more than any benchmark's",
                            "check the task file, or score its first records with --limit N")
        examples.append(example)
    return examples


def _render_one(task: Task, record: Any, where: str) -> Example:
    try:
        if not isinstance(record, Mapping):
            raise TypeError("not a JSON object")
        return task.render(record)
    except KeyError as exc:
        field = printable(repr(exc.args[0]))[:80]
        raise DataError(f"{where} has no field {field} ({task.name} needs the schema of {task.path})",
                        "see `nanopt eval --help` for each task's fields") from None
    except (TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:  # Overflow: int(Infinity)
        raise DataError(f"{where} does not fit {task.name}'s schema: {printable(str(exc))[:200]}",
                        "see `nanopt eval --help` for each task's fields") from None
