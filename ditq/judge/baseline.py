"""The BF16 baseline: a run of the unquantized model over the fixtures, sealed against change.

``make_baseline`` produces the run through an endpoint (the probe runner) or in
process (``ditq.runtime``: load_pipeline + PipelineAdapter), then ``seal_run``
writes ``SEAL.json``: the sha256 of every image, of ``records.jsonl`` and of
``RUN.json``, the fixture digest and versions. ``require_sealed`` is what
``gate`` and ``compare`` call before trusting a baseline.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ditq.errors import DitqError, InputError
from ditq.fsutil import sha256_file
from ditq.probe.fixtures import Fixture, load_fixtures
from ditq.probe.runner import (
    ProbeOptions,
    ProbeSummary,
    Reply,
    describe_run,
    run_matrix,
    run_probe,
    select_fixtures,
    versions,
)
from ditq.runfiles import (
    IMAGES_DIR,
    RECORDS_FILE,
    RUN_FILE,
    SEAL_FILE,
    InProcessOptions,
    RunFile,
    SealFile,
    read_model,
    write_model,
)

# imported where used: ``ditq.runtime`` imports torch, and ``ditq gate --help`` reads this module
if TYPE_CHECKING:
    from ditq.runtime.options import LoadOptions

__all__ = [
    "AdapterExecutor",
    "BaselineOptions",
    "make_baseline",
    "require_sealed",
    "seal_run",
    "verify_seal",
]

log = logging.getLogger(__name__)


@dataclass
class BaselineOptions:
    model: Path
    fixtures: Path
    refs: Path
    out: Path
    seeds: list[int]
    steps: int = 20
    true_cfg_scale: float = 1.0
    endpoint: str | None = None  # None: generate in process
    # in process: how the model is opened (device, offload, variant, compile; always in bfloat16, kernels unverified)
    load: LoadOptions = field(default_factory=lambda: _on_the_cpu())
    timeout_s: float = 1800.0
    concurrency: int = 1
    retry_failed: bool = False
    retry_out_of_memory: bool = False
    server_pid: int | None = None  # through an endpoint: the server process, to sample its own memory
    memory_interval_s: float = 1.0
    progress: bool = True
    only: list[str] | None = None  # fixture ids (the rest of the run is kept as it is); None = all
    api_key: str | None = field(default=None, repr=False)  # through an endpoint: sent as a bearer token


def _on_the_cpu() -> LoadOptions:
    from ditq.runtime.options import LoadOptions

    return LoadOptions(device="cpu")


class AdapterExecutor:
    """In-process generation through a PipelineAdapter; one request at a time. Its record's ``metrics`` are what
    ditq serve would have answered for the same generation (``StageMetrics``: milliseconds, no queue)."""

    endpoint = "in-process"

    def __init__(self, adapter: Any, steps: int, true_cfg_scale: float, offload: str = "none") -> None:
        self.adapter = adapter
        self.steps = steps
        self.true_cfg_scale = true_cfg_scale
        self.offload: str | None = offload
        self.parallel: str | None = None  # one process, one device

    def __call__(self, fixture: Fixture, seed: int) -> Reply:
        from ditq.runtime.images import encode_image

        t0 = time.perf_counter()
        try:
            result = self.adapter(fixture.request(seed, self.steps, self.true_cfg_scale))
            encoding = time.perf_counter()
            encoded = encode_image(result.images[0], "png", "auto")  # as ditq serve encodes its answer
            encode_s = time.perf_counter() - encoding
        except Exception as error:  # one failed generation is a record, not the end of the run
            return Reply(round(time.perf_counter() - t0, 3), None, error=f"{type(error).__name__}: {error}")
        from ditq.runtime.stage_metrics import StageMetrics  # what ditq serve answers for the same generation

        metrics = StageMetrics.from_result(
            result, queue_wait_s=0.0, encode_s=encode_s, steps_asked=self.steps, every_step=True
        ).model_dump(mode="json")
        return Reply(round(time.perf_counter() - t0, 3), None, encoded, metrics=metrics)


def _in_process(options: BaselineOptions, fixtures: dict[str, Fixture]) -> ProbeSummary:
    from ditq.pipeline.open import open_pipeline
    from ditq.runtime.options import resolve_load_options

    # The BF16 baseline on every device: the reference the quantized models are judged against.
    load = resolve_load_options(options.load.replace(dtype="bfloat16", skip_doctor=True))
    adapter = open_pipeline(options.model, load)
    executor = AdapterExecutor(adapter, options.steps, options.true_cfg_scale, load.options.offload)
    description = describe_run(
        "baseline",
        ["in-process"],
        options.fixtures,
        options.refs,
        fixtures,
        options.seeds,
        options.steps,
        options.true_cfg_scale,
        InProcessOptions(**load.options.record(*InProcessOptions.model_fields)),
        options.model,
    )
    # The generating process is this one: sample its own device memory too.
    return run_matrix(
        options.out,
        fixtures,
        options.seeds,
        [executor],
        description,
        retry_failed=options.retry_failed,
        retry_out_of_memory=options.retry_out_of_memory,
        memory_interval_s=options.memory_interval_s,
        server_pid=os.getpid(),
        progress=options.progress,
    )


def make_baseline(options: BaselineOptions) -> ProbeSummary:
    """Run the fixtures x seeds on the unquantized model and seal the result."""
    fixtures = load_fixtures(options.fixtures, options.refs)
    if options.endpoint is not None:  # the probe reads --only itself
        summary = run_probe(
            ProbeOptions(
                endpoints=[options.endpoint],
                fixtures=options.fixtures,
                refs=options.refs,
                seeds=options.seeds,
                out=options.out,
                steps=options.steps,
                true_cfg_scale=options.true_cfg_scale,
                concurrency=options.concurrency,
                retry_failed=options.retry_failed,
                retry_out_of_memory=options.retry_out_of_memory,
                server_pid=options.server_pid,
                memory_interval_s=options.memory_interval_s,
                timeout_s=options.timeout_s,
                progress=options.progress,
                only=options.only,
                kind="baseline",
                model_dir=options.model,
                api_key=options.api_key,
            )
        )
    else:
        if not Path(options.model).is_dir():
            raise InputError(f"{options.model}: model directory not found")
        summary = _in_process(options, select_fixtures(fixtures, options.only))
    seal_run(options.out)
    return summary


def _image_digests(run: Path) -> dict[str, str]:
    folder = run / IMAGES_DIR
    if not folder.is_dir():
        return {}
    return {f"{IMAGES_DIR}/{p.name}": sha256_file(p) for p in sorted(folder.glob("*.png"))}


def seal_run(run: Path) -> SealFile:
    """Write RUN/SEAL.json over the run's records, RUN.json and every image."""
    run = Path(run)
    for name in (RECORDS_FILE, RUN_FILE):
        if not (run / name).is_file():
            raise InputError(f"{run}: cannot seal, {name} is missing")
    description = read_model(RunFile, run / RUN_FILE)
    seal = SealFile(
        schema="ditq-seal-v1",
        sealed_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        files={
            RECORDS_FILE: sha256_file(run / RECORDS_FILE),
            RUN_FILE: sha256_file(run / RUN_FILE),
            **_image_digests(run),
        },
        fixture_digest=description.fixture_digest,
        versions=versions(),
    )
    write_model(run / SEAL_FILE, seal)
    return seal


