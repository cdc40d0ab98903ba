"""One pipeline over several devices through diffusers' own parallelism (``--parallel cp=N`` or ``tp=N``).

Every rank is one process with one device (a CUDA device each; on a host without one, every rank computes on the CPU)
and holds the whole pipeline; only the transformer is parallel, through ``ModelMixin.enable_parallelism``:

- ``cp=N``, context parallel: each rank runs every layer on its share of a sequence's tokens, and attention gathers
  the heads (diffusers' Ulysses attention). Quantized Linears work unchanged, since they only see fewer tokens.
  Only for a model family whose folder holds a plan (Qwen-Image-2.1's is ditq's,
  ``ditq.runtime.models.qwenimage21.context_parallel``; diffusers declares none).
- ``tp=N``, tensor parallel: each rank holds 1/N of every block's projections (diffusers' ``_tp_plan``, as
  DTensors), on CUDA, for a transformer in source precision. A quantized one is refused: diffusers shards
  ``nn.Linear`` weights, and ditq's quantized Linears do not shard with their per-channel scales.

``check_parallel`` refuses what cannot run before any process starts, one line naming ``--parallel``;
``apply_parallelism`` makes a loaded pipeline's transformer parallel, on every rank alike, inside the process group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ditq.checkpoint.layout import component_class, load_component_config, read_model_index
from ditq.errors import InputError
from ditq.runtime.classes import import_class

__all__ = [
    "ParallelSpec",
    "apply_parallelism",
    "check_parallel",
    "parse_parallel",
    "rank_devices",
    "refuse_beside_parallel",
]

_SPEC = re.compile(r"(cp|tp)=([0-9]{1,3})")


@dataclass(frozen=True)
class ParallelSpec:
    """How many ranks, and how they share the transformer."""

    mode: Literal["cp", "tp"]
    degree: int

    def __str__(self) -> str:
        return f"{self.mode}={self.degree}"


def parse_parallel(text: str) -> ParallelSpec:
    """'cp=2' -> ParallelSpec('cp', 2); anything else is an InputError naming --parallel."""
    match = _SPEC.fullmatch(text.strip().lower())
    if match is None or int(match.group(2)) < 2:
        raise InputError(f"--parallel {text!r}: expected cp=N or tp=N with N at least 2 (cp=2, say)")
    return ParallelSpec(match.group(1), int(match.group(2)))  # type: ignore[arg-type]


def refuse_beside_parallel(
    spec: ParallelSpec,
    offload: str,
    max_memory: str | None,
    attention: str | None,
    compile: str | None,
    cache: str | None = None,
) -> None:
    """An option a parallel server cannot serve with, refused in one line naming both (every rank holds a whole
    device, in the model's own attention, eager, every step computed: a step cache's rank would decide alone)."""
    for flag, value in (
        ("--offload", None if offload == "none" else offload),
        ("--max-memory", max_memory),
        ("--attention", attention),
        ("--compile", compile),
        ("--cache", cache),
    ):
        if value is not None:
            raise InputError(
                f"--parallel {spec} with {flag} {value}: not supported (every rank holds a whole device)"
            )


def rank_devices(spec: ParallelSpec, device: torch.device) -> list[str]:
    """Each rank's device: ``cuda:0`` .. ``cuda:N-1`` (CUDA_VISIBLE_DEVICES chooses which cards), or the CPU for every
    rank."""
    if device.type == "cpu":
        return ["cpu"] * spec.degree
    if device.index is not None:
        raise InputError(
            f"--device {device}: with --parallel {spec} each rank takes its own device (cuda:0 .. "
            f"cuda:{spec.degree - 1}); give --device cuda, and CUDA_VISIBLE_DEVICES to choose the cards"
        )
    count = torch.cuda.device_count()
    if spec.degree > count:
        raise InputError(f"--parallel {spec}: this machine has {count} CUDA device{'s' * (count != 1)}")
    return [f"cuda:{rank}" for rank in range(spec.degree)]


def check_parallel(model_dir: Path, spec: ParallelSpec, device: torch.device) -> None:
    """What ``spec`` cannot serve of ``model_dir`` on ``device``, refused in one line naming --parallel."""
    from ditq.runtime.loader import is_quantized_component
    from ditq.runtime.models import FAMILIES, family_named

    index = read_model_index(model_dir)
    if "transformer" not in index:
        raise InputError(f"--parallel {spec}: {model_dir} has no transformer to make parallel")
    library, class_name = component_class(index, "transformer")
    family = family_named(class_name)
    if spec.mode == "cp" and (family is None or not family.context_parallel_plan):
        planned = [name for name, known in FAMILIES.items() if known.context_parallel_plan]
        raise InputError(
            f"--parallel {spec}: ditq has a context-parallel plan for {', '.join(planned)} only, not {class_name}"
        )
    heads = load_component_config(model_dir / "transformer").get("num_attention_heads")
    if isinstance(heads, int) and not _heads_share_out(heads, spec):
        raise InputError(
            f"--parallel {spec}: the transformer's {heads} attention heads do not share out over {spec.degree} ranks"
        )
    if spec.mode == "tp":
        if device.type != "cuda":
            raise InputError(
                f"--parallel {spec}: diffusers' tensor parallelism runs on CUDA only, not on {device.type}"
            )
        if (
            getattr(import_class(library, class_name, f"{model_dir}/model_index.json"), "_tp_plan", None)
            is None
        ):
            raise InputError(f"--parallel {spec}: diffusers has no tensor-parallel plan for {class_name}")
        if is_quantized_component(model_dir, "transformer") is not None:
            raise InputError(
                f"--parallel {spec}: diffusers' tensor parallelism shards nn.Linear weights, and the transformer's "
                f"quantized Linears do not shard with their per-channel scales; serve it with cp={spec.degree}"
            )


def _heads_share_out(heads: int, spec: ParallelSpec) -> bool:
    """Tensor parallelism needs a multiple of N heads; Ulysses pads them to one, as long as the padding is less than
    one rank's share (diffusers' ``ulysses_anything``)."""
    if heads % spec.degree == 0:
        return True
    return spec.mode == "cp" and spec.degree - heads % spec.degree < -(-heads // spec.degree)


def apply_parallelism(pipeline: Any, spec: ParallelSpec) -> None:
    """``pipeline.transformer`` made parallel over the default process group's ranks (every rank calls this)."""
    transformer = pipeline.transformer
    if spec.mode == "cp":
        from ditq.runtime.models import model_family

        family = model_family(transformer)
        assert family is not None, "check_parallel refuses a transformer without a context-parallel plan"
        family.enable_context_parallel(transformer, spec.degree)
        return
    from diffusers.models._modeling_parallel import TensorParallelConfig

    transformer.enable_parallelism(config=TensorParallelConfig(tp_degree=spec.degree))
