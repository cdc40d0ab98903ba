"""``--cache``: diffusers' step caches on the tiny demo pipeline, under the prefix KV cache and on quantized layers.

What is served from the cache is counted per request; a setting that never skips changes no pixel; the prefix KV
cache's extract call is always computed; a cancelled request leaves nothing behind; and the settings and
combinations that cannot be served are refused in one line naming the flag. Without ditq's option, diffusers' own
``enable_cache`` works on a pipeline diffusers' ``from_pretrained`` loads from an artifact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import tiny_adapter

from ditq.errors import InputError
from ditq.runtime.adapter import GenerationCancelled, GenerationRequest, PipelineAdapter
from ditq.runtime.options import LoadOptions
from ditq.runtime.parallel import parse_parallel, refuse_beside_parallel
from ditq.runtime.step_cache import StepCacheRun, install_step_cache, parse_step_cache

STEPS = 6


def _request(**fields: object) -> GenerationRequest:
    references = [Image.new("RGBA", (32, 32), (200, 40 * i, 30, 255)) for i in range(2)]
    return GenerationRequest(
        prompt="a red square",
        images=references,
        width=32,
        height=32,
        num_inference_steps=STEPS,
        seed=3,
        **fields,
    )  # type: ignore[arg-type]


def _pixels(adapter: PipelineAdapter, request: GenerationRequest) -> np.ndarray:
    return np.asarray(adapter(request).images[0], dtype=np.int16)


def _cached(setting: str) -> tuple[PipelineAdapter, StepCacheRun]:
    adapter = tiny_adapter()
    return adapter, install_step_cache(adapter.pipeline, setting)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "fast",
            "--cache fast: not a step cache (use first-block:THRESHOLD or taylorseer:INTERVAL[:WARMUP])",
        ),
        ("first-block", "--cache first-block: expected first-block:THRESHOLD"),
        ("first-block:-0.1", "--cache first-block:-0.1: expected first-block:THRESHOLD"),
        ("first-block:nan", "--cache first-block:nan: expected first-block:THRESHOLD"),
        ("taylorseer:0", "--cache taylorseer:0: expected taylorseer:INTERVAL[:WARMUP]"),
        ("taylorseer:2:3:4", "--cache taylorseer:2:3:4: expected taylorseer:INTERVAL[:WARMUP]"),
        (
            "taylorseer:4:0",
            "--cache taylorseer:4:0: WARMUP 0 would predict a request's first call from nothing",
        ),
        ("mag:0.1", "--cache mag:0.1: MagCache needs magnitude ratios calibrated for this model"),
        ("auto", "--cache auto: only ditq sweep and ditq demo search a setting"),
    ],
)
def test_a_setting_that_cannot_be_served_is_refused_in_one_line_naming_the_flag(text: str, says: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_step_cache(text)
    assert str(caught.value).startswith(says)
    assert "\n" not in str(caught.value) and caught.value.field == "cache"


def test_settings_read_in_one_spelling_and_auto_only_where_searched() -> None:
    assert str(parse_step_cache(" first-block:0.10 ")) == "first-block:0.1"
    assert str(parse_step_cache("taylorseer:2")) == "taylorseer:2:3"  # diffusers' default warm-up, stated
    assert parse_step_cache("auto", allow_auto=True) is None


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (
            {"cache": "first-block:0.1", "compile": "eager"},
            "--cache first-block:0.1 with --compile: not supported",
        ),
        ({"cache": "mag:0.1"}, "--cache mag:0.1: MagCache needs"),
    ],
)
def test_load_options_refuse_a_step_cache_they_cannot_serve(options: dict[str, str], says: str) -> None:
    with pytest.raises(InputError, match="^" + says.replace("(", r"\(")):
        LoadOptions(device="cpu", **options)


def test_a_parallel_server_refuses_a_step_cache() -> None:
    with pytest.raises(InputError, match=r"^--parallel cp=2 with --cache first-block:0.1: not supported"):
        refuse_beside_parallel(parse_parallel("cp=2"), "none", None, None, None, "first-block:0.1")


def test_threshold_zero_skips_nothing_and_changes_no_pixel() -> None:
    request = _request()
    reference = _pixels(tiny_adapter(), request)
    adapter, run = _cached("first-block:0")
    result = adapter(request)
    assert run.calls == [False] * STEPS and result.skipped_steps == 0
    assert np.array_equal(np.asarray(result.images[0], dtype=np.int16), reference)


def test_first_block_skips_every_call_it_may_but_never_the_kv_cache_extract_call() -> None:
    """A threshold nothing stays above: each context's first call computes (the extract call alone in its own,
    the first cached call in the next), every later call is served from the cache, and the image still moves."""
    request = _request()
    reference = _pixels(tiny_adapter(), request)
    adapter, run = _cached("first-block:1e9")
    result = adapter(request)
    assert run.calls == [False, False] + [True] * (STEPS - 2)
    assert result.skipped_steps == STEPS - 2
    assert np.abs(np.asarray(result.images[0], dtype=np.int16) - reference).max() > 0


def test_block_hooks_cut_out_when_a_stream_prefetch_ends_its_tracing_are_mended_after_that_call() -> None:
    """diffusers' group offload with streams (CUDA only) registers a layer-execution tracker on every block before
    the cache's hooks, and removes them with its own lazy hook at the end of the transformer's first call, which cuts
    First Block Cache's block hooks out of their chain (``ditq.runtime.diffusers_hooks.reconnect_cut_hooks``).
    Reproduced on the CPU with diffusers' own tracker hook and registry: the calls skipped and the image are the
    run's without them, in the first request and the next."""
    from diffusers.hooks import HookRegistry, ModelHook
    from diffusers.hooks.group_offloading import (
        _LAYER_EXECUTION_TRACKER,
        _LAZY_PREFETCH_GROUP_OFFLOADING,
        LayerExecutionTrackerHook,
    )

    request = _request()
    plain, plain_run = _cached("first-block:1e9")
    expected = _pixels(plain, request)
    adapter = tiny_adapter()
    transformer = adapter.pipeline.transformer
    blocks = list(transformer.transformer_blocks)
    for block in blocks:
        HookRegistry.check_if_exists_or_initialize(block).register_hook(
            LayerExecutionTrackerHook(lambda: None), _LAYER_EXECUTION_TRACKER
        )

    class LazyPrefetch(
        ModelHook
    ):  # what diffusers' LazyPrefetchGroupOffloadingHook removes after its first call
        def post_forward(self, module: torch.nn.Module, output: object) -> object:
            for block in blocks:
                block._diffusers_hook.remove_hook(_LAYER_EXECUTION_TRACKER, recurse=False)
            module._diffusers_hook.remove_hook(_LAZY_PREFETCH_GROUP_OFFLOADING, recurse=False)
            return output

    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(
        LazyPrefetch(), _LAZY_PREFETCH_GROUP_OFFLOADING
    )
    run = install_step_cache(adapter.pipeline, "first-block:1e9")
    for _ in range(2):
        image = _pixels(adapter, request)
        assert sum(run.calls) > 0 and run.calls == plain_run.calls
        assert np.array_equal(image, expected)


