"""Three small datasets with one tokenizer, and train.json mixtures of them, for the data-mixture tests."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY_SETTINGS, english_like_documents, write_jsonl

WEIGHTS = {"web": 0.7, "code": 0.2, "math": 0.1}


def build_sources(root: Path, web: Path) -> dict[str, Path]:
    """web (the tiny dataset: ~108k train tokens), code (~30k) and math (~14k), all with web's tokenizer."""
    from nanopt.data.tokenize.pipeline import build_dataset

    made = {"web": web}
    for name, documents, seed in (("code", 150, 1), ("math", 60, 2)):
        corpus = write_jsonl(root / f"{name}.jsonl", english_like_documents(documents, seed=seed))
        settings = {key: value for key, value in TINY_SETTINGS.items() if key != "vocab_size"}
        build_dataset(root / name, str(corpus), tokenizer=str(web), **settings)
        made[name] = root / name
    return made


def mixture(sources: dict[str, Path], weights: dict[str, float] = WEIGHTS) -> dict[str, dict]:
    """train.json's `data`: each source by name, with its path and weight."""
    return {name: {"path": str(sources[name]), "weight": weight} for name, weight in weights.items()}
