"""One calling convention for every diffusers pipeline: a generic request mapped onto ``__call__``.

Pipelines disagree on names (``image`` vs ``images``, ``true_cfg_scale`` vs
``guidance_scale``, ``num_images_per_prompt`` vs ``num_videos_per_prompt``)
and on what they accept at all. The adapter reads the pipeline's signature
once, maps each request field onto the parameter that means the same thing,
and refuses a field the pipeline cannot take with an error that names it.

Per-stage timings come from ``ditq.runtime.stage_clock.StageClock``, which wraps
the pipeline's own stages for the length of one call; the adapter marks each
denoising step's end from ``callback_on_step_end``.

A call can be stopped between denoising steps: the request's ``should_stop``
is asked after every step (from ``callback_on_step_end``) and a reason it
returns is raised there as :class:`GenerationCancelled`. Raising, rather than setting diffusers'
``_interrupt``, works for every pipeline that calls the callback (the demo
pipeline has no ``_interrupt``) and skips the VAE decode that ``_interrupt``
still runs on the unfinished latents.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ditq.errors import DitqError, InputError
from ditq.runtime.lora_adapters import LoraAdapters
from ditq.runtime.postprocess import pixels_on_device
from ditq.runtime.prefix_release import released_at_decode
from ditq.runtime.stage_clock import StageClock

__all__ = [
    "GenerationCancelled",
    "GenerationRequest",
    "GenerationResult",
    "PipelineAdapter",
    "model_scheduler",
    "parse_size",
    "steps_refusal",
]

# Generic request field -> pipeline parameter names that carry it, in preference order.
_PARAMETER_NAMES: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt",),
    "negative_prompt": ("negative_prompt",),
    "images": ("image", "images"),
    "width": ("width",),
    "height": ("height",),
    "num_inference_steps": ("num_inference_steps",),
    "guidance_scale": ("guidance_scale", "true_cfg_scale"),
    "true_cfg_scale": ("true_cfg_scale", "guidance_scale"),
    "seed": ("generator",),
    "num_images": ("num_images_per_prompt", "num_videos_per_prompt"),
}
DEFAULT_MAX_REFERENCE_IMAGES = 4
_SIZE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})")  # six digits at most: no 4000-digit integers


def parse_size(text: str, field: str = "size") -> tuple[int, int]:
    """'WxH' -> (width, height); anything else is an InputError naming ``field``."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None:
        raise InputError(f"{field}: expected WxH (e.g. 1024x1024), got '{text[:40]}'", field=field)
    return int(match.group(1)), int(match.group(2))


class GenerationCancelled(DitqError):
    """A call stopped between denoising steps because ``should_stop`` gave a reason."""

    def __init__(self, reason: str, steps_done: int) -> None:
        super().__init__(f"generation cancelled after {steps_done} steps: {reason}")
        self.reason = reason
        self.steps_done = steps_done


@dataclass
class GenerationRequest:
    prompt: str
    negative_prompt: str | None = None
    images: list[Image.Image] = field(default_factory=list)  # reference images (edits)
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None  # 0 is a valid seed
    num_images: int = 1
    # LoRA adapters by name and scale (a scale None: the adapter's own); None: every adapter loaded, at its scale;
    # empty: none (``ditq.runtime.lora_adapters``)
    lora: tuple[tuple[str, float | None], ...] | None = None
    # Asked after every denoising step: a reason (e.g. "timeout") stops the call there; None goes on.
    should_stop: Callable[[], str | None] | None = None


@dataclass
class GenerationResult:
    images: list[Image.Image]
    timings: dict[str, float]  # seconds: text_encoding, denoising, decoding, postprocess, total
    step_times: list[float]  # seconds per denoising step
    peak_memory_bytes: int | None  # peak accelerator memory for this call (None on CPU)
    # CUDA: peak allocated bytes per stage (text_encoding, image_encoding, first_step, later_steps, decoding,
    # other; ``ditq.runtime.stage_clock``) and what was allocated when the call began; None on the CPU
    stage_peak_memory_bytes: dict[str, int] | None = None
    memory_at_start_bytes: int | None = None
    # a parallel server's call (``ditq.serve.ranks``): each rank's peak for it, rank 0 first (None on the CPU)
    rank_peak_memory_bytes: list[int | None] | None = None
    # --cache: the transformer calls served from the step cache (``ditq.runtime.step_cache``); None without one
    skipped_steps: int | None = None