def verify_seal(run: Path) -> list[str]:
    """What no longer matches the seal (empty list: intact). An absent or unreadable seal is one problem."""
    run = Path(run)
    path = run / SEAL_FILE
    if not path.is_file():
        return [f"{SEAL_FILE} is missing (not sealed)"]
    try:
        sealed = read_model(SealFile, path).files
    except InputError as error:
        return [f"{SEAL_FILE} is unreadable ({error})"]
    problems = []
    for name, digest in sealed.items():
        target = run / name
        if not target.is_file():
            problems.append(f"{name} is sealed but missing")
        elif sha256_file(target) != digest:
            problems.append(f"{name} does not match its seal")
    for name in _image_digests(run):
        if name not in sealed:
            problems.append(f"{name} is not in the seal")
    return problems


def require_sealed(baseline: Path, allow_unsealed: bool) -> str:
    """'sealed', or 'unsealed (allowed): ...' with a warning; raises unless allowed."""
    if not Path(baseline).is_dir():
        raise InputError(f"{baseline}: baseline directory not found")
    problems = verify_seal(baseline)
    if not problems:
        return "sealed"
    summary = f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
    if not allow_unsealed:
        raise DitqError(
            f"baseline {baseline}: {summary}; refusing it (re-create it with `ditq baseline`, "
            "or pass --allow-unsealed)"
        )
    log.warning("baseline %s: %s; used anyway because of --allow-unsealed", baseline, summary)
    return f"unsealed (allowed): {summary}"
