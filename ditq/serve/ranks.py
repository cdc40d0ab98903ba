"""A server over several ranks (``ditq serve --parallel cp=N``): rank 0 serves, ranks 1..N-1 follow.

Rank 0 is the serving process: it owns the HTTP front, the queue and the cost model. Ranks 1..N-1 are child processes
(torch.multiprocessing, spawn), each holding the whole pipeline on its own device with kernels chosen there by its own
doctor, joined in one process group (NCCL on CUDA, gloo on the CPU) that the transformer's collectives run over
(``ditq.runtime.parallel``). Every generation, calibration's included, goes to all ranks:

- rank 0 checks the request (a refusal reaches no rank), gives it a seed where it has none (every rank must draw the
  same noise), and sends it to each follower over its pipe; all ranks run it; the image is rank 0's;
- after every denoising step rank 0 broadcasts whether to stop (its deadline, its client, a drain) over a gloo group,
  so every rank stops at the same step, and the next request finds them in step;
- each follower answers on its pipe when it is done, with its peak memory (/health's per-rank peaks).

A rank that fails cannot be left behind: the others would wait in a collective for it. So a follower that exits (or
is killed), a generation that fails on any rank, or a follower that does not answer in time *loses* the group: one
log line says which rank and why, the other followers are stopped, and from then on /health and every request answer
503 ``degraded`` (``ditq.serve.state``) until the server is restarted. A watchdog thread waits on the followers'
process sentinels, so a death is noticed at once; every collective has a timeout (``COLLECTIVE_TIMEOUT_S``), so none
waits for ever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from ditq.errors import StartupError, error_line
from ditq.pipeline.open import open_pipeline
from ditq.runtime.adapter import GenerationCancelled, GenerationRequest, GenerationResult, PipelineAdapter
from ditq.runtime.options import LoadOptions
from ditq.runtime.parallel import ParallelSpec, apply_parallelism
from ditq.serve.metrics import peak_resident_memory_bytes
from ditq.serve.worker import RankLost, StopReason

__all__ = ["COLLECTIVE_TIMEOUT_S", "RankGroup", "RankSettings", "RankedAdapter"]

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # the longest any rank waits in one collective (joining the group included)
_STOP_REASONS: tuple[str, ...] = get_args(StopReason)  # broadcast as 1 + its index; 0: go on
_EXIT_SEEN_S = 1.0  # how long a follower whose sockets closed may take to be seen exited


@dataclasses.dataclass(frozen=True)
class RankSettings:
    """What every rank needs to load the same pipeline and join the same group (sent to each follower)."""

    model_dir: Path
    spec: ParallelSpec
    devices: tuple[str, ...]  # rank -> device
    options: LoadOptions  # how every rank opens the pipeline, resolved (each on its own device)
    log_level: int = logging.INFO

    @property
    def backend(self) -> str:
        return "nccl" if self.devices[0].startswith("cuda") else "gloo"


def _peak_memory_bytes(device: str) -> int:
    """This process's peak on its device so far: the CUDA allocator's, or the resident high-water mark on the CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return peak_resident_memory_bytes()


