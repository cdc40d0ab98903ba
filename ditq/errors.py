"""Errors that ditq reports to a person: one line, naming the file, tensor or field."""

from __future__ import annotations

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_OUT_OF_MEMORY",
    "EXIT_STARTUP",
    "EXIT_STOPPED_DURING_STARTUP",
    "EXIT_USAGE",
    "DitqError",
    "InputError",
    "OutOfMemoryError",
    "StartupError",
    "error_line",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_OUT_OF_MEMORY = 3  # `ditq serve`: the model did not fit in the accelerator memory it may use
EXIT_STARTUP = (
    4  # `ditq serve`: it could not start for another reason (its port is taken); more offload won't help
)
EXIT_STOPPED_DURING_STARTUP = 5  # `ditq serve`: SIGTERM or Ctrl-C came before the model was ready


class DitqError(Exception):
    """A failure with a one-line, human-readable message. Exit code 1."""

    exit_code = EXIT_FAILURE


class InputError(DitqError):
    """Bad input or usage: a missing file, a corrupt tensor, an unknown name. Exit code 2.

    ``field`` names the offending request field when there is one (``InputError("width: 33 is not a multiple
    of 16", field="width")``), so a server can name it without reading the message.
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class OutOfMemoryError(DitqError):
    """The accelerator memory (or the --max-memory budget) cannot hold what was asked of it. Exit code 3."""

    exit_code = EXIT_OUT_OF_MEMORY


class StartupError(DitqError):
    """A server that cannot start for a reason memory does not explain (its address is in use). Exit code 4, so
    that a caller does not read it as "does not fit" (exit code 3) and retry with more offload."""

    exit_code = EXIT_STARTUP


def error_line(error: BaseException) -> str:
    """The first line of ``error``'s message that says something, "" where none does: how an error that is not
    ditq's own (a message over several lines, or one that begins with an empty line, as transformers' ImportErrors
    do) is reported in one line."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")
