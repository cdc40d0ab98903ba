"""Names a package offers but imports on first use, so that importing one light submodule (a command's ``--help``
reads its choices) does not import its heavy siblings, torch among them."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names`` maps each public name to the module that defines it."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
