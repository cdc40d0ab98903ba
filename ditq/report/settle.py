"""The command that settles an UNDECIDED answer. Fidelity: the same sweep again with ``--seeds auto``, as many
seeds as the undecided fixtures need (a sweep resumes, so only the new seeds run), or for runs made by hand the
probes of the baseline and the candidate at those seeds. Speed: more requests the same way, or, for CPU timings
(reference kernels), the same sweep on a GPU."""

from __future__ import annotations

import shlex

from ditq.judge.compare import MAX_SEEDS
from ditq.probe.fixtures import seeds_text
from ditq.report.model import Candidate, RunData
from ditq.report.schema import IntervalEntry, StandardName
from ditq.runfiles import SWEEP_FILE, HttpOptions, SweepFile, read_model

__all__ = ["settle_command", "speed_settle_command"]

_DROP_WITH_VALUE = ("--seeds", "--max-seeds", "--standard")


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``options`` and their values (``--seeds X`` and ``--seeds=X`` alike)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in options:
            skip = True
            continue
        if any(arg.startswith(f"{option}=") for option in options):
            continue
        out.append(arg)
    return out


def _sweep_file(run: RunData) -> SweepFile | None:
    """The sweep a candidate's run belongs to (``OUT/<candidate>/run``, or the sweep's baseline ``OUT/baseline``)."""
    for folder in (run.path.parent.parent, run.path.parent):
        path = folder / SWEEP_FILE
        if path.is_file():
            try:
                return read_model(SweepFile, path)
            except Exception:  # a damaged SWEEP.json: no command to give, the answer still stands
                return None
    return None


def _probe(run: RunData, seeds: str) -> str | None:
    """The command that runs ``run`` again at ``seeds`` (a probe resumes: only the new seeds run), as RUN.json
    says it was made; None where it does not say enough (a baseline without its model directory)."""
    facts = run.run_file
    if facts is None:
        return None
    if facts.kind == "baseline":
        if facts.model is None:
            return None
        argv = ["ditq", "baseline", facts.model]
        if isinstance(facts.options, HttpOptions):
            argv += ["--endpoint", ",".join(facts.endpoints)]
        else:
            argv += ["--device", facts.options.device, "--offload", facts.options.offload]
    elif isinstance(facts.options, HttpOptions):
        argv = ["ditq", "probe", "--endpoint", ",".join(facts.endpoints)]
    else:
        return None
    argv += ["--fixtures", facts.fixtures_file, "--refs", facts.refs_dir, "--seeds", seeds]
    argv += ["--steps", str(facts.steps), "--cfg", f"{facts.true_cfg_scale:g}", "--out", str(run.path)]
    return shlex.join(argv)


def speed_settle_command(
    candidate: Candidate, baseline: Candidate, intervals: list[IntervalEntry], gpu: bool = False
) -> str | None:
    """The command that settles an UNDECIDED speed answer. Timed on a CPU (``gpu``): the same sweep on a GPU
    (``--device cuda``), since reference kernels' times say nothing of a GPU's. Else more requests: the sweep again
    (it resumes) with as many seeds as the undecided reference count's interval asks for, spread over the fixtures
    at that count; or, for runs made by hand, the probes of both at those seeds. None when the runs do not say
    how they were made, or no number of requests would settle it."""
    if candidate.run is None or baseline.run is None:
        return None
    sweep = _sweep_file(candidate.run)
    if gpu:
        if sweep is None:
            return None
        return shlex.join([*_without(shlex.split(sweep.command), ("--device",)), "--device", "cuda"])
    seeds = 0
    for entry in intervals:
        if entry.decision != "undecided" or entry.samples_to_settle is None:
            continue
        k = int(entry.subject.split()[0])
        fixtures = len({r.fixture_id for r in candidate.run.records_with(k)}) or 1
        seeds = max(seeds, -(-entry.samples_to_settle // fixtures))  # requests at count k -> seeds
    if not seeds:
        return None
    first = (
        min(candidate.run.run_file.seeds) if candidate.run.run_file and candidate.run.run_file.seeds else 0
    )
    text = seeds_text(list(range(first, first + seeds)))
    if sweep is not None:
        return shlex.join(
            [*_without(shlex.split(sweep.command), ("--seeds", "--max-seeds")), "--seeds", text]
        )
    steps = [_probe(baseline.run, text), _probe(candidate.run, text)]
    if any(step is None for step in steps):
        return None
    run, base = shlex.quote(str(candidate.run.path)), shlex.quote(str(baseline.run.path))
    return " ; ".join([*(s for s in steps if s is not None), f"ditq report {run} --baseline {base}"])


def settle_command(
    candidate: Candidate, baseline: Candidate, intervals: list[IntervalEntry], standard: StandardName
) -> str | None:
    """The command that gives every undecided fixture the seeds its interval says would settle it; None when no
    fixture is undecided, when no number of seeds would settle one, or when the runs do not say how they were
    made."""
    undecided = [e for e in intervals if e.decision == "undecided"]
    if not undecided or candidate.run is None or baseline.run is None:
        return None
    wanted = [e.samples_to_settle for e in undecided]
    if any(n is None for n in wanted):
        return None
    most = max(n for n in wanted if n is not None)
    sweep = _sweep_file(candidate.run)
    if sweep is not None:
        argv = _without(shlex.split(sweep.command), _DROP_WITH_VALUE)
        argv += ["--seeds", "auto"]
        if most > MAX_SEEDS:
            argv += ["--max-seeds", str(most)]
        if standard != "lossless":
            argv += ["--standard", standard]
        return shlex.join(argv)
    start = (
        min(candidate.run.run_file.seeds) if candidate.run.run_file and candidate.run.run_file.seeds else 0
    )
    seeds = seeds_text(list(range(start, start + most)))
    steps = [_probe(baseline.run, seeds), _probe(candidate.run, seeds)]
    if any(step is None for step in steps):
        return None
    run, base = shlex.quote(str(candidate.run.path)), shlex.quote(str(baseline.run.path))
    compare = f"ditq compare {run} --baseline {base} --no-lpips"
    if standard == "parity":
        band = candidate.run.parity
        if band is None or band.source != "stated":  # a pair's runs would need the seeds too: not known here
            return None
        compare += f" --parity-db {band.overall_db:g} --tolerance-db {band.tolerance_db:g}"
    report = f"ditq report {run} --baseline {base}" + (" --standard parity" if standard == "parity" else "")
    return " ; ".join(
        [*(s for s in steps if s is not None), f"ditq gate {run} --baseline {base}", compare, report]
    )
