"""One process that imports ditq's commands once, then forks a child per ``python -m ditq.cli ARGV`` asked of it.

The adversarial suite (attack_inputs.py) runs about 170 commands, and a fresh ``python -m ditq.cli`` spends most of
its 3-10 s importing torch and diffusers before it reads its first input. A child forked from this process starts
with those modules imported and does the rest as the real command does, in a process of its own: its own session
(killed as a group at the time limit), working directory, ``sys.path[0]`` (the working directory, as ``-m`` sets
it), stdin from /dev/null, stdout and stderr to files, ``runpy`` running ``ditq.cli`` as ``__main__``, an uncaught
exception printed as a traceback with exit 1, the atexit handlers run, and the exit code or signal returned as
``subprocess`` gives it.

What a fork cannot stand in for is run fresh by the caller: a changed environment (read at import, e.g. HF_HOME),
the console script, a person's Python script, a live server, and model folders that ship modules named like the
libraries imported here (those must be shown never to be imported, which a child that has them already cannot show).

    server = ForkServer(env, cwd)     # starts ``python fork_server.py`` with ``env``: it imports meanwhile
    code, seconds, stdout, stderr = server.run(argv, cwd, timeout, out_dir)
    server.close()
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# imported once by the server: what the commands the suite forks import before they read their inputs
PRELOAD = (
    "torch",
    "safetensors.torch",
    "diffusers",
    "transformers",
    "ditq",
    "ditq.commands.quantize",
    "ditq.commands.verify",
    "ditq.commands.generate",
    "ditq.commands.baseline",
    "ditq.commands.fixtures",
    "ditq.commands.probe",
    "ditq.commands.gate",
    "ditq.commands.compare",
    "ditq.commands.report",
    "ditq.commands.doctor",
    "ditq.commands.plan",
    "ditq.runtime.loader",
    "ditq.quantization.verifier",
)


# ---------------------------------------------------------------------------------------------------------------
# the server (run as a script)


def _exit_code(error: SystemExit) -> int:
    """What the interpreter makes of ``raise SystemExit(code)``."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code & 0xFF
    print(error.code, file=sys.stderr)
    return 1


def _child(request: dict[str, Any], protocol: tuple[int, int]) -> None:
    """Become ``python -m ditq.cli ARGV`` in ``cwd``; never returns."""
    code = 1
    try:
        os.setsid()
        for fd in protocol:
            os.close(fd)
        os.chdir(request["cwd"])
        stdin = os.open(os.devnull, os.O_RDONLY)
        stdout = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        stderr = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.path[0] = os.getcwd()  # what ``python -m`` puts first
        sys.argv = ["-m", *request["argv"]]
        import atexit
        import runpy

        try:
            runpy.run_module("ditq.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as error:
            code = _exit_code(error)
        except BaseException:  # the interpreter's own report of an uncaught exception
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter ends: its threads, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(preload: list[str]) -> None:
    """Import ``preload``, then serve requests on stdin, replies on stdout (JSON lines): ``{"id", "argv", "cwd",
    "stdout", "stderr"}`` gets ``{"id", "pid"}`` once forked and ``{"id", "exit"}`` once the child is gone. End of
    stdin ends the server."""
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # whatever the imports print goes to the server's stderr
    os.close(null)
    import importlib

    for name in preload:
        importlib.import_module(name)

    def reply(message: dict[str, Any]) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    # a fork of a process with other threads could copy a lock one of them holds
    reply({"ready": True, "threads": threading.active_count()})
    children: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reply({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(requests, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request, (requests, replies))
            children[pid] = request["id"]
            reply({"id": request["id"], "pid": pid})
    for pid in children:
        os.waitpid(pid, 0)


# ---------------------------------------------------------------------------------------------------------------
# the client


class ForkServer:
    """The server as a subprocess with ``env``, having imported ``preload``; ``run`` may be called from several
    threads at once."""

    def __init__(self, env: dict[str, str], cwd: Path, preload: tuple[str, ...] = PRELOAD) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=cwd,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.requests, self.replies = self.process.stdin, self.process.stdout
        self.lock = threading.Lock()
        self.waiting: dict[str, dict[str, Any]] = {}
        self.events: dict[str, threading.Event] = {}
        self.count = 0
        self.reader: threading.Thread | None = None

    def wait_ready(self) -> None:
        """Until the server has imported what it preloads (the first ``run`` waits for it too)."""
        with self.lock:
            if self.reader is not None:
                return
            ready = json.loads(self.replies.readline() or b"{}")
            if not ready.get("ready"):
                raise RuntimeError(f"the fork server did not start (exit {self.process.wait()})")
            if ready["threads"] != 1:
                raise RuntimeError(
                    f"the fork server has {ready['threads']} threads after its imports: forks are unsafe"
                )
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()

    def _read(self) -> None:
        for line in self.replies:
            message = json.loads(line)
            with self.lock:
                self.waiting[message["id"]].update(message)
                if "exit" in message:
                    self.events[message["id"]].set()
        with self.lock:  # the server is gone: nobody waits for ever
            for event in self.events.values():
                event.set()

    def run(
        self, argv: list[str], cwd: Path, timeout: float, io_dir: Path
    ) -> tuple[int | None, float, str, str]:
        """As attack_inputs.cli: (exit code, or None if killed at the limit; seconds; stdout; stderr)."""
        self.wait_ready()
        with self.lock:
            self.count += 1
            key = str(self.count)
            self.waiting[key], self.events[key] = {}, threading.Event()
        out, err = io_dir / f"{key}.out", io_dir / f"{key}.err"
        request = {"id": key, "argv": argv, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        started = time.perf_counter()
        with self.lock:
            self.requests.write((json.dumps(request) + "\n").encode())
            self.requests.flush()
        code: int | None
        if self.events[key].wait(timeout):
            code = self.waiting[key].get("exit")
        else:
            while "pid" not in self.waiting[key] and not self.events[key].is_set():
                time.sleep(0.01)
            if "pid" in self.waiting[key]:
                with contextlib.suppress(ProcessLookupError):  # gone just now
                    os.killpg(self.waiting[key]["pid"], signal.SIGKILL)
            self.events[key].wait()
            code = None
        seconds = time.perf_counter() - started
        with self.lock:
            del self.waiting[key], self.events[key]
        texts = [path.read_text(errors="replace") if path.exists() else "" for path in (out, err)]
        return code, seconds, texts[0], texts[1]

    def close(self) -> None:
        self.requests.close()
        self.process.wait(timeout=60)


if __name__ == "__main__":
    serve(sys.argv[1:])
