"""Calibration (``ditq quantize --calibrate gptq``): the source model opened in source precision, the fixtures'
requests sent through it to gather each target Linear's input Hessian, every target GPTQ-rounded in memory
(``ditq.quantization.calibrated``) and the artifact written as ``ditq.save`` writes it.

The requests are the fixtures' own (prompt, references, size) at each calibration seed, with a few denoising
steps: the Hessians see the text encoder's and the transformer's inputs as serving gives them, at every timestep the
steps visit. The manifest records them (``options.calibration``: fixture ids, their digest, seeds, steps, request
count, damping). A killed calibration resumes: the same command run again takes back every Hessian group it
finished (``ditq.quantization.calibration_resume``). This stage sits above the fixtures (``ditq.probe``) and below
the judge (``tests/test_layers.py``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ditq.errors import InputError
from ditq.fsutil import ARTIFACT, check_output, exclusive_lock
from ditq.probe.fixtures import Fixture, fixture_digest, load_fixtures
from ditq.quantization.calibrated import HESSIAN_BYTES, Calibration
from ditq.quantization.calibration_resume import CalibrationResume
from ditq.quantization.defaults import CALIBRATION_MEMORY, CALIBRATION_SEEDS, CALIBRATION_STEPS
from ditq.quantization.gptq import PRODUCT_ROWS
from ditq.quantization.quantizer import QuantizeResult
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter, steps_refusal
from ditq.runtime.memory import free_accelerator_memory, host_available_bytes
from ditq.runtime.offload import demote_until_it_runs
from ditq.runtime.options import LoadOptions
from ditq.schemes import GroupSize

# The steps of a request that runs for its text encoder's rows or its memory peak only, which one step would give:
# two, because a flow-match scheduler that stretches its shift to a terminal value (Qwen-Image's) divides by zero
# at one (NaN timesteps and a RuntimeWarning, seen on an H100 at full size).
FEW_STEPS = 2

__all__ = [
    "CalibrationOptions",
    "calibrate_and_save",
    "calibration_for",
    "check_scheduler_steps",
    "fixture_requests",
    "host_share",
    "place_for_calibration",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationOptions:
    """``--calibrate gptq``'s inputs: the requests (fixtures, their references, seeds, steps) and the Hessians'
    memory; ``load``: how the source model is opened to run them (in its dtype as served: float32 on the CPU,
    bfloat16 on CUDA unless given; eager, kernels unverified)."""

    fixtures: Path
    refs: Path
    seeds: tuple[int, ...] = (
        CALIBRATION_SEEDS  # apart from the probe's: the judged images are not the calibrated ones
    )
    steps: int = CALIBRATION_STEPS
    # the Hessians held at once; None: CALIBRATION_MEMORY, or where they are summed on the host ``host_share``'s
    memory_bytes: int | None = None
    act_order: bool = True  # GPTQ's columns by decreasing input energy (``gptq.gptq_quantize``)
    load: LoadOptions = field(default_factory=LoadOptions)
    only: tuple[str, ...] | None = None  # the fixtures of the file that are run (a plan's); None: every one

    def __post_init__(self) -> None:
        if not self.seeds:
            raise InputError("--calibration-seeds: give at least one seed")
        if self.steps < 1:
            raise InputError(f"--calibration-steps must be at least 1, got {self.steps}")


def check_scheduler_steps(scheduler: Any, steps: int, flag: str = "--calibration-steps") -> None:
    """An InputError naming ``flag`` where ``scheduler`` cannot take ``steps`` denoising steps (``steps_refusal``:
    a NaN or an infinite sigma), said before any request runs: at one step Qwen-Image's scheduler divides by zero,
    every request's noisy image tokens are then NaN, and the transformer's Hessians would be left with the text
    tokens alone."""
    if why := steps_refusal(scheduler, steps):
        raise InputError(f"{flag} {steps}: {why}")


def fixture_requests(
    fixtures: dict[str, Fixture], seeds: tuple[int, ...], steps: int
) -> list[GenerationRequest]:
    """Every fixture's request (prompt, references, size) at every seed, ``steps`` denoising steps each."""
    return [fixture.request(seed, steps) for fixture in fixtures.values() for seed in seeds]


