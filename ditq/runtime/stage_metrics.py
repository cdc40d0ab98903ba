"""One generation's timings and memory, in milliseconds and MiB, named as the seed's probe recorded them: what
``ditq serve`` answers as a response's ``metrics`` and what the in-process baseline records for the same
generation (``ditq.judge.baseline``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from ditq.runtime.adapter import GenerationResult

__all__ = ["StageMetrics"]


class StageMetrics(BaseModel):
    """Per-request timings, in milliseconds, named as the seed's probe recorded them."""

    queue_wait_ms: float
    text_encoding_ms: float
    denoising_ms: float
    denoise_step_latency_ms: float  # mean over steps
    decoding_ms: float
    postprocess_time_ms: float  # the pipeline's postprocess plus the server's image encoding
    generation_ms: float  # the adapter call, end to end
    peak_memory_mb: float | None  # peak accelerator memory of this request; None on the CPU
    num_inference_steps: int | None  # steps measured, else the steps asked for
    image_pixels: int
    denoise_step_latencies_ms: list[float] | None = None  # only with return_stage_metrics
    # Accelerator memory by stage (peak allocated MiB of text_encoding, image_encoding, first_step, later_steps,
    # decoding and the work between them, ``other``) and what the server held when the request began; None on
    # the CPU. With return_stage_metrics only.
    stage_peak_memory_mb: dict[str, float] | None = None
    memory_at_start_mb: float | None = None
    # What the server's cost model predicted for this request before it ran (peak allocated MiB); None where it
    # has no prediction (no cost model, or a CPU server).
    predicted_peak_memory_mb: float | None = None
    # A parallel server's (``--parallel``): each rank's peak accelerator memory for this request, rank 0 first
    # (``peak_memory_mb`` is rank 0's); None on the CPU, absent on one device.
    rank_peak_memory_mb: list[float | None] | None = None
    # A server with --cache: this request's transformer calls served from the step cache; absent without one.
    skipped_steps: int | None = None

    @classmethod
    def from_result(
        cls,
        result: GenerationResult,
        queue_wait_s: float,
        encode_s: float,
        steps_asked: int | None,
        every_step: bool,
        predicted_peak_bytes: int | None = None,
    ) -> StageMetrics:
        """The metrics of one generation: the adapter's seconds as milliseconds, the server's image encoding
        (``encode_s``) counted in postprocess; ``every_step`` adds each step's latency."""
        timings, steps = result.timings, result.step_times
        width, height = result.images[0].size
        return cls(
            queue_wait_ms=queue_wait_s * 1000,
            text_encoding_ms=timings.get("text_encoding", 0.0) * 1000,
            denoising_ms=timings.get("denoising", 0.0) * 1000,
            denoise_step_latency_ms=(sum(steps) / len(steps) * 1000) if steps else 0.0,
            decoding_ms=timings.get("decoding", 0.0) * 1000,
            postprocess_time_ms=(timings.get("postprocess", 0.0) + encode_s) * 1000,
            generation_ms=timings.get("total", 0.0) * 1000,
            peak_memory_mb=None if result.peak_memory_bytes is None else result.peak_memory_bytes / 1024**2,
            num_inference_steps=len(steps) or steps_asked,
            image_pixels=width * height,
            denoise_step_latencies_ms=[s * 1000 for s in steps] if every_step else None,
            stage_peak_memory_mb=(
                {stage: peak / 1024**2 for stage, peak in result.stage_peak_memory_bytes.items()}
                if every_step and result.stage_peak_memory_bytes is not None
                else None
            ),
            memory_at_start_mb=(
                result.memory_at_start_bytes / 1024**2
                if every_step and result.memory_at_start_bytes is not None
                else None
            ),
            predicted_peak_memory_mb=None if predicted_peak_bytes is None else predicted_peak_bytes / 1024**2,
            rank_peak_memory_mb=(
                None
                if result.rank_peak_memory_bytes is None
                else [None if peak is None else peak / 1024**2 for peak in result.rank_peak_memory_bytes]
            ),
            skipped_steps=result.skipped_steps,
        )
