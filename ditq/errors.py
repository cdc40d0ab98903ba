"""Errors that ditq reports to a person: one line, naming the file, tensor or field."""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "DitqError", "InputError"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class DitqError(Exception):
    """A failure with a one-line, human-readable message. Exit code 1."""

    exit_code = EXIT_FAILURE


class InputError(DitqError):
    """Bad input or usage: a missing file, a corrupt tensor, an unknown name. Exit code 2."""

    exit_code = EXIT_USAGE
