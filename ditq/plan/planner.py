"""``ditq plan``: measure, search, verify, write PLAN.json.

1. Run the fixtures in source precision, recording the component's calls for the proxy (and, under ``--target
   parity``, measure the band against the model in bfloat16, as the sweep does).
2. Sensitivity (``ditq.plan.sensitivity``): each block, the whole component and each plannable Linear under every
   scheme, measured by the proxy and, for the component and some blocks, by final images.
3. Search (``ditq.plan.search``) for the cheapest assignment predicted to meet every fixture's target plus margin.
4. Verify: quantize with the plan, run every fixture and seed, judge with ``ditq compare``; a fixture that misses
   corrects its prediction and the search runs again (up to ``max_rounds``), and an undecided one gets more seeds
   as ``ditq sweep --seeds auto`` adds them. PLAN.json records the last verification, met or not.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ditq.checkpoint.stored import stored_bytes
from ditq.errors import DitqError, InputError
from ditq.fsutil import ARTIFACT, RUN, check_output
from ditq.judge.compare import MAX_SEEDS, TOLERANCE_DB, ParityBand, seeds_to_add
from ditq.plan.search import Budget, Calibration, calibrate, predict, search_assignment
from ditq.plan.sensitivity import Rounding, Sensitivity, Unit, Workbench, measure_sensitivity
from ditq.probe.fixtures import DEFAULT_SEEDS, Fixture, load_fixtures, parse_seeds
from ditq.probe.runner import Executor
from ditq.quantization.defaults import CALIBRATION_SEEDS, CALIBRATION_STEPS, CALIBRATIONS
from ditq.quantization.low_rank import check_low_rank
from ditq.quantization.plan_file import (
    KEEP,
    PlanCalibration,
    PlanCost,
    PlanFile,
    PlanRounding,
    PlanTarget,
    PlanVerification,
    ProxyCalibration,
    write_plan,
)
from ditq.quantization.targets import linear_at
from ditq.runtime.options import LoadOptions, ResolvedLoad, resolve_load_options
from ditq.schemes import get_scheme

__all__ = ["DEFAULT_SCHEMES", "PlanOptions", "make_plan", "parse_budget", "read_budget"]

log = logging.getLogger(__name__)

DEFAULT_SCHEMES = ("fp8", "w8a8", "w8a16")  # fastest first


@dataclass(frozen=True)
class PlanOptions:
    model: Path
    out: Path  # PLAN.json
    fixtures: Path | None = None  # None: the bundled demo's (bundled model only)
    refs: Path | None = None
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    target_db: float | None = None  # None: the parity band's floor per fixture
    margin_db: float = 0.5  # the search aims this far above each fixture's target
    tolerance_db: float = TOLERANCE_DB  # compare's: the floor is the pair's PSNR minus this
    budget: str | None = None  # SIZE (the component's weight bytes at most) or P% (planned parameters kept)
    seeds: str = DEFAULT_SEEDS  # image seeds: the reference, the parity pair and the verification
    proxy_seeds: int = 2  # the first N image seeds feed the proxy
    proxy_steps: int = 2  # the first N denoising steps' component output
    unit_seeds: int = 1  # the first N image seeds for the blocks' and the component's images
    steps: int | None = None  # None: the demo's 8 on the bundled model, else the probe's 20
    cfg: float = 1.0
    component: str = "transformer"
    # how the model is opened: device, dtype (None: the device's default, float32 on the CPU, as ditq serve
    # computes), variant; kernels unverified (the registry's first candidate), as the sensitivity measured them
    load: LoadOptions = field(default_factory=LoadOptions)
    work: Path | None = None  # keeps the runs and checkpoints (None: a temporary folder, removed)
    max_rounds: int = 3
    max_layers: int = 256  # Linears measured one by one at most; past it, the most sensitive blocks' first
    image_blocks: int | None = None  # blocks with images, evenly spaced, beside the component; None: all
    # under a parity target, what the verification accepts per fixture: compare's "inside", or also "undecided"
    accept: str = "inside"
    # under a parity target, the most seeds an undecided fixture may get (ditq sweep --seeds auto's rule); the
    # number of --seeds: none added
    max_seeds: int = MAX_SEEDS
    command: tuple[str, ...] = ()
    # how each candidate is rounded when measured, and so in the plan's artifact (``ditq quantize``'s flags):
    # rtn or gptq (every int-weight candidate GPTQ-rounded from Hessians gathered once, on the fixtures' requests at
    # ``calibration_seeds``, ``calibration_steps`` steps each); the rank of the low-rank branch of 4-bit layers
    calibrate: str = "rtn"
    low_rank: int | None = None
    calibration_seeds: tuple[int, ...] = CALIBRATION_SEEDS
    calibration_steps: int = CALIBRATION_STEPS
    # None: CALIBRATION_MEMORY (a plan's calibration holds its Hessians where the inputs come)
    calibration_memory: int | None = None

    def __post_init__(self) -> None:
        if not self.schemes:
            raise InputError("--schemes: name at least one scheme (fp8, w8a8, w8a16)")
        schemes = [get_scheme(name) for name in self.schemes]
        if self.calibrate not in CALIBRATIONS:
            raise InputError(f"--calibrate: one of {', '.join(CALIBRATIONS)}, got {self.calibrate!r}")
        if self.calibrate == "gptq" and all(s.weight_type != "int" for s in schemes):
            raise InputError(
                f"--calibrate gptq rounds int weights (w4a16, w4a8, w8a16, w8a8); the candidates "
                f"{', '.join(self.schemes)} hold none"
            )
        if self.low_rank is not None:
            check_low_rank(self.low_rank, schemes, mixed=True)
        if not self.calibration_seeds:
            raise InputError("--calibration-seeds: give at least one seed")
        if self.calibration_steps < 1:
            raise InputError(f"--calibration-steps must be at least 1, got {self.calibration_steps}")
        if not Path(self.model).is_dir():
            raise InputError(f"{self.model}: model directory not found")
        for value, flag in ((self.proxy_seeds, "--proxy-seeds"), (self.proxy_steps, "--proxy-steps")):
            if value < 1:
                raise InputError(f"{flag}: at least 1, got {value}")
        if self.max_layers < 0:
            raise InputError(f"--max-layers: at least 0, got {self.max_layers}")
        if self.image_blocks is not None and self.image_blocks < 0:
            raise InputError(f"--image-blocks: at least 0, got {self.image_blocks}")
        if self.max_rounds < 1:
            raise InputError(f"--max-rounds: at least 1, got {self.max_rounds}")
        if self.budget is not None:
            read_budget(self.budget)  # refused before anything runs
        if self.accept not in ("inside", "undecided"):
            raise InputError(f"--accept: inside or undecided, got {self.accept!r}")
        start = len(parse_seeds(self.seeds))
        if self.max_seeds < start:
            raise InputError(f"--max-seeds: at least the {start} --seeds, got {self.max_seeds}")


def read_budget(text: str) -> tuple[str, float]:
    """``--budget`` as ("share", percent) for ``P%`` or ("bytes", n) for a SIZE (``12MiB``, ``1.5GB``)."""
    from ditq.devices import parse_memory_size

    text = text.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise InputError(f"--budget: cannot read {text!r} (examples: 10%, 12MiB)") from None
        if not 0 <= share <= 100:
            raise InputError(f"--budget: a share between 0% and 100%, got {text!r}")
        return "share", share
    try:
        return "bytes", parse_memory_size(text)
    except InputError:
        raise InputError(f"--budget: cannot read {text!r} (examples: 10%, 12MiB, 1.5GB)") from None


def parse_budget(
    text: str,
    shapes: Mapping[str, tuple[int, int]],
    schemes: Sequence[str],
    stored_itemsize: int,
    fixed_bytes: int,
    low_rank: int = 0,
) -> Budget:
    """``--budget`` as the search's ``Budget`` over the planned Linears (``shapes``: name -> (out, in)). ``P%``: the
    kept parameters at most P% of theirs. A SIZE: the component's weights at most that many bytes, each Linear
    counted as the artifact stores it (``stored_bytes``: a 4-bit one half a byte a weight plus its scales and any
    low-rank branch, an 8-bit one a byte plus its scales; kept, ``stored_itemsize`` a weight); ``fixed_bytes``
    is what the component's other tensors take."""
    kind, value = read_budget(text)
    params = {name: out * inp for name, (out, inp) in shapes.items()}
    if kind == "share":
        return Budget(
            {name: {KEEP: n} for name, n in params.items()}, int(sum(params.values()) * value / 100)
        )
    cost = {
        name: {
            **{s: stored_bytes(get_scheme(s).fitted(inp), out, inp, low_rank) for s in schemes},
            KEEP: params[name] * stored_itemsize,
        }
        for name, (out, inp) in shapes.items()
    }
    smallest = fixed_bytes + sum(min(c.values()) for c in cost.values())
    if smallest > value:
        raise InputError(
            f"--budget {text}: under the component's size with every planned Linear at its smallest candidate "
            f"({smallest} bytes)"
        )
    first = fixed_bytes + sum(c[schemes[0]] for c in cost.values())
    if first > value:
        raise InputError(
            f"--budget {text}: under the component's size with every planned Linear at {schemes[0]}, where the "
            f"search starts ({first} bytes); list a smaller scheme first"
        )
    return Budget(cost, int(value) - fixed_bytes)