def test_taylorseer_predicts_between_its_computed_calls() -> None:
    """interval 2, warm-up 1: the extract call, then the cached calls 0, 2, 4 of their context computed."""
    adapter, run = _cached("taylorseer:2:1")
    result = adapter(_request())
    assert run.calls == [False, False, True, False, True, False]
    assert result.skipped_steps == 2


def test_quantized_layers_run_under_the_hooks() -> None:
    from ditq.quantization.in_memory import quantize_
    from ditq.runtime.modules import QuantizedLinear

    adapter = tiny_adapter()
    quantize_(adapter.pipeline.transformer, "w8a8")
    assert any(isinstance(m, QuantizedLinear) for m in adapter.pipeline.transformer.modules())
    run = install_step_cache(adapter.pipeline, "first-block:1e9")
    assert adapter(_request()).skipped_steps == STEPS - 2 and run.skipped_steps == STEPS - 2


def test_a_cancelled_request_leaves_no_state_for_the_next() -> None:
    """Stopped after two steps, the request never reaches the pipeline's own reset; the next one begins afresh."""
    adapter, run = _cached("first-block:1e9")
    fresh = _pixels(adapter, _request())
    steps = iter(range(100))
    with pytest.raises(GenerationCancelled):
        adapter(_request(should_stop=lambda: "stop" if next(steps) == 2 else None))
    assert np.array_equal(_pixels(adapter, _request()), fresh)
    assert run.calls == [False, False] + [True] * (STEPS - 2)


def test_removed_the_transformer_computes_every_step_again() -> None:
    request = _request()
    reference = _pixels(tiny_adapter(), request)
    adapter, run = _cached("first-block:1e9")
    run.remove()
    assert np.array_equal(_pixels(adapter, request), reference)


def test_diffusers_own_pipeline_and_enable_cache_skip_steps_on_an_artifact(
    demo_artifacts: dict[str, Path],
) -> None:
    """No ditq option: ``import ditq.diffusers``, diffusers' ``DiffusionPipeline.from_pretrained`` of the fp8 demo
    artifact, diffusers' ``transformer.enable_cache(FirstBlockCacheConfig(...))`` and the pipeline's own call, which
    opens a cache context per kind of call as diffusers' pipelines do. Threshold 0 changes no pixel; a threshold
    nothing stays above serves all but each context's first call from the cache: the last block's attention runs
    for the extract call and the first cached call only."""
    from diffusers import DiffusionPipeline, FirstBlockCacheConfig

    import ditq.diffusers  # noqa: F401 - the compressed-tensors backend and the model family's blocks

    pipe = DiffusionPipeline.from_pretrained(str(demo_artifacts["fp8"]))
    computed: list[int] = []
    pipe.transformer.transformer_blocks[-1].attn.register_forward_hook(lambda *_: computed.append(1))
    references = _request().images

    def draw(threshold: float | None) -> tuple[np.ndarray, int]:
        if threshold is not None:
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        computed.clear()
        generator = torch.Generator().manual_seed(3)
        image = pipe(
            prompt="a red square",
            image=references,
            width=32,
            height=32,
            num_inference_steps=STEPS,
            generator=generator,
        ).images[0]
        if threshold is not None:
            pipe.transformer.disable_cache()
        return np.asarray(image, dtype=np.int16), len(computed)

    plain, plain_calls = draw(None)
    assert plain_calls == STEPS
    zero, zero_calls = draw(0.0)
    assert zero_calls == STEPS and np.array_equal(zero, plain)
    skipping, skipping_calls = draw(1e9)
    assert skipping_calls == 2 and np.abs(skipping - plain).max() > 0