def _fixtures(options: CalibrationOptions) -> dict[str, Fixture]:
    """The fixtures the calibration requests are made of: the file's, or the ones ``options.only`` names."""
    fixtures = load_fixtures(options.fixtures, options.refs)
    if options.only is not None:
        missing = sorted(set(options.only) - set(fixtures))
        if missing:
            raise InputError(
                f"{options.fixtures}: no fixture {missing[0]!r}, which the calibration requests name"
            )
        fixtures = {f: fixtures[f] for f in options.only}
    return fixtures


def calibration_for(
    adapter: PipelineAdapter, options: CalibrationOptions, fixtures: dict[str, Fixture] | None = None
) -> Calibration:
    """The calibration that sends every fixture at every seed through ``adapter`` once per pass; ``fixtures``:
    ``options``' as already loaded (None: loaded here)."""
    fixtures = _fixtures(options) if fixtures is None else fixtures
    requests = fixture_requests(fixtures, options.seeds, options.steps)

    def run() -> None:
        for request in requests:
            adapter(request)

    def run_before_steps() -> None:
        """A text encoder's passes: its rows, without the steps that do not change them."""
        for request in requests:
            adapter(replace(request, num_inference_steps=min(FEW_STEPS, options.steps)))

    record = {
        "fixtures": sorted(fixtures),
        "fixtures_digest": fixture_digest(fixtures),
        "seeds": list(options.seeds),
        "steps": options.steps,
        "requests": len(requests),
    }
    return Calibration(
        run=run,
        record=record,
        memory_bytes=options.memory_bytes or CALIBRATION_MEMORY,
        act_order=options.act_order,
        run_before_steps=run_before_steps,
    )