def _bundled_defaults(options: PlanOptions, work: Path) -> tuple[Path, Path, int]:
    """(fixtures, refs, steps), the bundled demo's where not given."""
    from ditq import demo
    from ditq.demo.settings import DEMO, demo_fixtures

    bundled = Path(options.model).resolve() == demo.default_model_dir().resolve()
    if (options.fixtures is None or options.refs is None) and not bundled:
        raise InputError("--fixtures and --refs are needed for a model other than the bundled demo model")
    fixtures = options.fixtures or demo_fixtures(work)
    refs = options.refs or demo.references_dir()
    steps = options.steps or (DEMO.steps if bundled else 20)
    return Path(fixtures), Path(refs), steps


@contextmanager
def _work_folder(work: Path | None) -> Iterator[Path]:
    if work is None:
        with tempfile.TemporaryDirectory(prefix="ditq-plan-") as folder:
            yield Path(folder)
        return
    work.mkdir(parents=True, exist_ok=True)
    stale = [(work / name, RUN) for name in ("reference", "pair-bfloat16")]  # runs resume; made afresh here
    stale += [(p, RUN) for p in work.glob("verify-*")] + [(p, ARTIFACT) for p in work.glob("artifact-*")]
    for path, kind in stale:
        if os.path.lexists(path):
            check_output(path, kind)  # removed whole: only what ditq wrote there
            shutil.rmtree(path, ignore_errors=True)
    yield work


