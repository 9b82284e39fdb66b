"""Walking a JSON value, for the tests that damage one field of a stranger's file at a time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def field_paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every field of a JSON value, containers and leaves, as a path of keys and indices."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield (*path, key)
        yield from field_paths(child, (*path, key))