def host_share(available: int | None) -> int:
    """``--calibration-memory``'s default where the Hessians are summed on the host (a source placed with
    ``--offload``): half of ``available`` (the host's available bytes once the source is placed: pinned streamed
    weights included), in whole multiples of ``CALIBRATION_MEMORY`` so that a rerun after a kill cuts the same groups
    (and resumes) unless the host's memory moved by that much; never below ``CALIBRATION_MEMORY``, nor where
    ``available`` is not known. Fewer passes over the requests: the full-size pipeline's 30 GiB of transformer
    Hessians take 8 at 4 GiB."""
    if available is None:
        return CALIBRATION_MEMORY
    return max(CALIBRATION_MEMORY, available // 2 // CALIBRATION_MEMORY * CALIBRATION_MEMORY)


def _room(adapter: PipelineAdapter, calibration: Calibration) -> int:
    """What the Hessians take on the device beside a request's activations: all of a group's
    (``calibration.memory_bytes``), or, summed on the host, one layer's (K, K) float32 product and one chunk of its
    input rows cast to float32 (``PRODUCT_ROWS``), at the widest Linear (the full-size pipeline's K = 12288:
    0.75 GiB)."""
    if not calibration.host:
        return calibration.memory_bytes
    widest = max(
        (
            m.in_features
            for c in adapter.pipeline.components.values()
            if isinstance(c, torch.nn.Module)
            for m in c.modules()
            if isinstance(m, torch.nn.Linear)
        ),
        default=1,
    )
    return (widest + PRODUCT_ROWS) * widest * HESSIAN_BYTES


def place_for_calibration(
    adapter: PipelineAdapter, requests: list[GenerationRequest], reserve_bytes: int
) -> None:
    """Under ``--offload auto`` on CUDA: room for the Hessians on the device (``reserve_bytes``, ``_room``) taken
    first, the resident components streamed from the last one up until it fits; then each distinct request
    (prompt, references, size) of ``requests`` (given at ``FEW_STEPS``: the peak is the same at any number) run once
    beside it, the placement taking its next step where one runs out of memory (``demote_until_it_runs``:
    the VAE's tiles where it ran out decoding, else the last resident component streamed), as a server's warm-up
    does, before a Hessian exists that a failed request would leave half-filled. With nothing left to move, an
    InputError naming the budget. Elsewhere (CPU, another offload mode) nothing is run."""
    placement = getattr(adapter.pipeline, "ditq_placement", None)
    if placement is None or placement.device.type != "cuda":
        return
    distinct = {
        (r.prompt, r.negative_prompt, r.width, r.height, tuple(i.size for i in r.images)): r for r in requests
    }
    held: list[torch.Tensor] = []
    demote_until_it_runs(
        placement,
        adapter.pipeline,
        lambda: held.append(torch.empty(reserve_bytes, dtype=torch.uint8, device=placement.device)),
        f"--max-memory: the Hessians' {reserve_bytes / 2**30:.2f} GiB on {placement.device} do not fit beside the "
        "model with everything streamed",
        stage="hessians",  # not the VAE's: its tiles would free nothing that is held
    )
    try:
        for request in distinct.values():
            demote_until_it_runs(
                placement,
                adapter.pipeline,
                partial(adapter, request),
                f"--max-memory/--offload auto: a calibration request ({request.width}x{request.height}, "
                f"{len(request.images)} references) ran out of memory on {placement.device} with everything moved "
                f"off it beside {reserve_bytes / 2**30:.2f} GiB of Hessians",
            )
    finally:
        held.clear()
        free_accelerator_memory()
    log.info("calibration placement on %s: %s", placement.device, placement.summary())


def calibrate_and_save(
    source: str | Path,
    output: str | Path,
    scheme_or_plan: str | Path,
    options: CalibrationOptions,
    *,
    targets: list[str] | None = None,
    force: bool = False,
    low_rank: int | None = None,
    group_size: GroupSize | None = None,
) -> QuantizeResult:
    """``source`` opened as served, its ``--components auto`` components GPTQ-rounded in a scheme on the
    fixtures' requests (with ``low_rank``: each residual of its rank-``low_rank`` branch), or a PLAN.json's
    component as the plan rounds it (its int-weight layers so, its fp8 ones to nearest, its own low rank),
    written to ``output`` as ``ditq quantize`` writes an artifact; ``group_size`` is ``--group-size``'s (a scheme's
    only, not a plan's: ``quantize_``).

    Resumable: each finished Hessian group is kept beside ``output`` (``CalibrationResume.beside``) until the
    artifact is written, and the same call after a kill takes back every group kept from the same inputs."""
    from ditq.checkpoint.hub import resolve_source
    from ditq.pipeline.open import open_pipeline
    from ditq.quantization.in_memory import quantize_, save
    from ditq.runtime.options import resolve_load_options

    output = Path(output)
    if os.path.lexists(output) and not force:  # said before the requests run, not after
        raise InputError(f"{output}: already exists (use --force to replace it)")
    load = resolve_load_options(options.load.replace(skip_doctor=True, compile=None))
    adapter = open_pipeline(source, load)
    check_scheduler_steps(getattr(adapter.pipeline, "scheduler", None), options.steps)
    model = resolve_source(source)[0].resolve()
    check_output(output, ARTIFACT, [model])  # what --force may replace, said before the requests run
    resume = CalibrationResume.beside(output, model)
    # a source placed to stream (--offload): its Hessians are summed on the host, each layer rounded on the device
    host = load.options.offload != "none"
    fixtures = _fixtures(options)
    calibration = replace(
        calibration_for(adapter, options, fixtures), resume=resume, host=host, device=load.device
    )
    log.info("calibrating on %d requests of %d steps", calibration.record["requests"], options.steps)
    with exclusive_lock(resume.folder, "ditq quantize --calibrate gptq"):
        try:
            requests = fixture_requests(fixtures, options.seeds[:1], min(FEW_STEPS, options.steps))
            place_for_calibration(adapter, requests, _room(adapter, calibration))
            if host and options.memory_bytes is None:
                calibration = replace(calibration, memory_bytes=host_share(host_available_bytes()))
                log.info("Hessians summed on the host, %.0f GiB of them at once (half the host's available memory; "
                         "--calibration-memory sets it)", calibration.memory_bytes / 2**30)  # fmt: skip
            quantize_(
                adapter.pipeline,
                scheme_or_plan,
                targets=targets,
                device=load.device,
                calibration=calibration,
                low_rank=low_rank,
                group_size=group_size,
            )
            result = save(adapter.pipeline, output, force=force)
        except BaseException:
            if kept := resume.held():
                groups = f"{len(kept)} finished group{'s' if len(kept) > 1 else ''}"
                log.warning("calibration stopped; %s kept in %s: run the same command again to resume", groups,
                            resume.folder)  # fmt: skip
            raise
        resume.remove()
    return result
