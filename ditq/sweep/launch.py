"""How the sweep starts its commands: each in a process of its own, forked from a warm fork server on a CPU.

Every stage of a sweep is a command (``python -m ditq.cli quantize ...``, ``serve``, ``probe``, ...) run in a child
process, so that a stage's memory is given back when it ends and a crash stays in its stage. Started afresh, each
child spends 4-5 s importing torch, diffusers and compressed-tensors before it does anything: a CPU sweep over the
tiny model spent most of its time that way. On a CPU sweep, ``python -m ditq.cli`` commands are therefore forked
from a fork server (``multiprocessing``'s ``forkserver``), a process started once that imports those libraries and
then does nothing but fork. Each command is still a process of its own (its memory, exit code, log and process
group: a signal to the sweep's group reaches it), runs ``python -m ditq.cli`` on the same arguments with the sweep's
environment and working directory at the time, and writes to the same log.

The fork server never computes, so a child forked from it can use OpenMP's threads (a child forked from a process
that has run an OpenMP parallel region hangs in its first one) and can make its own CUDA context. It is used for
CPU sweeps; a sweep on an accelerator starts every command afresh with ``subprocess``, as does any command line
that is not ``python -m ditq.cli`` (a test's own server script, say). What the preloaded libraries read from the
environment when they are imported (torch: ``OMP_NUM_THREADS``) is the environment the fork server started with,
the sweep's at its first command.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.context import ForkServerContext
from pathlib import Path

__all__ = ["Child", "forking", "start"]

# what a stage imports before its work: imported once, by the fork server. Not ditq: the fork server starts with a
# path of its own (the working directory first), and a child imports ditq through the sweep's path, which
# multiprocessing gives it, so that it runs the ditq the sweep runs. diffusers imports its models, hooks and
# pipelines lazily: named here, they are not imported again by every server (about 0.7 s each, peft's included).
_PRELOAD = [
    "torch",
    "diffusers",
    "diffusers.models.transformers",
    "diffusers.hooks",
    "diffusers.pipelines.pipeline_utils",
    "transformers",
    "compressed_tensors",
    "fastapi",
    "uvicorn",
    "httpx",
]
_state: dict[str, ForkServerContext | None] = {"context": None}


def _fork_server() -> ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    assert isinstance(context, ForkServerContext)
    context.set_forkserver_preload(_PRELOAD)
    return context


@contextlib.contextmanager
def forking(enabled: bool) -> Iterator[None]:
    """For the length of the block (one sweep), ``ditq.cli`` commands are forked from the fork server where
    ``enabled`` (the fork server itself starts with the first of them, and lives as long as this process)."""
    before = _state["context"]
    usable = enabled and "forkserver" in multiprocessing.get_all_start_methods()
    _state["context"] = _fork_server() if usable else None
    try:
        yield
    finally:
        _state["context"] = before


class Child:
    """A forked command, with the part of ``subprocess.Popen`` the sweep uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess, argv: Sequence[str]) -> None:
        self._process = process
        self.args = list(argv)

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def poll(self) -> int | None:
        return None if self._process.is_alive() else self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _command(argv: Sequence[str], log: str, environ: Mapping[str, str]) -> None:
    """In the forked child: ``python -m ditq.cli ARGS`` as a fresh process would run it (``runpy``), its output
    appended to ``log``; its exit code is the child's. multiprocessing has already put it in the sweep's working
    directory and on its import path."""
    os.environ.clear()
    os.environ.update(environ)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    sink = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (sink, 1), (sink, 2)):
        os.dup2(source, target)
    os.close(sink)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 -- the process's own streams, until it exits
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    root = logging.getLogger()
    for handler in list(root.handlers):  # the command configures its own, on its own stderr
        root.removeHandler(handler)
    sys.argv = [argv[2], *argv[3:]]  # as `python -m` leaves them (runpy puts the module's file first)
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)  # exits with the command's code
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def start(argv: Sequence[str], log: Path) -> Child | subprocess.Popen[bytes]:
    """``argv`` running in a child process, its output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    context = _state["context"]
    if context is None or list(argv[:3]) != [sys.executable, "-m", "ditq.cli"]:
        with open(log, "ab") as sink:
            return subprocess.Popen(list(argv), stdout=sink, stderr=subprocess.STDOUT)
    process = context.Process(target=_command, args=(list(argv), str(log), dict(os.environ)), daemon=False)
    with _main_not_rerun():
        process.start()
    return Child(process, argv)


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """multiprocessing prepares a child by running this process's ``__main__`` again (the script that started the
    sweep: a user's, a test's); the child needs nothing of it, only ``ditq.cli``. Hidden while a child starts."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    hidden = {name: vars(main)[name] for name in ("__file__", "__spec__") if name in vars(main)}
    main.__spec__ = None  # read by multiprocessing; None: no module to import
    if "__file__" in hidden:
        del main.__file__
    try:
        yield
    finally:
        for name, value in hidden.items():
            setattr(main, name, value)
