"""The judge tests' fixtures: the shared harness pieces (``tests/harness_kit.py``)."""

from harness_kit import fixture_set, stub

__all__ = ["fixture_set", "stub"]
