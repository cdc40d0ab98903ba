"""Shared test set-up: this folder is importable (``from tiny_models import ...``), plus model-directory fixtures."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# One OpenMP thread per process, set before torch loads: make test runs two workers on two cores, and each sweep
# test's servers and commands compute beside them. With OpenMP's default (a thread per core) the processes' threads
# spun waiting for each other: a 21 s test took 197 s beside a sweep. The models here are too small to gain from
# threads. The workers and every process they start inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# ditq's cache folder (the doctor's verdicts, compiled code) for this run alone, never the user's
if "DITQ_CACHE_DIR" not in os.environ:
    os.environ["DITQ_CACHE_DIR"] = tempfile.mkdtemp(prefix="ditq-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DITQ_CACHE_DIR"], ignore_errors=True)

from collections.abc import Callable
from pathlib import Path

import pytest
from lora_kit import add_seeded_adapter, save_adapter_files
from tiny_models import make_model_dir, plan_file, save_tiny_pipeline

import ditq
from ditq.plan import write_plan


@pytest.fixture
def model_dir(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``model_dir("flux", shards=2, text_encoder=True)`` -> a fresh tiny diffusers directory."""

    def make(name: str = "flux", **kwargs: object) -> Path:
        folder = tmp_path / f"src-{len(list(tmp_path.glob('src-*')))}"
        folder.mkdir()
        return make_model_dir(folder, name, **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
def artifact(model_dir: Callable[..., Path], tmp_path: Path) -> Callable[..., tuple[Path, Path]]:
    """Factory: ``artifact("wan", "w8a8", shards=2)`` -> (source dir, quantized artifact dir)."""

    def make(
        name: str = "flux", scheme: str = "w8a8", shards: int = 1, **kwargs: object
    ) -> tuple[Path, Path]:
        source = model_dir(name, shards=shards, text_encoder=kwargs.pop("text_encoder", False))
        out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
        ditq.quantize(source, out, scheme, **kwargs)  # type: ignore[arg-type]
        return source, out

    return make


@pytest.fixture(scope="session")
def mixed_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(source, artifact, PLAN.json): the tiny Flux model quantized with the hand-written mixed plan
    (``tiny_models.MIXED_FLUX_LAYERS``: fp8, w8a8, w8a16 and keep). Shared: copy it before changing it."""
    folder = tmp_path_factory.mktemp("mixed")
    source = make_model_dir(folder, "flux")
    plan = folder / "PLAN.json"
    write_plan(plan, plan_file(source))
    out = folder / "artifact"
    ditq.quantize(source, out, plan=plan)
    return source, out, plan


@pytest.fixture(scope="session")
def demo_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny demo pipeline (seed 0, float32) as ``source`` and quantized with each scheme (``w8a8``, ``w8a16``,
    ``fp8``, ``w4a16``, ``w4a8``: one artifact each). Shared: copy one before changing it."""

    root = tmp_path_factory.mktemp("demo-artifacts")
    save_tiny_pipeline(root / "source")
    dirs = {"source": root / "source"}
    for scheme in ("w8a8", "w8a16", "fp8", "w4a16", "w4a8"):
        dirs[scheme] = ditq.quantize(root / "source", root / scheme, scheme).path
    return dirs


@pytest.fixture(scope="session")
def lora_files(demo_artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A seeded rank-4 adapter on the fp8 demo's attention projections (``lora_kit.add_seeded_adapter``), saved with
    peft's keys (``peft``: a file) and with diffusers' (``diffusers``: a folder). Shared: copy before changing."""
    pytest.importorskip("peft")
    pipeline = ditq.load_pipeline(demo_artifacts["fp8"], device="cpu")
    state = add_seeded_adapter(pipeline.transformer)
    return save_adapter_files(state, tmp_path_factory.mktemp("lora"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked slow run first, in their order, so that under ``-n 2 --dist worksteal`` (``make test``) they
    are not left for last: the first worker starts on them, the second on the rest, and whichever runs out first
    takes over what is left of the other's."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