def _sigmas_finite(scheduler: Any, steps: int) -> bool | None:
    """Whether a diffusers ``scheduler`` computes finite sigmas at ``steps`` denoising steps, set on a copy (the
    scheduler itself keeps its state); None where that cannot be told without its pipeline (no config or
    ``set_timesteps``, or timesteps that need what only the pipeline passes)."""
    config = getattr(scheduler, "config", None)
    if config is None or not hasattr(scheduler, "set_timesteps") or not hasattr(scheduler, "from_config"):
        return None
    copy = type(scheduler).from_config(config)
    # a dynamic shift's mu comes from the image's size; any mu meets the division at the terminal
    shift = {"mu": 1.0} if getattr(config, "use_dynamic_shifting", False) else {}
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            copy.set_timesteps(steps, **shift)
    except (TypeError, ValueError):
        return None
    sigmas = getattr(copy, "sigmas", None)
    return None if sigmas is None else bool(torch.isfinite(torch.as_tensor(sigmas)).all())


def steps_refusal(scheduler: Any, steps: int) -> str | None:
    """Why ``scheduler`` cannot take ``steps`` denoising steps: it computes a NaN or an infinite sigma there (a
    flow-match scheduler that stretches its shift to a terminal value, Qwen-Image's, divides by zero at one step,
    and every noisy latent is then NaN); None where it can, or where that cannot be told without its pipeline."""
    if _sigmas_finite(scheduler, steps) is not False:
        return None
    count = f"{steps} step{'s' if steps != 1 else ''}"
    return (
        f"the model's scheduler ({type(scheduler).__name__}) computes a NaN or infinite sigma at {count}, which "
        "leaves every noisy latent NaN; give more steps"
    )


def model_scheduler(model_dir: Path, index: Mapping[str, Any]) -> Any | None:
    """The scheduler a diffusers model directory names (``index``: its ``model_index.json``), made from its config
    alone, where it is one of diffusers' own scheduler classes; None for another library's, or one that does not
    load (what ``steps_refusal`` is asked of before any weight is loaded)."""
    import diffusers

    entry = index.get("scheduler")
    if not (
        isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers" and isinstance(entry[1], str)
    ):
        return None
    kind = getattr(diffusers, entry[1], None)
    if not (isinstance(kind, type) and issubclass(kind, diffusers.SchedulerMixin)):
        return None
    try:
        return kind.from_pretrained(model_dir, subfolder="scheduler")
    except (OSError, ValueError, TypeError):
        return None


