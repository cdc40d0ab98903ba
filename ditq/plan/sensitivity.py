"""Per-layer sensitivity, measured: the source pipeline on the fixtures, and again with one unit quantized.

A unit is one Linear, one block's Linears or the whole component's; it is quantized in memory with ditq's own
arithmetic (``ditq.numerics.quantize_weight``, the codec's stored form, the runtime's ``QuantizedLinear`` and its
kernel path), so a unit computes exactly as the same layer of a quantized checkpoint does on this device. Its
rounding is the artifact's (``Rounding``): to nearest, or GPTQ from Hessians gathered once per plan (every
(layer, scheme) rounded then and kept), with the low-rank branch beside 4-bit layers where asked for.

Two measures per unit and scheme:

- **proxy** — the relative L2 error of the component's output over the first ``proxy_steps`` denoising steps of
  ``proxy_seeds``. The component's inputs are recorded once, during the reference run, and replayed in one
  batched forward per fixture (a prefix KV cache, diffusers' ``kv_cache``, is dropped on replay: the whole
  sequence is computed, which the cache only shortcuts). The error is taken against the same replay
  unquantized, not against the recorded output: what the replay computes differently from the run (the dropped
  cache, another batch's kernels and rounding) would otherwise sit under every unit's error as a floor. Cheap:
  a few forwards per unit.
- **psnr_db** — the final image's PSNR against the source-precision image, as ``ditq compare`` computes it, mean
  over ``image_seeds``: a whole pipeline run per fixture and seed, so it is measured for blocks and the whole
  component (to validate and calibrate the proxy), not for every layer.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ditq.errors import DitqError, InputError
from ditq.judge.baseline import AdapterExecutor
from ditq.judge.compare import PSNR_CAP_DB
from ditq.metrics import fidelity_arrays, load_png_array, psnr
from ditq.probe.fixtures import Fixture
from ditq.probe.runner import Reply, run_matrix
from ditq.quantization.defaults import DEFAULTS
from ditq.quantization.in_memory import held_linear
from ditq.quantization.plan_file import KEEP, LayerSensitivity, PlanRounding
from ditq.quantization.rewrite import StoredLayer, band_workers, encode_weight
from ditq.runfiles import RunDescription
from ditq.runtime.adapter import PipelineAdapter
from ditq.runtime.modules import QuantizedLinear
from ditq.schemes import SCHEMES

__all__ = [
    "Rounding",
    "Sensitivity",
    "Unit",
    "Workbench",
    "image_psnr_db",
    "layers_quantized",
    "measure_sensitivity",
    "quantized_copy",
]

log = logging.getLogger(__name__)

# Keyword arguments that hold a prefix KV cache: replayed as None (the whole sequence computed instead).
_CACHE_ARGUMENTS = ("kv_cache", "kv_cache_mode")


@dataclass
class Rounding:
    """How a unit's Linears are rounded, as ``ditq quantize --plan`` will round them (``record``, the plan's
    ``rounding``): to nearest, with the low-rank branch beside 4-bit layers where ``record.low_rank`` asks for it;
    or, for ``calibrated``'s (layer, scheme) pairs, GPTQ's stored layers, rounded once from the plan's Hessians."""

    record: PlanRounding = field(default_factory=PlanRounding)
    calibrated: dict[str, dict[str, StoredLayer]] = field(default_factory=dict)  # layer -> scheme -> stored

    def stored(self, name: str, linear: torch.nn.Linear, scheme_name: str) -> StoredLayer:
        """Layer ``name`` (``linear``) in ``scheme_name`` (fitted to it) as the artifact stores it."""
        found = self.calibrated.get(name, {}).get(scheme_name)
        if found is not None:
            return found
        weight = linear.weight.detach()
        scheme = SCHEMES[scheme_name].fitted(linear.in_features)
        with band_workers() as pool:
            return encode_weight(
                weight, scheme, weight.device, DEFAULTS["band_bytes"], pool, self.record.low_rank or 0
            )

    def copy(self, name: str, linear: torch.nn.Linear, scheme_name: str) -> QuantizedLinear:
        """``stored``'s layer held by the runtime's QuantizedLinear on ``linear``'s device; ``linear`` unchanged."""
        scheme = SCHEMES[scheme_name].fitted(linear.in_features)
        return held_linear(linear, self.stored(name, linear, scheme_name), scheme, linear.weight.device)[0]


