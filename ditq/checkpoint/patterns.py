"""The modules a ``quantization_config`` names in ``targets`` and ``ignore``, matched as compressed-tensors
matches them: an exact module name, a class name, or ``re:`` and a regular expression (``re.match`` on the
module's name).

A pattern comes from a file ditq did not write, and Python's regular expressions backtrack: ``re:(.*)*X``
takes longer than the age of the universe on a 40-character name. So ditq reads a restricted language, fixed
before any name is matched (there is no timeout to tune), and refuses anything outside it in one line naming
the file, the field and the pattern:

- at most ``MAX_PATTERN_CHARS`` characters, and a pattern Python compiles;
- no backreferences or conditionals (lookarounds are read: llm-compressor ignores ``re:^(?!blocks\\.).*``);
- only a single character (a literal, ``.``, a class such as ``[0-9]`` or ``\\d``) repeats (``*``, ``+``,
  ``{m,n}``); a group or an alternation may be optional (``?``), never repeated, so no repetition nests;
- at most ``MAX_REPEATS`` repeats, and at most ``MAX_CHOICES`` choice points (repeats, optionals and
  alternations together, inside lookarounds too) in one pattern; at most ``MAX_PATTERNS`` ``re:`` entries in one config.

Each bound keeps a match to a few milliseconds on the longest module names (7 ms for the worst patterns inside
the language on a 98-character name; diffusers' names are under 60), and so a whole config's matching to
``MAX_PATTERNS`` times the modules times that; every pattern compressed-tensors,
llm-compressor and ditq write (``re:.*lm_head``, ``re:transformer_blocks\\.\\d+\\.attn\\..*``) is inside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ditq.errors import InputError

__all__ = [
    "MAX_CHOICES",
    "MAX_PATTERNS",
    "MAX_PATTERN_CHARS",
    "MAX_REPEATS",
    "check_entries",
    "compile_pattern",
    "matches",
]

MAX_PATTERN_CHARS = 200
MAX_REPEATS = 3
MAX_CHOICES = 4
MAX_PATTERNS = 32

_parser: Any = getattr(re, "_parser", None) or __import__("sre_parse")  # re._parser from Python 3.11
_constants: Any = getattr(re, "_constants", None) or __import__("sre_constants")
_REPEATS = {
    _constants.MAX_REPEAT,
    _constants.MIN_REPEAT,
    *([_constants.POSSESSIVE_REPEAT] if hasattr(_constants, "POSSESSIVE_REPEAT") else []),
}
_ONE_CHARACTER = {_constants.LITERAL, _constants.NOT_LITERAL, _constants.ANY, _constants.IN}
_REFUSED = {
    _constants.GROUPREF: "a backreference",
    _constants.GROUPREF_EXISTS: "a conditional",
}


def _walk(items: Any, counts: dict[str, int]) -> None:
    """Count the repeats and choice points of a parsed pattern; raise ValueError for what is outside the language."""
    for op, arg in items:
        if op in _REFUSED:
            raise ValueError(f"{_REFUSED[op]} is not allowed")
        if op in _REPEATS:
            low, high, body = arg
            if high > 1:
                if len(body) != 1 or body[0][0] not in _ONE_CHARACTER:
                    raise ValueError("only a single character may repeat (a group may only be optional: '?')")
                counts["repeats"] += 1
            counts["choices"] += low != high
            _walk(body, counts)
        elif op == _constants.BRANCH:
            counts["choices"] += 1
            for branch in arg[1]:
                _walk(branch, counts)
        elif op == _constants.SUBPATTERN:
            _walk(arg[-1], counts)
        elif op in (_constants.ASSERT, _constants.ASSERT_NOT):  # llm-compressor's ``re:^(?!blocks\.).*``
            _walk(arg[1], counts)
        elif op == getattr(_constants, "ATOMIC_GROUP", None):
            _walk(arg, counts)


def compile_pattern(pattern: str, where: str) -> re.Pattern[str]:
    """``pattern`` (without ``re:``) compiled, when it is inside the restricted language; else an InputError
    naming ``where`` and the pattern."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InputError(
            f"{where}: pattern {pattern[:40]!r}... is longer than {MAX_PATTERN_CHARS} characters"
        )
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        raise InputError(
            f"{where}: pattern {pattern!r} is not a valid regular expression ({error})"
        ) from None
    try:
        counts = {"repeats": 0, "choices": 0}
        _walk(_parser.parse(pattern), counts)
    except ValueError as error:
        raise InputError(f"{where}: pattern {pattern!r} is refused: {error}") from None
    if counts["repeats"] > MAX_REPEATS or counts["choices"] > MAX_CHOICES:
        raise InputError(
            f"{where}: pattern {pattern!r} is refused: {counts['repeats']} repeats and {counts['choices']} choice "
            f"points (at most {MAX_REPEATS} and {MAX_CHOICES})"
        )
    return compiled


def check_entries(entries: Any, where: str) -> tuple[str, ...]:
    """A ``targets`` or ``ignore`` list as strings, each ``re:`` pattern inside the restricted language."""
    if entries is None:
        return ()
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise InputError(f"{where} is not a list of module names or 're:' patterns")
    patterns = [e[3:] for e in entries if e.startswith("re:")]
    if len(patterns) > MAX_PATTERNS:
        raise InputError(f"{where}: {len(patterns)} 're:' patterns (at most {MAX_PATTERNS})")
    for pattern in patterns:
        compile_pattern(pattern, where)
    return tuple(entries)


def matches(entries: Iterable[str] | Sequence[str], name: str, module: torch.nn.Module) -> bool:
    """compressed-tensors matching: ``re:`` regex (re.match) on the name, else the exact name or class name.
    The entries were read through ``check_entries``."""
    for entry in entries:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif entry in (name, type(module).__name__):
            return True
    return False