class PipelineAdapter:
    """Maps a GenerationRequest onto one diffusers pipeline's ``__call__``."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        # the prefix KV cache is let go when the VAE begins decoding (False: held to the call's end, as the
        # pipeline holds it; what the memory benchmark measures the release against)
        self.release_prefix_cache = True
        # diffusers' own step bar is off: a server's log gets no carriage returns, and ``ditq generate`` draws
        # one bar for every pipeline (``ditq.pipeline.generate``)
        configure = getattr(pipeline, "set_progress_bar_config", None)
        if callable(configure):
            configure(disable=True)
        self.load_facts: dict[str, Any] = {}  # what loading found out (e.g. the time kernel choice took)
        # the kernel chooser the opener used (``ditq.pipeline.open``); the server's doctor record reads what it chose
        self.kernel_chooser: Any = None
        self.parameters = set(inspect.signature(pipeline.__call__).parameters)
        self._targets = {
            name: next((p for p in candidates if p in self.parameters), None)
            for name, candidates in _PARAMETER_NAMES.items()
        }
        images_target = self._targets["images"]
        self.max_reference_images = (
            0
            if images_target is None
            else int(self._setting("max_reference_images", DEFAULT_MAX_REFERENCE_IMAGES))
        )
        vae_scale_factor = int(self._setting("vae_scale_factor", 8))
        # DiT pipelines pack latents 2x2 into tokens, so sizes align to twice the VAE factor.
        self.size_alignment = int(self._setting("size_alignment", vae_scale_factor * 2))
        self.default_size = self._default_size(vae_scale_factor)
        self.default_steps = self._default_steps()
        # Pixels one reference image becomes inside the pipeline, where it says (a square reference_size);
        # None: the pipeline does not say.
        reference_size = self._setting("reference_size", None)
        self.reference_pixels = int(reference_size) ** 2 if isinstance(reference_size, int) else None
        # the LoRA adapters loaded on the pipeline (``ditq.runtime.lora_adapters``); each call activates its choice
        self.lora: LoraAdapters | None = None
        self._steps_refused: dict[int, str | None] = {}  # steps -> ``steps_refusal``'s answer

    def steps_refusal(self, steps: int) -> str | None:
        """``steps_refusal`` of the pipeline's scheduler (its image would be NaN), cached by count."""
        if steps not in self._steps_refused:
            self._steps_refused[steps] = steps_refusal(getattr(self.pipeline, "scheduler", None), steps)
        return self._steps_refused[steps]

    @property
    def cancellable(self) -> bool:
        """Whether a call can be stopped between steps (the pipeline takes ``callback_on_step_end``)."""
        return "callback_on_step_end" in self.parameters

    def _setting(self, name: str, default: Any) -> Any:
        """A pipeline attribute, or the same key of its registered config, or ``default``."""
        value = getattr(type(self.pipeline), name, None)
        if value is None:
            value = vars(self.pipeline).get(name)
        if value is None:
            config = getattr(self.pipeline, "config", None)
            value = config.get(name) if isinstance(config, dict) else None
        return default if value is None else value

    def _default_size(self, vae_scale_factor: int) -> tuple[int, int]:
        explicit = self._setting("default_size", None)
        if isinstance(explicit, int):
            return explicit, explicit
        if explicit is not None:
            width, height = explicit
            return int(width), int(height)
        sample_size = self._setting("default_sample_size", None)
        if isinstance(sample_size, int):
            return sample_size * vae_scale_factor, sample_size * vae_scale_factor
        return 1024, 1024

    def _default_steps(self) -> int:
        """The steps a request without num_inference_steps gets: the pipeline's setting, else its signature's."""
        configured = self._setting("default_num_inference_steps", None)
        if isinstance(configured, int):
            return configured
        parameter = inspect.signature(self.pipeline.__call__).parameters.get("num_inference_steps")
        default = parameter.default if parameter is not None else None
        return default if isinstance(default, int) else 50

    @property
    def pipeline_name(self) -> str:
        return type(self.pipeline).__name__

    def supports(self, field_name: str) -> bool:
        if field_name not in _PARAMETER_NAMES:
            raise InputError(f"unknown request field {field_name!r} (known: {', '.join(_PARAMETER_NAMES)})")
        return self._targets[field_name] is not None

    def _target(self, field_name: str) -> str:
        target = self._targets[field_name]
        if target is None:
            raise InputError(
                f"{self.pipeline_name} cannot take the argument {field_name!r}", field=field_name
            )
        return target

    def build_kwargs(self, request: GenerationRequest) -> dict[str, Any]:
        """The keyword arguments for ``pipeline.__call__``; a field the pipeline cannot take is an InputError."""
        if not request.prompt:
            raise InputError("prompt: must not be empty", field="prompt")
        kwargs: dict[str, Any] = {self._target("prompt"): request.prompt}
        if request.negative_prompt is not None:
            kwargs[self._target("negative_prompt")] = request.negative_prompt
        if request.images:
            target = self._target("images")
            if len(request.images) > self.max_reference_images:
                raise InputError(
                    f"images: {len(request.images)} reference images given, "
                    f"{self.pipeline_name} takes at most {self.max_reference_images}",
                    field="images",
                )
            kwargs[target] = list(request.images)
        for name in ("width", "height"):
            value = getattr(request, name)
            if value is None:
                continue
            if value <= 0 or value % self.size_alignment:
                raise InputError(
                    f"{name}: {value} is not a positive multiple of {self.size_alignment}", field=name
                )
            kwargs[self._target(name)] = value
        if request.num_inference_steps is not None:
            if request.num_inference_steps <= 0:
                raise InputError(
                    f"num_inference_steps: must be positive, got {request.num_inference_steps}",
                    field="num_inference_steps",
                )
            kwargs[self._target("num_inference_steps")] = request.num_inference_steps
        for name in ("guidance_scale", "true_cfg_scale"):
            value = getattr(request, name)
            if value is not None:
                target = self._target(name)
                if target in kwargs:
                    raise InputError(
                        f"{name}: {self.pipeline_name} has one guidance argument ({target})", field=name
                    )
                kwargs[target] = value
        if request.seed is not None:
            self._target("seed")
            # A CPU generator gives the same noise on every device (diffusers moves it over).
            kwargs["generator"] = torch.Generator(device="cpu").manual_seed(int(request.seed))
        if request.num_images != 1:
            if request.num_images < 1:
                raise InputError(
                    f"num_images: must be at least 1, got {request.num_images}", field="num_images"
                )
            kwargs[self._target("num_images")] = request.num_images
        if "output_type" in self.parameters:
            kwargs["output_type"] = "pil"
        return kwargs

    def _execution_device(self) -> torch.device:
        device = getattr(self.pipeline, "_execution_device", None)
        return torch.device(device) if device is not None else torch.device("cpu")

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        """Run one request. ``request.should_stop`` is asked after every denoising step (where the pipeline
        takes ``callback_on_step_end``); a reason it returns stops the call with :class:`GenerationCancelled`."""
        kwargs = self.build_kwargs(request)
        self._activate_lora(request)
        should_stop = request.should_stop
        device = self._execution_device()
        clock = StageClock(device)
        if self.cancellable:

            def on_step_end(
                _pipe: Any, _step: int, _timestep: Any, callback_kwargs: dict[str, Any]
            ) -> dict[str, Any]:
                steps_done = clock.mark_step()
                if should_stop is not None and (reason := should_stop()) is not None:
                    raise GenerationCancelled(reason, steps_done)
                return callback_kwargs

            kwargs["callback_on_step_end"] = on_step_end
            if "callback_on_step_end_tensor_inputs" in self.parameters:
                kwargs["callback_on_step_end_tensor_inputs"] = []  # the timer reads no tensors
        # the prefix KV cache is let go before the decode's memory is measured (``ditq.runtime.prefix_release``)
        release = released_at_decode(self.pipeline) if self.release_prefix_cache else nullcontext()
        # the images leave the device as 8-bit pixels (``ditq.runtime.postprocess``): the same pixels, a quarter the bytes
        step_cache = getattr(self.pipeline, "ditq_step_cache", None)
        if step_cache is not None:
            step_cache.begin()
        with clock.instrument(self.pipeline), release, pixels_on_device(self.pipeline):
            start = clock.begin()
            try:
                with torch.inference_mode():
                    output = self.pipeline(**kwargs)
            except GenerationCancelled:
                self._release_offload_hooks()
                raise
            except Exception as error:
                # where it ran out (say): what an auto placement's next step should free (Placement.demote)
                error.ditq_stage = clock.failed_stage()  # type: ignore[attr-defined]
                raise
            end = clock.end()
        images = getattr(output, "images", None)
        if images is None:
            raise DitqError(f"{self.pipeline_name} returned no images (output {type(output).__name__})")
        return GenerationResult(
            images=list(images),
            timings=clock.timings(start, end),
            step_times=clock.step_times(),
            peak_memory_bytes=clock.peak_bytes(),
            stage_peak_memory_bytes=dict(clock.stage_peaks) if clock.cuda else None,
            memory_at_start_bytes=clock.start_allocated,
            skipped_steps=None if step_cache is None else step_cache.skipped_steps,
        )

    def _activate_lora(self, request: GenerationRequest) -> None:
        """The request's adapters made the active set, before its call: one call's choice never reaches the next."""
        if self.lora is not None:
            self.lora.activate(self.lora.resolve(request.lora))
        elif request.lora:
            raise InputError("lora: the served pipeline has no LoRA adapters loaded", field="lora")

    @staticmethod
    def failed_stage(error: BaseException) -> str | None:
        """The stage a call that raised ``error`` was in (``StageClock.failed_stage``); None where unknown."""
        stage = getattr(error, "ditq_stage", None)
        return stage if isinstance(stage, str) else None

    def _release_offload_hooks(self) -> None:
        """What a pipeline does at the end of a finished call and a cancelled one skipped: with model offload,
        put every model back on the host (diffusers' ``maybe_free_model_hooks``)."""
        release = getattr(self.pipeline, "maybe_free_model_hooks", None)
        if callable(release):
            release()
