"""``--parallel``: what it reads, and what it refuses before any process starts, each in one line naming it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ditq.errors import InputError
from ditq.runtime.parallel import ParallelSpec, check_parallel, parse_parallel, rank_devices

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("text", "spec"), [("cp=2", ParallelSpec("cp", 2)), (" TP=4 ", ParallelSpec("tp", 4))]
)
def test_parallel_reads_a_mode_and_a_degree(text: str, spec: ParallelSpec) -> None:
    assert parse_parallel(text) == spec
    assert str(spec) == text.strip().lower()


@pytest.mark.parametrize("text", ["cp=1", "cp=0", "dp=2", "cp", "cp=2,tp=2", "cp=1e3"])
def test_a_parallel_setting_it_cannot_read_is_one_line_naming_the_flag(text: str) -> None:
    with pytest.raises(InputError, match=r"^--parallel .*expected cp=N or tp=N") as error:
        parse_parallel(text)
    assert "\n" not in str(error.value)


def test_on_the_cpu_every_rank_computes_on_the_cpu() -> None:
    assert rank_devices(ParallelSpec("cp", 3), CPU) == ["cpu", "cpu", "cpu"]


@pytest.mark.parametrize(
    ("spec", "device", "which", "message"),
    [
        (ParallelSpec("tp", 2), CPU, "source", r"tensor parallelism runs on CUDA only, not on cpu"),
        (ParallelSpec("tp", 2), torch.device("cuda"), "w8a8", r"quantized Linears do not shard .* cp=2$"),
        (ParallelSpec("cp", 3), CPU, "source", r"2 attention heads do not share out over 3 ranks"),
    ],
)
def test_what_a_parallel_mode_cannot_serve_is_refused_before_any_process_starts(
    demo_artifacts: dict[str, Path], spec: ParallelSpec, device: torch.device, which: str, message: str
) -> None:
    with pytest.raises(InputError, match=rf"^--parallel {spec}: .*{message}"):
        check_parallel(demo_artifacts[which], spec, device)


def test_context_parallel_serves_only_the_transformers_it_has_a_plan_for(
    model_dir: Callable[..., Path],
) -> None:
    with pytest.raises(
        InputError, match=r"plan for QwenImage21Transformer2DModel only, not FluxTransformer2DModel"
    ):
        check_parallel(model_dir("flux"), ParallelSpec("cp", 2), CPU)
