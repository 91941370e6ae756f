"""JSON values read out of a body or a stream (JSON lines, arrays of chunks) and the strings inside them,
for the meter (usage) and the scrubber (a key split across strings a client joins).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any


def strings_of(obj: Any, path: tuple[Any, ...], out: list[tuple[tuple[Any, ...], str]]) -> None:
    """The string values of a JSON document in order, each with its path (list indices kept:
    OpenAI's choices[0] and choices[1] are separate texts)."""
    if isinstance(obj, str):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            strings_of(v, (*path, k), out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            strings_of(v, (*path, i), out)


_JSON = json.JSONDecoder()
_BETWEEN_VALUES = re.compile(r"[\s\[\],]*")  # what separates JSON lines or a JSON array's elements


def json_values(text: str) -> Iterator[tuple[int, int, Any]]:
    """(start, end, value) of the JSON values in `text` one after another, the elements of an
    array one by one; reading stops at the first thing that is not JSON."""
    at = 0
    while True:
        at = _BETWEEN_VALUES.match(text, at).end()  # type: ignore[union-attr]
        if at >= len(text):
            return
        try:
            value, end = _JSON.raw_decode(text, at)
        except (ValueError, RecursionError):
            return
        yield at, end, value
        at = end


def strings_list(obj: Any) -> list[tuple[tuple[Any, ...], str]]:
    out: list[tuple[tuple[Any, ...], str]] = []
    strings_of(obj, (), out)
    return out


def name_of(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """The running text a field joins by its name: the last object key on its path."""
    return ("name", next((p for p in reversed(path) if isinstance(p, str)), None))


def with_strings(obj: Any, it: Iterator[str]) -> Any:
    if isinstance(obj, str):
        return next(it)
    if isinstance(obj, dict):
        return {k: with_strings(v, it) for k, v in obj.items()}
    if isinstance(obj, list):
        return [with_strings(v, it) for v in obj]
    return obj