def quantized_copy(linear: torch.nn.Linear, scheme_name: str) -> QuantizedLinear:
    """``linear`` rounded to nearest by the in-memory quantizer (``ditq.quantize_``'s arithmetic: as ``ditq
    quantize`` stores it), held by the runtime's QuantizedLinear on the same device; ``linear`` is not changed."""
    return Rounding().copy("", linear, scheme_name)


@contextmanager
def layers_quantized(
    component: torch.nn.Module, assignment: Mapping[str, str], rounding: Rounding | None = None
) -> Iterator[None]:
    """Inside the block, each named Linear of ``component`` is its quantized copy, rounded as ``rounding`` says
    (None: to nearest) (``keep``: left as it is)."""
    rounding = rounding if rounding is not None else Rounding()
    swapped: dict[str, torch.nn.Module] = {}
    try:
        for name, scheme in assignment.items():
            if scheme == KEEP:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = component.get_submodule(parent_name) if parent_name else component
            original = getattr(parent, attr)
            if not isinstance(original, torch.nn.Linear):
                raise InputError(f"{name}: not a Linear of the component ({type(original).__name__})")
            swapped[name] = original
            setattr(parent, attr, rounding.copy(name, original, scheme))
        yield
    finally:
        for name, original in swapped.items():
            parent_name, _, attr = name.rpartition(".")
            setattr(component.get_submodule(parent_name) if parent_name else component, attr, original)


def image_psnr_db(reference_png: bytes, candidate_png: bytes) -> float:
    """PSNR of two PNGs as ``ditq compare`` computes it: RGBA with RGBA when both carry alpha, otherwise both
    over white; identical images at compare's cap."""
    a, a_mode = load_png_array(reference_png)
    b, b_mode = load_png_array(candidate_png)
    x, y = fidelity_arrays(a, b, a_mode, b_mode)
    return min(psnr(x, y), PSNR_CAP_DB)