def _units(targets: dict[str, int], block_lists: list[str]) -> tuple[list[Unit], list[Unit]]:
    """(one unit per Linear, one per block plus the whole component)."""
    layers = [Unit(name, "layer", (name,), params) for name, params in targets.items()]
    blocks: dict[str, list[str]] = {}
    for name in targets:
        outer = next((b for b in block_lists if name.startswith(f"{b}.")), None)
        if outer is not None:
            index = name[len(outer) + 1 :].split(".")[0]
            blocks.setdefault(f"{outer}.{index}", []).append(name)
    wholes = [Unit(b, "block", tuple(names), sum(targets[n] for n in names)) for b, names in blocks.items()]
    wholes.append(Unit("(all)", "component", tuple(targets), sum(targets.values())))
    return layers, wholes


def _with_images(whole_units: list[Unit], count: int | None) -> Callable[[Unit], bool]:
    """Which whole units get final images: the component and ``count`` blocks spaced evenly through the
    component (the middle of each of ``count`` equal runs of blocks); every block when ``count`` is None or
    covers them all."""
    blocks = [u.name for u in whole_units if u.kind == "block"]
    if count is None or count >= len(blocks):
        return lambda unit: True
    chosen = {blocks[int((i + 0.5) * len(blocks) / count)] for i in range(count)}
    return lambda unit: unit.kind == "component" or unit.name in chosen


def _layers_to_measure(
    layer_units: list[Unit], whole_units: list[Unit], whole_found: Sensitivity, options: PlanOptions
) -> list[Unit]:
    """Every Linear when there are at most ``max_layers``; else the Linears of the most sensitive blocks (by the
    worst fixture's proxy under the fastest scheme) until ``max_layers`` are chosen."""
    if len(layer_units) <= options.max_layers:
        return layer_units
    first = options.schemes[0]
    blocks = sorted(
        (u for u in whole_units if u.kind == "block"),
        key=lambda u: -max(whole_found.proxy[(u.name, first)].values()),
    )
    chosen: set[str] = set()
    for block in blocks:
        if len(chosen) + len(block.layers) > options.max_layers:
            break
        chosen.update(block.layers)
    in_blocks = {name for u in whole_units if u.kind == "block" for name in u.layers}
    return [u for u in layer_units if u.name in chosen or u.name not in in_blocks]


def _estimate_the_rest(
    layer_found: Sensitivity,
    layer_units: list[Unit],
    whole_units: list[Unit],
    whole_found: Sensitivity,
    schemes: tuple[str, ...],
) -> None:
    """A Linear not measured alone gets its block's error power in proportion to its parameters (recorded in
    ``layer_found.estimated``; the plan file lists measured units only)."""
    block_of = {name: u for u in whole_units if u.kind == "block" for name in u.layers}
    for unit in layer_units:
        if (unit.name, schemes[0]) in layer_found.proxy:
            continue
        block = block_of[unit.name]
        share = unit.params / block.params
        for scheme in schemes:
            per_fixture = whole_found.proxy[(block.name, scheme)]
            layer_found.proxy[(unit.name, scheme)] = {
                f: (e * e * share) ** 0.5 for f, e in per_fixture.items()
            }
        layer_found.estimated.add(unit.name)


def _stored_itemsize(model: Path, component: str, variant: str | None) -> tuple[int, int]:
    """(bytes per weight of the component's Linears as stored, bytes of its tensors in all)."""
    from ditq.runtime.loader import component_entries

    entries = component_entries(Path(model) / component, variant)
    weights = [e for name, e in entries.items() if name.endswith(".weight") and len(e.shape) == 2]
    itemsize = max((e.dtype.itemsize for e in weights), default=2)
    return itemsize, sum(e.nbytes for e in entries.values())