def _open_cached(artifact: Path, setting: str, offload: str = "none", **options: object) -> PipelineAdapter:
    from ditq.pipeline.open import open_pipeline

    return open_pipeline(
        artifact,
        LoadOptions(device="cpu", offload=offload, cache=setting, skip_doctor=True, **options),  # type: ignore[arg-type]
    )


def _draw(adapter: PipelineAdapter) -> tuple[np.ndarray, list[bool]]:
    """The image of one request and, per transformer call, whether the cache served it."""
    image = _pixels(adapter, _request())
    return image, list(adapter.pipeline.ditq_step_cache.calls)


SKIPPING = ("first-block:1e9", "taylorseer:2:1")  # each serves some calls of the demo's six from the cache


@pytest.mark.parametrize("setting", SKIPPING)
@pytest.mark.parametrize("offload", ["model", "block"])
def test_an_offloaded_transformer_skips_the_steps_a_resident_one_skips_and_draws_its_image(
    demo_artifacts: dict[str, Path], offload: str, setting: str
) -> None:
    """diffusers' cache hooks wrap the offload hooks (``model``: accelerate's around the whole transformer;
    ``block``: diffusers' group offload around each block): the same calls are served from the cache, and the image
    is the resident cached run's, bit for bit (on the CPU the hooks move nothing, but every one of them runs)."""
    resident, resident_calls = _draw(_open_cached(demo_artifacts["source"], setting))
    image, calls = _draw(_open_cached(demo_artifacts["source"], setting, offload))
    assert sum(calls) > 0 and calls == resident_calls
    assert np.array_equal(image, resident)


@pytest.mark.parametrize("offload", ["model", "block", "auto"])
def test_a_cache_that_skips_nothing_changes_no_pixel_of_an_offloaded_run(
    demo_artifacts: dict[str, Path], offload: str
) -> None:
    """Threshold 0 under each offload mode: every call computed, the uncached offloaded run's image."""
    budget = {"memory_budget_bytes": 1} if offload == "auto" else {}
    uncached = _pixels(_open_cached(demo_artifacts["source"], None, offload, **budget), _request())  # type: ignore[arg-type]
    image, calls = _draw(_open_cached(demo_artifacts["source"], "first-block:0", offload, **budget))
    assert calls == [False] * STEPS and np.array_equal(image, uncached)


@pytest.mark.parametrize("setting", SKIPPING)
def test_auto_offload_streams_a_cached_transformer_loaded_or_demoted_alike(
    demo_artifacts: dict[str, Path], setting: str
) -> None:
    """``--offload auto``: a transformer that streams from the start (a budget nothing fits, so its hooks come
    first) and one demoted to streaming after the cache was installed skip the same calls, draw the image of the
    resident transformer beside the same streamed text encoder (the text encoder's hooks cost it torch's fused
    path: ``test_auto_offload_keeps_what_runs_most_and_streams_the_rest``), and copy the same blocks: a block the
    cache skips is not copied in either."""
    from diffusers.hooks.group_offloading import ModuleGroup

    copies: list[int] = []
    onload = ModuleGroup.onload_

    def counted(group: ModuleGroup) -> None:
        copies.append(1)
        onload(group)

    demoted = _open_cached(demo_artifacts["source"], setting, "auto")  # no budget on the CPU: all resident
    placement = demoted.pipeline.ditq_placement
    assert placement.demote(demoted.pipeline) == "text_encoder streams from pinned host memory"
    reference, reference_calls = _draw(demoted)
    assert placement.demote(demoted.pipeline) == "transformer streams from pinned host memory"
    loaded = _open_cached(demo_artifacts["source"], setting, "auto", memory_budget_bytes=1)
    assert loaded.pipeline.ditq_placement.streamed == ["transformer", "text_encoder"]
    drawn = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModuleGroup, "onload_", counted)
        for name, adapter in (("demoted", demoted), ("loaded", loaded)):
            copies.clear()
            drawn[name] = (*_draw(adapter), len(copies))
    assert sum(reference_calls) > 0
    for image, calls, _copies in drawn.values():
        assert calls == reference_calls and np.array_equal(image, reference)
    assert drawn["demoted"][2] == drawn["loaded"][2] > 0


def test_the_open_context_is_read_through_diffusers_public_property() -> None:
    """``StateManager.context`` raises for none: a transformer called outside any pipeline context reads None."""
    from diffusers.hooks.hooks import CacheContext, StateManager

    from ditq.runtime.step_cache import _open_context

    state = StateManager(object)
    assert _open_context(state) is None
    state.set_context(CacheContext("cond"))
    assert _open_context(state) == CacheContext("cond")
