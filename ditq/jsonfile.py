"""The one way ditq reads JSON another program may have written: files (a component's config.json,
model_index.json, MANIFEST.json, PLAN.json, RUN.json, records.jsonl, fixtures, rules) and a server's request
bodies.

Bounded before anything reads the value: a file of at most ``MAX_JSON_BYTES``, nesting at most
``MAX_JSON_DEPTH`` deep, integers of at most ``MAX_INT_DIGITS`` digits (Python would convert 4300), every
object key once (``json`` alone keeps the last of two silently). A failure is one line: ``JsonRefused`` says
why, ``read_json`` turns it into an InputError naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ditq import fsutil
from ditq.errors import InputError

__all__ = [
    "MAX_INT_DIGITS",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "DuplicateKey",
    "JsonRefused",
    "NotJson",
    "loads",
    "no_duplicate_keys",
    "read_bounded",
    "read_json",
    "read_json_object",
]

MAX_JSON_BYTES = 64 << 20  # a manifest of a large model is well under 1 MiB; records of a long run a few MiB
MAX_JSON_DEPTH = 64  # ditq's deepest file (a records line's metrics) nests 5 deep
MAX_INT_DIGITS = 40  # byte counts, seeds and sizes need 20


class JsonRefused(ValueError):
    """JSON that ditq will not read, and why (one line, without the file's name)."""


class NotJson(JsonRefused):
    """Text that is not JSON at all (a syntax error, not UTF-8): what a line torn by a kill looks like."""


class DuplicateKey(JsonRefused):
    """A JSON object that gives one key twice."""


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: every key once."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"key {key!r} given twice")
        out[key] = value
    return out


def _bounded_int(max_digits: int) -> Callable[[str], int]:
    def parse_int(text: str) -> int:
        if len(text.lstrip("-")) > max_digits:
            raise JsonRefused(f"an integer of {len(text.lstrip('-'))} digits (at most {max_digits})")
        return int(text)

    return parse_int


def _check_depth(value: Any) -> None:
    """No container nests deeper than ``MAX_JSON_DEPTH`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth >= MAX_JSON_DEPTH:
                    raise JsonRefused(f"nested more than {MAX_JSON_DEPTH} deep")
                stack.append((child, depth + 1))


def loads(
    data: str | bytes,
    parse_constant: Callable[[str], Any] | None = None,
    max_int_digits: int = MAX_INT_DIGITS,
) -> Any:
    """The value of one JSON text, within the bounds; anything else is a JsonRefused saying why.

    ``parse_constant`` decides ``NaN``, ``Infinity`` and ``-Infinity`` (default: Python's floats). A server
    passes a larger ``max_int_digits`` so that its schema names the field an oversized integer was sent in."""
    try:
        value = json.loads(
            data,
            parse_int=_bounded_int(max_int_digits),
            object_pairs_hook=no_duplicate_keys,
            parse_constant=parse_constant,
        )
    except JsonRefused:
        raise
    except RecursionError:
        raise JsonRefused(f"nested more than {MAX_JSON_DEPTH} deep") from None
    except json.JSONDecodeError as error:
        raise NotJson(f"not valid JSON ({error.msg} at line {error.lineno} column {error.colno})") from None
    except UnicodeDecodeError:
        raise NotJson("not valid JSON (not UTF-8 text)") from None
    _check_depth(value)
    return value


def read_bounded(path: Path, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (``ditq.fsutil.read_bounded``)."""
    return fsutil.read_bounded(path, max_bytes)


def read_json(path: Path, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """The JSON value in ``path``; a missing, unreadable, oversized or invalid file is an InputError naming it."""
    data = read_bounded(path)
    try:
        return loads(data, parse_constant)
    except JsonRefused as error:
        raise InputError(f"{path}: {error}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """``read_json``, where the top level must be an object (a config, model_index.json, a manifest)."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise InputError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