@dataclass(frozen=True)
class _Setting:
    """What every phase shares: the options resolved, the fixtures, the runs' folders and the band."""

    options: PlanOptions
    load: ResolvedLoad  # the options' load, resolved once
    fixtures: dict[str, Fixture]
    fixtures_file: Path
    refs: Path
    seeds: list[int]
    steps: int
    work: Path
    # each fixture's seeds: ``seeds``, and those the verification added to it (see ``_settle``)
    seeds_by_fixture: dict[str, list[int]] = field(default_factory=dict)
    rounding: Rounding = field(default_factory=Rounding)  # the workbench's: how every layer is rounded
    component: torch.nn.Module | None = None  # the source component, in memory (its layers' GPTQ rounding)

    def __post_init__(self) -> None:
        for fixture_id in self.fixtures:
            self.seeds_by_fixture.setdefault(fixture_id, list(self.seeds))

    @property
    def device(self) -> str:
        return self.load.options.device

    @property
    def dtype(self) -> torch.dtype:
        return self.load.dtype

    @property
    def reference(self) -> Path:
        return self.work / "reference"

    @property
    def pair(self) -> Path:
        return self.work / "pair-bfloat16"

    def groups(self, seeds: Mapping[str, list[int]]) -> list[tuple[list[int], dict[str, Fixture]]]:
        """``seeds`` (fixture -> seeds) as runs take them: (seeds, the fixtures run at exactly those)."""
        out: dict[tuple[int, ...], dict[str, Fixture]] = {}
        for fixture_id, fixture_seeds in seeds.items():
            if fixture_seeds:
                out.setdefault(tuple(fixture_seeds), {})[fixture_id] = self.fixtures[fixture_id]
        return [(list(k), v) for k, v in out.items()]

    def describe(
        self, model: Path, fixtures: dict[str, Fixture] | None = None, seeds: list[int] | None = None
    ) -> Any:
        """A run's description: ``model`` on ``fixtures`` x ``seeds`` (default: every fixture, the seeds given)."""
        from ditq.probe.runner import describe_run
        from ditq.runfiles import InProcessOptions

        return describe_run(
            "baseline",
            ["in-process"],
            self.fixtures_file,
            self.refs,
            self.fixtures if fixtures is None else fixtures,
            self.seeds if seeds is None else seeds,
            self.steps,
            self.options.cfg,
            InProcessOptions(**self.load.options.record(*InProcessOptions.model_fields)),
            model,
        )


@dataclass
class _Verified:
    psnr_db: dict[str, float]
    decisions: dict[str, str]  # compare's, under a parity target
    band: ParityBand | None  # the band it was judged against (measured again when seeds were added)
    seeds: dict[str, list[int]]  # each fixture's seeds it was judged on


def _verify(
    setting: _Setting, plan: PlanFile, band: ParityBand | None, round_index: int, source: Executor
) -> _Verified:
    """Quantize with the plan (``ditq quantize --plan``), load the checkpoint through the runtime, run every
    fixture at its seeds, and compare with the source-precision run as ``ditq compare`` does (with the band);
    then settle undecided fixtures with more seeds (``_settle``). ``source`` runs the source precision."""
    from ditq.judge.baseline import AdapterExecutor
    from ditq.pipeline.open import open_pipeline
    from ditq.quantization.quantizer import quantize

    options = setting.options
    artifact = setting.work / f"artifact-{round_index}"
    variant = options.load.variant
    quantize(
        options.model,
        artifact,
        plan=plan,
        device=setting.device,
        variant=variant,
        force=True,
        **_calibrated_layers(setting, plan),
    )
    # the artifact records its variant: opened without one, in the setting's device and dtype
    adapter = open_pipeline(
        artifact, dataclasses.replace(setting.load, options=setting.load.options.replace(variant=None))
    )
    candidate = AdapterExecutor(adapter, setting.steps, options.cfg)
    run = setting.work / f"verify-{round_index}"
    _run_seeds(setting, run, candidate, setting.seeds_by_fixture, artifact)
    return _settle(setting, run, band, candidate, source, artifact)


def _calibrated_layers(setting: _Setting, plan: PlanFile) -> dict[str, Any]:
    """Under GPTQ, the quantizer's ``stored`` layers and ``calibration``: every planned layer as the sensitivity
    measured it (rounded once from the plan's Hessians), written as ``ditq.save`` writes them; else nothing (the
    quantizer rounds to nearest from the source files, as ``ditq quantize --plan`` does)."""
    rounding, component = setting.rounding, setting.component
    if rounding.record.calibration is None:
        return {}
    assert component is not None
    layers = {
        name: rounding.stored(name, linear_at(component, name), choice)
        for name, choice in plan.layers.items()
        if choice != KEEP
    }
    return {"stored": {plan.component: layers}, "calibration": rounding.record.calibration.model_dump()}