def _output_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list):
        return _output_tensor(output[0])
    sample = getattr(output, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    raise DitqError(f"cannot read the component's output ({type(output).__name__})")


@dataclass
class _Call:
    kwargs: dict[str, Any]
    output: torch.Tensor


@dataclass
class _Replay:
    """One fixture's recorded calls, batched: the keyword arguments and the reference output (B, tokens, ...)."""

    kwargs: dict[str, Any]
    reference: torch.Tensor

    @classmethod
    def batch(cls, calls: Sequence[_Call], where: str) -> _Replay:
        first = calls[0].kwargs
        kwargs: dict[str, Any] = {}
        for name, value in first.items():
            values = [c.kwargs[name] for c in calls]
            if name in _CACHE_ARGUMENTS:
                kwargs[name] = None
            elif isinstance(value, torch.Tensor) and all(
                v.ndim > 0 and v.shape[0] == c.output.shape[0] for v, c in zip(values, calls, strict=True)
            ):  # a batch dimension first, as the output's: one batch of every call
                try:
                    kwargs[name] = torch.cat(values)
                except RuntimeError as error:
                    raise DitqError(f"{where}: cannot batch the recorded {name!r} ({error})") from error
            elif isinstance(value, torch.Tensor):  # no batch dimension (Flux's txt_ids, img_ids): shared
                if not all(torch.equal(v, value) for v in values):
                    raise DitqError(
                        f"{where}: the recorded {name!r} has no batch dimension and differs between steps"
                    )
                kwargs[name] = value
            elif isinstance(value, list):
                kwargs[name] = [item for v in values for item in v]
            elif all(v == value for v in values):
                kwargs[name] = value
            else:
                raise DitqError(f"{where}: the recorded {name!r} differs between steps; cannot batch it")
        # The calls after a prefix KV cache's first answer only for the tokens after the prefix: compare those.
        tokens = min(c.output.shape[1] for c in calls)
        reference = torch.cat([c.output[:, -tokens:] for c in calls])
        return cls(kwargs, reference)


class _RecordingExecutor:
    """The in-process baseline's executor, recording the component's first calls for chosen seeds."""

    endpoint = "in-process"

    def __init__(self, inner: AdapterExecutor, bench: Workbench) -> None:
        self.inner, self.bench = inner, bench
        self.offload = inner.offload
        self.parallel = inner.parallel

    def __call__(self, fixture: Fixture, seed: int) -> Reply:
        recording = seed in self.bench.proxy_seeds
        self.bench._recording = [] if recording else None
        try:
            reply = self.inner(fixture, seed)
        finally:
            calls, self.bench._recording = self.bench._recording, None
        if calls is not None:
            self.bench._calls.setdefault(fixture.id, []).extend(calls)
        if reply.png is not None:
            self.bench.reference_png[(fixture.id, seed)] = reply.png
        return reply


@dataclass
class Workbench:
    """The source pipeline, loaded once; its reference images and the component's recorded inputs.

    ``forwards`` counts the component's forwards (a batched replay counts one), what the search cost."""

    pipeline: Any
    component_name: str
    fixtures: dict[str, Fixture]
    steps: int
    true_cfg_scale: float
    image_seeds: list[int]
    proxy_seeds: list[int]
    proxy_steps: int
    reference_png: dict[tuple[str, int], bytes] = field(default_factory=dict)
    forwards: int = 0
    _recording: list[_Call] | None = None
    _calls: dict[str, list[_Call]] = field(default_factory=dict)
    _replays: dict[str, _Replay] = field(default_factory=dict)
    # the unquantized replay against the recorded outputs (how far the replay is from the run), and against
    # itself replayed again (non-determinism; zero where the kernels are deterministic)
    replay_vs_run: dict[str, float] = field(default_factory=dict)
    _replay_floor: dict[str, float] = field(default_factory=dict)
    rounding: Rounding = field(default_factory=Rounding)  # how every unit is rounded (the plan's rounding)

    def __post_init__(self) -> None:
        component = getattr(self.pipeline, self.component_name, None)
        if not isinstance(component, torch.nn.Module):
            raise InputError(f"--component: the pipeline has no model component {self.component_name!r}")
        self.component: torch.nn.Module = component
        self.adapter = PipelineAdapter(self.pipeline)
        if not set(self.proxy_seeds) <= set(self.image_seeds):
            raise InputError("proxy seeds must be among the image seeds")
        component.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self.forwards += 1
        if self._recording is None or len(self._recording) >= self.proxy_steps:
            return
        if args:
            raise DitqError(
                f"{self.component_name} was called with positional arguments; the proxy replays keyword calls"
            )
        detached = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self._recording.append(_Call(detached, _output_tensor(output).detach().float().clone()))

    def executor(self) -> AdapterExecutor:
        """The source pipeline as an in-process executor (its forwards counted in ``forwards``)."""
        return AdapterExecutor(self.adapter, self.steps, self.true_cfg_scale)

    def run_reference(self, run_dir: Path, description: RunDescription) -> None:
        """The source-precision run (a run directory, as ``ditq baseline`` writes in process; ``description``:
        its RUN.json's), recording the component's first calls of the proxy seeds; then the replays, checked
        against what they replay."""
        summary = run_matrix(
            run_dir,
            self.fixtures,
            self.image_seeds,
            [_RecordingExecutor(self.executor(), self)],
            description,
            progress=False,
        )
        missing = [
            k
            for k in ((f, s) for f in self.fixtures for s in self.image_seeds)
            if k not in self.reference_png
        ]
        if missing:
            raise DitqError(
                f"the source-precision run made no image for {missing[0][0]} seed {missing[0][1]} "
                f"({summary}); see {run_dir}/records.jsonl"
            )
        for fixture_id, calls in self._calls.items():
            self._replays[fixture_id] = _Replay.batch(calls, f"{fixture_id}")
        outputs = self._replay_outputs()
        self.replay_vs_run = {f: _relative(outputs[f], r.reference) for f, r in self._replays.items()}
        for fixture_id, replay in self._replays.items():
            replay.reference = outputs[fixture_id]  # the proxy's reference from here on
        self._replay_floor = self._proxy_raw()
        log.info(
            "the unquantized replay against the run: %s; against itself: %s",
            self.replay_vs_run,
            self._replay_floor,
        )

    def _replay_outputs(self) -> dict[str, torch.Tensor]:
        outputs = {}
        with torch.inference_mode():
            for fixture_id, replay in self._replays.items():
                output = _output_tensor(self.component(**replay.kwargs)).float()
                outputs[fixture_id] = output[:, -replay.reference.shape[1] :]
        return outputs

    def _proxy_raw(self) -> dict[str, float]:
        outputs = self._replay_outputs()
        return {f: _relative(outputs[f], replay.reference) for f, replay in self._replays.items()}

    def proxy(self, assignment: Mapping[str, str]) -> dict[str, float]:
        """Per fixture: the output's relative L2 error with ``assignment`` quantized, over the replayed steps,
        against the unquantized replay (its own run-to-run difference, zero with deterministic kernels, taken
        out)."""
        with layers_quantized(self.component, assignment, self.rounding):
            raw = self._proxy_raw()
        return {f: max(e * e - self._replay_floor.get(f, 0.0) ** 2, 0.0) ** 0.5 for f, e in raw.items()}

    def images(self, assignment: Mapping[str, str], seeds: Sequence[int]) -> dict[str, dict[int, float]]:
        """Per fixture and seed: the final image's PSNR (dB) against the source-precision image."""
        executor = self.executor()
        out: dict[str, dict[int, float]] = {}
        with layers_quantized(self.component, assignment, self.rounding):
            for fixture_id, fixture in self.fixtures.items():
                for seed in seeds:
                    reply = executor(fixture, seed)
                    if reply.png is None:
                        raise DitqError(
                            f"{fixture_id} seed {seed}: the quantized pipeline failed ({reply.error})"
                        )
                    out.setdefault(fixture_id, {})[seed] = image_psnr_db(
                        self.reference_png[(fixture_id, seed)], reply.png
                    )
        return out


def _relative(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).norm() / reference.norm().clamp_min(1e-30))


