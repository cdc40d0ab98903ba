"""`ditq serve`: an OpenAI-compatible images server (generations and edits) for artifacts and plain models."""

from __future__ import annotations

from ditq.serve.app import create_app
from ditq.serve.config import ServeConfig, parse_memory_size
from ditq.serve.server import serve
from ditq.serve.state import DoctorOutcome

__all__ = ["DoctorOutcome", "ServeConfig", "create_app", "parse_memory_size", "serve"]