def _run_seeds(
    setting: _Setting, run: Path, executor: Executor, seeds: Mapping[str, list[int]], model: Path
) -> None:
    from ditq.probe.runner import run_matrix

    for fixture_seeds, fixtures in setting.groups(seeds):
        description = setting.describe(model, fixtures, fixture_seeds)
        run_matrix(run, fixtures, fixture_seeds, [executor], description, progress=False)


def _settle(
    setting: _Setting,
    run: Path,
    band: ParityBand | None,
    candidate: Executor,
    source: Executor,
    artifact: Path,
) -> _Verified:
    """Compare ``run`` with the source-precision run. Under a parity target (and ``accept="inside"``), while
    a fixture is undecided and none is outside or has its mean below its floor (the round would fail whatever
    more seeds said), give each undecided fixture the seeds ``seeds_to_add`` names (up to ``max_seeds``): the
    source precision, the bfloat16 pair and the candidate run them, and the band is measured again. The seeds
    added stay the fixture's for later rounds."""
    from ditq.judge.compare import compare_run, parity_from_pair, settle_seeds
    from ditq.runfiles import CompareFile

    options = setting.options
    result: CompareFile | None = None
    decisions: dict[str, Any] = {}

    def more_seeds() -> dict[str, list[int]]:
        nonlocal result, decisions
        result = compare_run(run, setting.reference, parity=band, use_lpips=False)
        decisions = {f: e.parity for f, e in result.fixtures.items() if e.parity is not None}
        can_pass = all(
            d.decision != "outside" and (d.difference_db is None or d.difference_db >= d.floor_db)
            for d in decisions.values()
        )
        if band is None or options.accept != "inside" or not can_pass:
            return {}
        return {
            f: seeds_to_add(d, setting.seeds_by_fixture[f], options.max_seeds) for f, d in decisions.items()
        }

    def run_more(more: dict[str, list[int]]) -> None:
        nonlocal band
        _run_seeds(setting, setting.reference, source, more, Path(options.model))
        for fixture_seeds, fixtures in setting.groups(more):
            _pair_run(setting, fixture_seeds, list(fixtures))
        _run_seeds(setting, run, candidate, more, artifact)
        for fixture_id, added in more.items():
            setting.seeds_by_fixture[fixture_id] = [*setting.seeds_by_fixture[fixture_id], *added]
        band = parity_from_pair(setting.reference, setting.pair, options.tolerance_db)

    settle_seeds(more_seeds, run_more)
    assert result is not None  # more_seeds ran at least once
    psnr_db = {f: e.psnr_db.mean for f, e in result.fixtures.items() if e.psnr_db.mean is not None}
    if set(psnr_db) != set(setting.fixtures):
        missing = sorted(set(setting.fixtures) - set(psnr_db))
        raise DitqError(f"verification: no image of {missing} could be compared (see {run}/records.jsonl)")
    seeds = {f: list(s) for f, s in setting.seeds_by_fixture.items()}
    return _Verified(psnr_db, {f: d.decision for f, d in decisions.items()}, band, seeds)


def _meets(verified: _Verified, target: PlanTarget, fixture: str, accept: str) -> bool:
    """The fixture's mean PSNR at or above its target and, under a parity target, compare's decision for it
    ``inside`` (``accept="undecided"``: not ``outside``)."""
    if verified.psnr_db[fixture] < target.per_fixture_db[fixture]:
        return False
    decision = verified.decisions.get(fixture)
    return decision is None or decision == "inside" or (accept == "undecided" and decision == "undecided")


def _reasons(
    assignment: dict[str, str], schemes: tuple[str, ...], sensitivity: Sensitivity, fixtures: list[str]
) -> dict[str, str]:
    """Why each layer is not at the fastest scheme: its error there, and its rank among the layers."""
    first = schemes[0]
    worst = {layer: max(sensitivity.proxy[(layer, first)][f] for f in fixtures) for layer in assignment}
    order = sorted(worst, key=lambda layer: -worst[layer])
    reasons = {}
    for layer, choice in assignment.items():
        if choice == first:
            continue
        cheaper = schemes if choice == KEEP else schemes[: schemes.index(choice)]
        errors = ", ".join(
            f"{s} {max(sensitivity.proxy[(layer, s)][f] for f in fixtures):.3g}" for s in cheaper
        )
        verb = "kept in source precision" if choice == KEEP else f"at {choice}"
        if layer in sensitivity.estimated:
            errors += ", estimated from its block"
        reasons[layer] = (
            f"{verb}: proxy error {errors} (worst fixture; rank {order.index(layer) + 1} of {len(order)} by "
            f"{first} error); the search moved it off the cheaper scheme(s) to reach the target"
        )
    return reasons


