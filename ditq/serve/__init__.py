"""`ditq serve`: an OpenAI-compatible images server (generations and edits) for artifacts and plain models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ditq.lazy import lazy_names

# Public name -> module that defines it, imported on first use: importing one light submodule (a command's
# --help reads its choices) does not import its heavy siblings.
_LAZY: dict[str, str] = {
    "DoctorOutcome": "ditq.serve.state",
    "ServeConfig": "ditq.serve.config",
    "create_app": "ditq.serve.app",
    "parse_memory_size": "ditq.devices",  # kept here: it was public here first
    "serve": "ditq.serve.server",
}

if TYPE_CHECKING:  # the names as their modules define them, for the type checker
    from ditq.devices import parse_memory_size
    from ditq.serve.app import create_app
    from ditq.serve.config import ServeConfig
    from ditq.serve.server import serve
    from ditq.serve.state import DoctorOutcome

__all__ = [
    "DoctorOutcome",
    "ServeConfig",
    "create_app",
    "parse_memory_size",
    "serve",
]


__getattr__ = lazy_names(__name__, _LAZY)