def _mean_by_fixture(per_seed: Mapping[str, Mapping[int, float]]) -> dict[str, float]:
    return {f: statistics.fmean(v.values()) for f, v in per_seed.items()}


def _rounded(values: Mapping[str, float]) -> dict[str, float]:
    return {k: float(f"{v:.4g}") for k, v in values.items()}


@dataclass(frozen=True)
class Unit:
    """What is quantized together in one measurement: a Linear, a block's Linears, or all of them."""

    name: str
    kind: str  # "layer" | "block" | "component"
    layers: tuple[str, ...]
    params: int


@dataclass
class Sensitivity:
    """What ``measure_sensitivity`` found: the plan file's entries (worst fixture per scheme) and, per unit and
    scheme, the numbers per fixture that the search predicts from."""

    entries: list[LayerSensitivity] = field(default_factory=list)
    # (unit, scheme) -> fixture -> proxy error
    proxy: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    # (unit, scheme) -> fixture -> the final image's PSNR (dB), mean over the image seeds, where measured
    psnr_db: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    estimated: set[str] = field(default_factory=set)  # units whose proxy was estimated from their block


def measure_sensitivity(
    bench: Workbench,
    units: Sequence[Unit],
    schemes: Sequence[str],
    image_seeds: Sequence[int],
    with_images: Callable[[Unit], bool],
) -> Sensitivity:
    """Each unit under each scheme, alone (the rest in source precision): the proxy per fixture and, where
    ``with_images(unit)``, the final image's PSNR per fixture (mean over ``image_seeds``)."""
    found = Sensitivity()
    for unit in units:
        for scheme in schemes:
            assignment = dict.fromkeys(unit.layers, scheme)
            found.proxy[(unit.name, scheme)] = bench.proxy(assignment)
            if with_images(unit):
                found.psnr_db[(unit.name, scheme)] = _mean_by_fixture(bench.images(assignment, image_seeds))
        found.entries.append(
            LayerSensitivity(
                layer=unit.name,
                unit=unit.kind,  # type: ignore[arg-type]
                params=unit.params,
                proxy=_rounded({s: max(found.proxy[(unit.name, s)].values()) for s in schemes}),
                psnr_db={
                    s: round(min(found.psnr_db[(unit.name, s)].values()), 2)
                    for s in schemes
                    if (unit.name, s) in found.psnr_db
                },
            )
        )
    return found