def make_plan(options: PlanOptions, say: Callable[[str], None] = lambda line: None) -> PlanFile:
    """Measure, search and verify; write ``options.out`` and return the plan."""
    from ditq.pipeline.open import open_pipeline
    from ditq.quantization.targets import plan_targets

    started = time.monotonic()
    load = resolve_load_options(options.load.replace(skip_doctor=True))
    device = load.options.device
    with _work_folder(options.work) as work:
        fixtures_file, refs, steps = _bundled_defaults(options, work)
        setting = _Setting(
            options,
            load,
            load_fixtures(fixtures_file, refs),
            fixtures_file,
            refs,
            parse_seeds(options.seeds),
            steps,
            work,
        )
        pipeline = open_pipeline(options.model, load).pipeline
        component = getattr(pipeline, options.component, None)
        if not isinstance(component, torch.nn.Module):
            raise InputError(f"--component: {options.model} has no model component {options.component!r}")
        rule = plan_targets(
            component, options.component, {k: tuple(v.shape) for k, v in component.state_dict().items()}
        )
        targets = {name: layer.in_features * layer.out_features for name, layer in rule.targets.items()}
        seeds = setting.seeds
        bench = Workbench(
            pipeline,
            options.component,
            setting.fixtures,
            steps,
            options.cfg,
            seeds,
            seeds[: options.proxy_seeds],
            options.proxy_steps,
        )
        clock = lambda: f"{time.monotonic() - started:.0f} s"  # noqa: E731
        say(
            f"plan: {len(targets)} Linears of {options.component}; {len(setting.fixtures)} fixtures x {len(seeds)} seeds, {steps} steps"
        )
        bench.run_reference(setting.reference, setting.describe(Path(options.model)))
        say(
            f"plan: the source-precision run ({setting.dtype}) done; its recorded calls replayed differ from it by "
            f"{max(bench.replay_vs_run.values(), default=0.0):.3g} (relative L2, worst fixture) ({clock()})"
        )
        bench.rounding = _rounding(setting, bench, targets)
        setting = dataclasses.replace(setting, rounding=bench.rounding, component=component)
        if options.calibrate == "gptq":
            say(
                f"plan: GPTQ rounding of {len(targets)} Linears x their int schemes, from one calibration ({clock()})"
            )
        band, target = _target(setting)
        say(f"plan: target {target.kind}: {_fmt(target.per_fixture_db)} dB ({clock()})")

        layer_units, whole_units = _units(targets, rule.block_lists)
        unit_seeds = seeds[: options.unit_seeds]
        with_images = _with_images(whole_units, options.image_blocks)
        whole_found = measure_sensitivity(bench, whole_units, options.schemes, unit_seeds, with_images)
        imaged = sum(1 for u in whole_units if u.kind == "block" and with_images(u))
        say(
            f"plan: {len(whole_units) - 1} blocks ({imaged} with images) and the component x "
            f"{len(options.schemes)} schemes ({clock()})"
        )
        chosen = _layers_to_measure(layer_units, whole_units, whole_found, options)
        say(f"plan: next, {len(chosen)} Linears x {len(options.schemes)} schemes, proxy only ({clock()})")
        layer_found = measure_sensitivity(bench, chosen, options.schemes, unit_seeds, lambda u: False)
        _estimate_the_rest(layer_found, layer_units, whole_units, whole_found, options.schemes)
        say(
            f"plan: {len(chosen)} Linears x {len(options.schemes)} schemes, proxy"
            + (
                f" ({len(layer_units) - len(chosen)} more estimated from their blocks)"
                if len(chosen) < len(layer_units)
                else ""
            )
            + f" ({clock()})"
        )
        fit = calibrate(
            layer_found.proxy,
            {u.name: u.layers for u in whole_units},
            whole_found.proxy,
            whole_found.psnr_db,
            list(setting.fixtures),
        )
        say(
            f"plan: the proxy against the blocks' images: rank correlation {fit.spearman and round(fit.spearman, 3)}, "
            f"prediction off by {fit.residual_db} dB"
        )
        found = (layer_found, whole_found, fit)
        budget = _budget(options, {name: (t.out_features, t.in_features) for name, t in rule.targets.items()})
        assignment, verified, rounds = _search_and_verify(
            setting, target, band, targets, found, budget, (bench.executor(), say, clock)
        )
        if verified.band is not None:
            target = _parity_target(verified.band, setting)  # over every fixture's seeds, as it was judged
        verification = PlanVerification(
            psnr_db={f: round(v, 3) for f, v in verified.psnr_db.items()},
            min_db=round(min(verified.psnr_db.values()), 3),
            meets_target=all(_meets(verified, target, f, options.accept) for f in setting.fixtures),
            seeds=seeds,
            seeds_added={f: s[len(seeds) :] for f, s in verified.seeds.items() if len(s) > len(seeds)},
            decisions=verified.decisions,
            rounds=len(rounds),
            artifact=True,
        )
        # images beside the workbench's: the pair and each round's candidate, every fixture at its seeds then
        pair_images = sum(len(s) for s in setting.seeds_by_fixture.values()) if band is not None else 0
        images = pair_images + sum(len(s) for v in rounds for s in v.seeds.values())
        cost = PlanCost(
            seconds=round(time.monotonic() - started, 1),
            forwards=bench.forwards + images * steps,
            device=device,
        )
        plan = _plan_file(
            options,
            target,
            assignment,
            targets,
            found,
            verification,
            cost,
            setting.rounding.record,
            bench.replay_vs_run,
        )
        write_plan(options.out, plan)
        return plan