def _first_line(error: BaseException) -> str:
    text = error_line(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _ended(exit_code: int | None) -> str:
    if exit_code is None:
        return "closed its pipe"
    return f"was killed by signal {-exit_code}" if exit_code < 0 else f"exited with code {exit_code}"


def _agree_to_stop(group: dist.ProcessGroup, reason: str | None) -> str | None:
    """Rank 0's stop decision after a step, on every rank: rank 0 passes its own ``reason``, the others None."""
    code = torch.tensor([0 if reason is None else 1 + _STOP_REASONS.index(reason)])
    dist.broadcast(code, src=0, group=group)
    return None if int(code) == 0 else _STOP_REASONS[int(code) - 1]


def _load_rank(
    settings: RankSettings, rank: int, rendezvous: str
) -> tuple[PipelineAdapter, dist.ProcessGroup]:
    """Join the group as ``rank``, open the pipeline on its device, make the transformer parallel; returns the
    adapter and the gloo group that stop decisions go over."""
    device = settings.devices[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        settings.backend, init_method=rendezvous, rank=rank, world_size=settings.spec.degree, timeout=timeout
    )
    control = dist.new_group(backend="gloo", timeout=timeout)
    adapter = open_pipeline(settings.model_dir, settings.options.replace(device=device))
    apply_parallelism(adapter.pipeline, settings.spec)
    return adapter, control


def follow(settings: RankSettings, rank: int, rendezvous: str, pipe: Any) -> None:
    """A follower's life (the child process's target): load, say ready, run what rank 0 sends until told to stop.
    A failure is sent to rank 0 and ends the process: its group cannot go on without it in step."""
    logging.basicConfig(level=settings.log_level, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    # A Ctrl-C or SIGTERM reaches the whole process group: rank 0 drains first, then ends this process (its pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        adapter, control = _load_rank(settings, rank, rendezvous)
    except Exception as error:
        logger.exception("loading failed")
        pipe.send(("failed", _first_line(error)))
        raise SystemExit(1) from None
    from ditq.runtime.loader import pipeline_summary

    pipe.send(("ready", {"kernel_paths": pipeline_summary(adapter.pipeline)[1]}))
    while True:
        try:
            request = pipe.recv()
        except EOFError:  # rank 0 is gone
            raise SystemExit(1) from None
        if request is None:
            break
        try:
            result = adapter(dataclasses.replace(request, should_stop=lambda: _agree_to_stop(control, None)))
            pipe.send(("done", (result.peak_memory_bytes, _peak_memory_bytes(settings.devices[rank]))))
        except GenerationCancelled:
            pipe.send(("stopped", (None, _peak_memory_bytes(settings.devices[rank]))))
        except Exception as error:
            logger.exception("generation failed")
            pipe.send(("failed", _first_line(error)))
            raise SystemExit(1) from None
    dist.destroy_process_group()


@dataclasses.dataclass
class _Follower:
    rank: int
    process: Any  # torch.multiprocessing's SpawnProcess
    pipe: Any  # rank 0's end
    device: str
    peak_memory_bytes: int | None = None  # of its process so far
    kernel_paths: dict[str, int] = dataclasses.field(default_factory=dict)

    def ended(self) -> str:
        """How this follower's process ended, as the server's log and 503 say it."""
        return f"rank {self.rank} (pid {self.process.pid}) {_ended(self.process.exitcode)}"


class RankGroup:
    """Rank 0's view of the group: the followers' processes and pipes, the watchdog, and whether it is lost.

    ``launch`` starts the followers (they load while rank 0 does); ``join``, in rank 0's loader, joins the group,
    loads rank 0's pipeline and waits until every follower is ready; ``close`` stops them."""

    def __init__(self, settings: RankSettings) -> None:
        self.settings = settings
        self.followers: list[_Follower] = []
        self.lost: str | None = None  # why the group cannot serve any more; None while it can
        self.peak_memory_bytes: int | None = None  # rank 0's
        self._folder: Path | None = None  # the rendezvous file's, from launch on
        self._closing = False
        self._lock = threading.Lock()
        self._watchdog = threading.Thread(target=self._watch, name="rank-watchdog", daemon=True)

    @property
    def _rendezvous(self) -> str:
        assert self._folder is not None, "launch() first"
        return f"file://{self._folder / 'rendezvous'}"

    def launch(self) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="ditq-ranks-"))
        context = torch_mp.get_context("spawn")
        for rank in range(1, self.settings.spec.degree):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=follow,
                args=(self.settings, rank, self._rendezvous, theirs),
                name=f"ditq-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.followers.append(_Follower(rank, process, mine, self.settings.devices[rank]))
        self._watchdog.start()
        logger.info(
            "parallel %s over %s (%s): started %d follower rank(s)",
            self.settings.spec,
            ", ".join(self.settings.devices),
            self.settings.backend,
            len(self.followers),
        )

    def join(self) -> RankedAdapter:
        """Rank 0's pipeline, once every rank has loaded its own; a follower that fails to load is a StartupError."""
        try:
            adapter, control = _load_rank(self.settings, 0, self._rendezvous)
        except Exception as error:
            if self.lost is None:
                raise
            # a follower that exited before joining left rank 0 waiting for it until the join timed out
            raise StartupError(f"--parallel {self.settings.spec}: {self.lost}") from error
        for follower in self.followers:
            kind, detail = self._receive(follower, COLLECTIVE_TIMEOUT_S)
            if kind != "ready":
                raise StartupError(
                    f"--parallel {self.settings.spec}: rank {follower.rank} did not load: {detail}"
                )
            follower.kernel_paths = detail["kernel_paths"]
        ranked = RankedAdapter(adapter.pipeline, self, control)
        ranked.load_facts.update(adapter.load_facts)
        ranked.kernel_chooser = adapter.kernel_chooser
        return ranked

    def _receive(self, follower: _Follower, timeout_s: float) -> tuple[str, Any]:
        """A follower's next message, or ("lost", why) when it has none within ``timeout_s``."""
        try:
            if not follower.pipe.poll(timeout_s):
                return "lost", f"no answer within {timeout_s:g} s"
            message: tuple[str, Any] = follower.pipe.recv()
            return message
        except (EOFError, OSError):
            follower.process.join(1.0)
            return "lost", _ended(follower.process.exitcode)

    def dispatch(self, request: GenerationRequest) -> None:
        for follower in self.followers:
            try:
                follower.pipe.send(request)
            except OSError as error:
                raise self.lose(f"rank {follower.rank} cannot be reached ({error})") from None

    def settle(self, expected: str) -> list[int | None]:
        """Every follower's answer to the generation just run by rank 0, which ended ``expected`` (done, stopped):
        their peaks for it, by rank (None on the CPU)."""
        self.peak_memory_bytes = _peak_memory_bytes(self.settings.devices[0])
        peaks: list[int | None] = []
        for follower in self.followers:
            kind, detail = self._receive(follower, COLLECTIVE_TIMEOUT_S)
            if kind != expected:  # failed, lost, or out of step with rank 0
                raise self.lose(f"rank {follower.rank} {kind} where rank 0 {expected}: {detail}")
            request_peak, follower.peak_memory_bytes = detail
            peaks.append(request_peak)
        return peaks

    def lose(self, reason: str) -> RankLost:
        """Mark the group lost (the first reason stays), stop the followers; returns the error to raise."""
        with self._lock:
            first = self.lost is None and not self._closing
            if self.lost is None:
                self.lost = reason
        if first:
            logger.error(
                "parallel %s lost: %s; every request is answered 503 degraded until the server restarts",
                self.settings.spec,
                reason,
            )
            self._kill_followers()
        return RankLost(self.lost or reason)

    def _kill_followers(self) -> None:
        for follower in self.followers:
            if follower.process.is_alive():
                follower.process.kill()  # SIGKILL: a follower ignores SIGTERM (see follow)

    def abandon(self) -> None:
        """End the followers at once and remove the rendezvous: rank 0 is exiting mid-start-up (no group to leave)."""
        self._closing = True
        self._kill_followers()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def blame(self, error: BaseException) -> str:
        """Why rank 0's generation failed with ``error``: a follower that exited (the collective rank 0 waited in
        broke because of it; the kernel closes its sockets a moment before its exit can be seen), else rank 0."""
        deadline = time.monotonic() + _EXIT_SEEN_S
        while True:
            for follower in self.followers:
                if not follower.process.is_alive():
                    return follower.ended()
            if time.monotonic() > deadline:
                return f"rank 0's generation failed ({_first_line(error)})"
            time.sleep(0.05)

    def _watch(self) -> None:
        alive = {follower.process.sentinel: follower for follower in self.followers}
        while alive and not self._closing:
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=1.0):
                follower = alive.pop(sentinel)
                follower.process.join(1.0)  # reaped: its exit code is known
                if not self._closing:
                    self.lose(follower.ended())

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the followers (those still running finish their loop), leave the group, remove the rendezvous."""
        self._closing = True
        for follower in self.followers:
            with contextlib.suppress(OSError):  # already gone
                follower.pipe.send(None)
        for follower in self.followers:
            follower.process.join(timeout_s)
        self._kill_followers()
        for follower in self.followers:
            follower.process.join(timeout_s)
        # A lost NCCL group may still hold rank 0's worker in a collective, and destroying it under that thread can
        # wait for the collective's timeout; the process is ending anyway. Gloo's collectives fail at once.
        if dist.is_initialized() and (self.lost is None or self.settings.backend == "gloo"):
            dist.destroy_process_group()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def to_json(self) -> dict[str, Any]:
        """/health's ``parallel``: the mode and degree, the backend, and each rank's device, process and peak."""
        settings = self.settings
        ranks = [
            {
                "rank": 0,
                "device": settings.devices[0],
                "pid": os.getpid(),
                "alive": True,
                "peak_memory_bytes": self.peak_memory_bytes,
            }
        ]
        ranks += [
            {
                "rank": f.rank,
                "device": f.device,
                "pid": f.process.pid,
                "alive": f.process.is_alive(),
                "peak_memory_bytes": f.peak_memory_bytes,
                "kernel_paths": f.kernel_paths,
            }
            for f in self.followers
        ]
        return {
            "mode": settings.spec.mode,
            "degree": settings.spec.degree,
            "backend": settings.backend,
            "devices": list(settings.devices),
            "ranks": ranks,
            "lost": self.lost,
        }


class RankedAdapter(PipelineAdapter):
    """Rank 0's adapter: every call runs on all ranks, in step (see the module's description)."""

    def __init__(self, pipeline: Any, ranks: RankGroup, control: dist.ProcessGroup) -> None:
        super().__init__(pipeline)
        self.ranks = ranks
        self.control = control

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        if self.ranks.lost is not None:
            raise RankLost(self.ranks.lost)
        self.build_kwargs(request)  # a refused field reaches no rank
        if request.seed is None:
            request = dataclasses.replace(request, seed=secrets.randbelow(2**31))
        self.ranks.dispatch(dataclasses.replace(request, should_stop=None))
        asked: Callable[[], str | None] | None = request.should_stop

        def should_stop() -> str | None:
            return _agree_to_stop(self.control, asked() if asked is not None else None)

        try:
            result = super().__call__(dataclasses.replace(request, should_stop=should_stop))
        except GenerationCancelled:
            self.ranks.settle("stopped")
            raise
        except Exception as error:
            raise self.ranks.lose(self.ranks.blame(error)) from error
        peaks = self.ranks.settle("done")
        return dataclasses.replace(result, rank_peak_memory_bytes=[result.peak_memory_bytes, *peaks])