def _rounding(setting: _Setting, bench: Workbench, targets: dict[str, int]) -> Rounding:
    """The plan's rounding. Under GPTQ the fixtures' requests (``ditq quantize --calibrate gptq``'s, at the
    calibration seeds and steps) run through the source pipeline once per Hessian group (once where they all fit
    ``calibration_memory``), and every layer is rounded in each of its int candidates then: no trial gathers
    Hessians again."""
    from ditq.calibration import CalibrationOptions, calibration_for
    from ditq.quantization.calibrated import calibrated_choices

    options = setting.options
    if options.calibrate == "rtn":
        return Rounding(PlanRounding(method="rtn", low_rank=options.low_rank))
    requests = CalibrationOptions(
        fixtures=setting.fixtures_file,
        refs=setting.refs,
        seeds=options.calibration_seeds,
        steps=options.calibration_steps,
        memory_bytes=options.calibration_memory,
    )
    calibration = calibration_for(bench.adapter, requests)
    component = bench.component
    choices = {
        name: [get_scheme(s).fitted(linear_at(component, name).in_features) for s in options.schemes]
        for name in targets
    }
    with torch.no_grad():
        calibrated = calibrated_choices(component, choices, calibration, options.low_rank or 0)
    record = PlanRounding(
        method="gptq", low_rank=options.low_rank, calibration=PlanCalibration(**calibration.manifest())
    )
    return Rounding(record, calibrated)


def _budget(options: PlanOptions, shapes: Mapping[str, tuple[int, int]]) -> Budget | None:
    if options.budget is None:
        return None
    itemsize, component_bytes = _stored_itemsize(Path(options.model), options.component, options.load.variant)
    planned = sum(out * inp for out, inp in shapes.values())
    fixed = component_bytes - planned * itemsize
    return parse_budget(options.budget, shapes, options.schemes, itemsize, fixed, options.low_rank or 0)


def _search_and_verify(
    setting: _Setting,
    target: PlanTarget,
    band: ParityBand | None,
    targets: dict[str, int],
    found: tuple[Sensitivity, Sensitivity, Calibration],
    budget: Budget | None,
    tools: tuple[Executor, Callable[[str], None], Callable[[], str]],
) -> tuple[dict[str, str], _Verified, list[_Verified]]:
    """Search, verify end to end, correct the predictions by what was measured, and again, up to max_rounds.

    Returns the cheapest assignment whose verification met the target (``_cheapest``; the last one tried when
    none did), its verification, and every round's verification."""
    options = setting.options
    source, say, clock = tools
    layer_found, _, fit = found
    aim = {f: db + options.margin_db for f, db in target.per_fixture_db.items()}
    offsets = dict(fit.offset_db)
    tried: list[tuple[dict[str, str], _Verified, bool]] = []  # (mix, its verification, target met)
    round_started = time.monotonic()
    for round_index in range(1, options.max_rounds + 1):
        assignment = search_assignment(targets, options.schemes, layer_found.proxy, offsets, aim, budget)
        if any(assignment == earlier for earlier, _, _ in tried):
            break  # the corrected predictions lead back to a mix already verified
        predicted = predict(assignment, layer_found.proxy, offsets)
        plan = _plan_file(options, target, assignment, targets, found, None, None, setting.rounding.record)
        verified = _verify(setting, plan, band, round_index, source)
        if verified.band is not None and verified.band is not band:  # seeds were added: the floors over them
            moved = _parity_target(verified.band, setting)
            aim = {f: db + moved.per_fixture_db[f] - target.per_fixture_db[f] for f, db in aim.items()}
            band, target = verified.band, moved
        met = {f: _meets(verified, target, f, options.accept) for f in setting.fixtures}
        tried.append((assignment, verified, all(met.values())))
        say(
            f"plan: round {round_index}: {plan.quantized_fraction:.1%} quantized; predicted {_fmt(predicted)}; "
            f"measured {_fmt(verified.psnr_db)}; "
            + (
                "target met"
                if all(met.values())
                else f"not met on {', '.join(f for f, ok in met.items() if not ok)}"
            )
            + f" ({clock()})"
        )
        left = options.max_rounds - round_index
        if left and not all(met.values()):
            each = (time.monotonic() - round_started) / round_index
            say(f"plan: a round takes about {each:.0f} s; at most {left} more: about {each * left:.0f} s")
        # The mix just measured is the calibration point nearest the answer: each fixture's prediction moves by
        # what it missed, up or down; a fixture that missed its target is also aimed a margin higher.
        for fixture, measured in verified.psnr_db.items():
            offsets[fixture] += measured - predicted[fixture]
            if not met[fixture]:
                aim[fixture] += options.margin_db
    passing = [(mix, verified) for mix, verified, met in tried if met]
    if passing:
        best = _cheapest([mix for mix, _ in passing], targets, options.schemes)
        assignment, verified = passing[best]
    else:
        assignment, verified, _ = tried[-1]
    return assignment, verified, [v for _, v, _ in tried]


def _cheapest(mixes: list[dict[str, str]], targets: dict[str, int], schemes: tuple[str, ...]) -> int:
    """The index of the cheapest of ``mixes``: the most parameters quantized, then the most at the first
    (fastest) scheme, then at the next, and so on; the later mix among equals (its predictions were corrected
    by more measurements)."""

    def cost(index: int) -> tuple[int, ...]:
        mix = mixes[index]
        at = [sum(targets[name] for name, choice in mix.items() if choice == scheme) for scheme in schemes]
        return (_quantized(mix, targets), *at, index)

    return max(range(len(mixes)), key=cost)


def _quantized(assignment: dict[str, str], targets: dict[str, int]) -> int:
    return sum(targets[name] for name, scheme in assignment.items() if scheme != KEEP)


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in values.items())


def _target(setting: _Setting) -> tuple[ParityBand | None, PlanTarget]:
    """(the parity band, or None under --target-db; the target per fixture)."""
    options = setting.options
    if options.target_db is not None:
        per_fixture = dict.fromkeys(setting.fixtures, options.target_db)
        return None, PlanTarget(
            kind="db", db=options.target_db, per_fixture_db=per_fixture, margin_db=options.margin_db
        )
    from ditq.judge.compare import parity_from_pair

    _pair_run(setting, setting.seeds, list(setting.fixtures))
    band = parity_from_pair(setting.reference, setting.pair, options.tolerance_db)
    return band, _parity_target(band, setting)


def _parity_target(band: ParityBand, setting: _Setting) -> PlanTarget:
    """Each fixture's floor: the band's edge (its pair's mean PSNR over the fixture's seeds minus the tolerance)."""
    per_fixture = {f: round(band.edge(f), 3) for f in setting.fixtures}
    return PlanTarget(
        kind="parity",
        db=min(per_fixture.values()),
        per_fixture_db=per_fixture,
        margin_db=setting.options.margin_db,
    )


def _pair_run(setting: _Setting, seeds: list[int], fixture_ids: list[str]) -> None:
    """The model in bfloat16 in process (``ditq baseline``'s code) on ``fixture_ids`` at ``seeds``, added to the
    pair's run: the second run of the parity pair."""
    from ditq.judge.baseline import BaselineOptions, make_baseline

    options = setting.options
    make_baseline(
        BaselineOptions(
            model=Path(options.model),
            fixtures=setting.fixtures_file,
            refs=setting.refs,
            out=setting.pair,
            seeds=seeds,
            steps=setting.steps,
            true_cfg_scale=options.cfg,
            load=LoadOptions(device=setting.device, variant=options.load.variant),
            progress=False,
            only=fixture_ids,
        )
    )


def _plan_file(
    options: PlanOptions,
    target: PlanTarget,
    assignment: dict[str, str],
    targets: dict[str, int],
    found: tuple[Sensitivity, Sensitivity, Calibration],
    verification: PlanVerification | None,
    cost: PlanCost | None,
    rounding: PlanRounding,
    replay_vs_run: dict[str, float] | None = None,
) -> PlanFile:
    layer_found, whole_found, fit = found
    planned = sum(targets.values())
    return PlanFile(
        source=str(options.model),
        component=options.component,
        schemes=list(options.schemes),
        target=target,
        layers=dict(assignment),
        sensitivity=[*layer_found.entries, *whole_found.entries],
        quantized_fraction=round(_quantized(assignment, targets) / planned, 4) if planned else 0.0,
        verification=verification,
        calibration=ProxyCalibration(
            offset_db=fit.offset_db,
            residual_db=fit.residual_db,
            spearman=None if fit.spearman is None else round(fit.spearman, 3),
            points=fit.points,
            replay_vs_run={f: float(f"{v:.4g}") for f, v in (replay_vs_run or {}).items()},
        ),
        reasons=_reasons(assignment, options.schemes, layer_found, list(target.per_fixture_db)),
        cost=cost,
        command=list(options.command),
        rounding=rounding,
    )
