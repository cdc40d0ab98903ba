"""The report's tables as data (headers + cells as text), rendered alike by markdown.py and html.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ditq.report.assess import Assessment, ReportData
from ditq.report.capacity import CapacityRow
from ditq.report.ladder import offload_ladder, server_starts
from ditq.report.model import Candidate
from ditq.report.schema import IntervalEntry, StandardName
from ditq.runfiles import MemoryCapFacts, ServerHealth

__all__ = [
    "Table",
    "capacity_summary_table",
    "capacity_table",
    "comparison_table",
    "format_budget",
    "format_bytes",
    "interval_text",
    "ladder_table",
    "objectives_table",
    "provenance_table",
    "servers_table",
    "stages_table",
    "verdict_table",
]


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def _num(value: float | None, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "∞ (identical)"
    return f"{value:.{digits}f}{unit}"


def _served(row: CapacityRow) -> str:
    text = f"{row.served}/{row.requests}"
    if row.out_of_memory:
        text += f" ({row.out_of_memory} OOM)"
    if row.failed:
        text += f" ({row.failed} failed)"
    return text


def _wall(row: CapacityRow) -> tuple[str, str, str]:
    """(mean, median, min–max) s/image; OOM when nothing was served because memory ran out."""
    if row.wall_mean_s is None:
        text = "OOM" if row.out_of_memory else "n/a"
        return text, text, text
    return _num(row.wall_mean_s), _num(row.wall_median_s), f"{row.wall_min_s:.2f}–{row.wall_max_s:.2f}"


def _first(row: CapacityRow) -> str:
    if row.wall_first_s is None:
        return "n/a"
    shared = " (also in the statistics: a shape had no warm request)" if row.includes_cold else ""
    return f"{row.wall_first_s:.2f}{shared}"


def capacity_table(matrix: list[CapacityRow]) -> Table:
    rows = tuple(
        (
            str(row.n_references),
            ", ".join(row.fixtures),
            ", ".join(row.offload) or "n/a",
            ", ".join(row.parallel) or "1 device",
            _served(row),
            *_wall(row),
            _first(row),
            format_bytes(row.peak_memory_bytes),
            "not run" if row.gate_total is None else f"{row.gate_passed}/{row.gate_total}",
            f"{_num(row.psnr_mean_db)} / {_num(row.psnr_min_db)}",
            f"{_num(row.ssim_mean, 3)} / {_num(row.ssim_min, 3)}",
        )
        for row in matrix
    )
    headers = (
        "Refs",
        "Fixtures",
        "Offload",
        "Parallel",
        "Served",
        "s/image mean",
        "s/image median",
        "s/image min–max",
        "First request s",
        "Peak memory",
        "Gate passes",
        "PSNR dB mean / min",
        "SSIM mean / min",
    )
    return Table(headers, rows)


def _summary_cell(row: CapacityRow | None) -> str:
    if row is None:
        return "—"
    if row.served == 0:
        return "OOM" if row.out_of_memory else "failed"
    facts = [
        ", ".join((*row.offload, *row.parallel)),
        f"{_num(row.wall_median_s)} s",
        _gib(row.peak_memory_bytes),
    ]
    text = ", ".join(fact for fact in facts if fact)
    if not row.fully_served:
        missing = f"{row.out_of_memory} OOM" if row.out_of_memory else f"{row.failed} failed"
        text += f" ({row.served}/{row.requests} served, {missing})"
    return text


def _gib(n: int | None) -> str:
    return "peak n/a" if n is None else f"{n / 2**30:.2f} GiB"


def capacity_summary_table(report: ReportData) -> Table:
    """Baseline then candidates x reference count: the offload it was served at, median s/image, peak memory."""
    counts = report.reference_counts
    entries = [(report.baseline, report.baseline_matrix)] + [
        (a.candidate, a.matrix) for a in report.assessments
    ]
    rows = []
    for candidate, matrix in entries:
        by_k = {row.n_references: row for row in matrix}
        if candidate.run is None:
            cell = "did not load (OOM)" if candidate.did_not_fit else "not run"
            rows.append((candidate.name, *(cell for _ in counts)))
        else:
            rows.append((candidate.name, *(_summary_cell(by_k.get(k)) for k in counts)))
    return Table(("Row", *(f"{k} refs" for k in counts)), tuple(rows))


_OBJECTIVE_TITLES = {"fit_to_serve": "Fit to serve", "faster": "Faster", "smaller": "Smaller"}
_STANDARD_TITLES: dict[StandardName, str] = {"lossless": "Visually lossless", "parity": "Parity band"}


def verdict_table(report: ReportData) -> Table:
    rows = []
    for a in report.assessments:
        profile = a.profile
        timed = [p for p in profile.by_references if p.seconds_per_image is not None]
        seconds = ", ".join(
            f"{p.references}: {_num(p.seconds_per_image)} / {_num(p.seconds_median)}" for p in timed
        )
        answers = tuple(getattr(a.objectives, name).answer for name in _OBJECTIVE_TITLES)
        by_standard = tuple(a.objectives.fit_by_standard[s].answer for s in _STANDARD_TITLES)
        reasons = " ".join(r.message for r in a.headline.reasons) or "Every check passed."
        if a.headline.answer == "UNDECIDED" and a.headline.settle_command:
            reasons += f" To settle it: {a.headline.settle_command}"
        recommended = report.document.recommendation.candidate == a.candidate.name
        rows.append(
            (
                a.candidate.name + (" (serve this)" if recommended else ""),
                a.verdict,
                *by_standard,
                *answers[1:],
                str(profile.max_references_served),
                seconds or "n/a",
                format_bytes(profile.peak_memory_bytes),
                reasons,
            )
        )
    headline = _OBJECTIVE_TITLES[report.document.objective]
    if report.document.objective == "fit_to_serve":
        headline += f", {report.document.standard}"
    titles = list(_OBJECTIVE_TITLES.values())
    headers = (
        "Candidate",
        f"Verdict ({headline.lower()})",
        *(f"{titles[0]}: {t.lower()}" for t in _STANDARD_TITLES.values()),
        *titles[1:],
        "Max refs served",
        "s/image by refs (mean / median)",
        "Peak memory",
        "Reasons",
    )
    return Table(headers, tuple(rows))


def interval_text(entry: IntervalEntry) -> str:
    """An interval as the tables show it: '45.20 [44.10, 46.30] dB', '0.78× [0.41, 1.50] the baseline's time'."""
    if entry.estimate is None:
        return "n/a"
    if entry.measure in ("psnr_db", "ssim"):  # a level, not a difference or a ratio
        spec, unit = (".2f", " dB") if entry.measure == "psnr_db" else (".4f", "")
        if entry.low is None or entry.high is None:
            return f"{entry.estimate:{spec}}{unit}"
        return f"{entry.estimate:{spec}} [{entry.low:{spec}}, {entry.high:{spec}}]{unit}"
    if entry.measure == "psnr_minus_reference_db":
        if entry.low is None or entry.high is None:
            return f"{entry.estimate:+.2f} dB"
        return f"{entry.estimate:+.2f} [{entry.low:+.2f}, {entry.high:+.2f}] dB"
    of = _RATIO_OF[entry.measure]  # a ratio: always the candidate's over the baseline's
    if entry.low is None or entry.high is None:
        return f"{entry.estimate:.2f}× {of}"
    return f"{entry.estimate:.2f}× [{entry.low:.2f}, {entry.high:.2f}] {of}"


# what a ratio (candidate / baseline) is a multiple of: one wording for one direction, everywhere
_RATIO_OF = {
    "time_ratio": "the baseline's time",
    "device_time_ratio": "the baseline's device-time",
    "weight_ratio": "the baseline's weights",
    "peak_memory_ratio": "the baseline's peak",
}


def _n_cell(entry: IntervalEntry) -> str:
    """n, and the seeds --seeds auto added to reach it."""
    if entry.n is None:
        return "-"
    return f"{entry.n} ({entry.samples_added} added)" if entry.samples_added else str(entry.n)


def objectives_table(a: Assessment) -> Table:
    """Per objective its answer, and every interval behind it: estimate [low, high], samples, the threshold
    it was held against, the decision, and about how many samples would settle an undecided one."""
    rows = []
    answers = [
        *(
            (f"Fit to serve ({_STANDARD_TITLES[s].lower()})", a.objectives.fit_by_standard[s])
            for s in _STANDARD_TITLES
        ),
        *((title, getattr(a.objectives, name)) for name, title in list(_OBJECTIVE_TITLES.items())[1:]),
    ]
    for title, answer in answers:
        for entry in answer.intervals or [None]:
            if entry is None:
                rows.append((title, answer.answer, "-", "-", "-", "-", "-", "-"))
                continue
            settle = entry.samples_to_settle if entry.decision == "undecided" else None
            rows.append(
                (
                    title,
                    answer.answer,
                    entry.subject,
                    interval_text(entry),
                    _n_cell(entry),
                    entry.threshold,
                    entry.decision,
                    "-" if settle is None else str(settle),
                )
            )
    headers = ("Objective", "Answer", "Compared", "Estimate [95% interval]", "n", "Against", "Decision",
               "n to settle")  # fmt: skip
    return Table(headers, tuple(rows))


def _cell(row: CapacityRow | None, baseline: CapacityRow | None) -> str:
    if row is None:
        return "—"
    if row.wall_mean_s is None:
        return "OOM" if row.out_of_memory else "failed"
    text = f"{row.wall_mean_s:.2f} / {_num(row.wall_median_s)} s"
    if baseline is not None and baseline.wall_mean_s:
        text += f" ({row.wall_mean_s / baseline.wall_mean_s:.2f}× the baseline's time)"
    elif baseline is not None and baseline.out_of_memory:
        text += " (baseline OOM)"
    return text


def comparison_table(report: ReportData) -> Table:
    """One row per candidate (BF16 first): seconds per image by reference count, as a multiple of BF16's time."""
    counts = report.reference_counts
    base = {row.n_references: row for row in report.baseline_matrix}
    entries: list[tuple[Candidate, list[CapacityRow], str]] = [
        (report.baseline, report.baseline_matrix, "baseline")
    ]
    entries += [(a.candidate, a.matrix, a.verdict) for a in report.assessments]
    rows = []
    for candidate, matrix, verdict in entries:
        by_k = {row.n_references: row for row in matrix}
        is_base = candidate is report.baseline
        gate = [(r.gate_passed or 0, r.gate_total) for r in matrix if r.gate_total is not None]
        psnr = [r.psnr_mean_db for r in matrix if r.psnr_mean_db is not None]
        rows.append(
            (
                candidate.name,
                *(_cell(by_k.get(k), None if is_base else base.get(k)) for k in counts),
                format_bytes(candidate.run.peak_memory_bytes if candidate.run else None),
                f"{sum(p for p, _ in gate)}/{sum(t or 0 for _, t in gate)}" if gate else "not run",
                "reference" if is_base else _num(min(psnr) if psnr else None),
                verdict,
            )
        )
    headers = ("Row", *(f"{k} refs" for k in counts), "Peak memory", "Gate", "Lowest PSNR dB", "Verdict")
    return Table(headers, tuple(rows))


def stages_table(candidate: Candidate) -> Table:
    rows = tuple(
        (
            s.name,
            s.status,
            _num(s.seconds, 1, " s"),
            s.message or "",
            s.command or "",
        )
        for s in candidate.stages
    )
    return Table(("Stage", "Status", "Time", "Message", "Command"), rows)


def ladder_table(candidate: Candidate) -> Table:
    """Per offload mode tried x reference count, from every record line: what it served, what ran out of memory."""
    rows = []
    for row in offload_ladder(candidate):
        if row.n_references is None:
            rows.append((row.offload, "—", row.outcome or "", "", "", ""))
            continue
        rows.append(
            (
                row.offload,
                str(row.n_references),
                f"{row.served}/{row.requests}",
                str(row.out_of_memory),
                _num(row.wall_median_s),
                format_bytes(row.peak_memory_bytes),
            )
        )
    headers = ("Offload", "Refs", "Served", "Out of memory", "s/image median", "Peak memory")
    return Table(headers, tuple(rows))


def step_cache_table(candidate: Candidate) -> Table:
    """Per request served with a step cache (``--cache``): the steps its server took from the cache."""
    records = candidate.run.records if candidate.run is not None else []
    rows = tuple(
        (
            r.fixture_id,
            str(r.seed),
            str(r.n_references),
            f"{r.skipped_steps}/{r.steps}" if r.steps is not None else str(r.skipped_steps),
        )
        for r in sorted(records, key=lambda r: (r.fixture_id, r.seed))
        if r.skipped_steps is not None
    )
    return Table(("Fixture", "Seed", "Refs", "Steps from the step cache"), rows)


def format_budget(cap: MemoryCapFacts | None) -> str:
    if cap is None:
        return "whole device"
    return (
        f"{format_bytes(cap.budget_bytes)} on {cap.device} (of {format_bytes(cap.device_total_bytes)}): "
        f"{format_bytes(cap.outside_allocator_bytes)} outside the allocator (CUDA context, libraries), "
        f"allocator capped at {format_bytes(cap.allocator_bytes)}"
    )


def _kernels(paths: dict[str, int]) -> str:
    return ", ".join(f"{path} ({layers} layers)" for path, layers in paths.items()) or "none (unquantized)"


def _accumulation(health: ServerHealth) -> str:
    """With ``--accumulate fast``: how many layers the doctor let accumulate fast (the paths named ``-fast``), so a
    device without fast paths (a CPU) does not read as fast."""
    if health.accumulate != "fast":
        return ""
    fast = sum(layers for path, layers in health.kernel_paths.items() if path.endswith("-fast"))
    total = sum(health.kernel_paths.values())
    return f"; fast accumulation asked: {fast} of {total} layers fast"


def _lora(health: ServerHealth) -> str:
    """With ``--lora``: the adapters the server drew with, beside the kernels (``; LoRA adapter x1.0 (64.0 KiB)``)."""
    if health.lora is None or not health.lora.adapters:
        return ""
    adapters = ", ".join(f"{a.name} x{a.scale:g}" for a in health.lora.adapters)
    return f"; LoRA {adapters} ({format_bytes(health.lora.parameter_bytes)})"


def _placement(health: ServerHealth) -> str:
    """Where the weights were (--offload auto), what was left unused, the KV cache's precision."""
    parts = []
    placement = health.placement
    if placement is not None:
        parts.append(f"resident {', '.join(placement.resident) or 'nothing'}")
        if placement.streamed:
            rate = f" at {placement.transfer_gbps:g} GB/s" if placement.transfer_gbps else ""
            parts.append(f"streamed {', '.join(placement.streamed)}{rate}")
        if placement.vae_tiling:
            parts.append("VAE tiling")
    parts += [f"unused {module} ({format_bytes(size)})" for module, size in health.unused.items()]
    if health.kv_cache:
        parts.append(f"{health.kv_cache} KV cache")
    if health.cache:
        parts.append(f"step cache {health.cache}")
    return "; ".join(parts) or "—"


def compiled_text(health: ServerHealth) -> str:
    """'inductor, repeated blocks (...), warm-up 41.2 s' for a compiled server, 'no (eager)' for one that was not."""
    facts = health.compile
    if facts is None:
        return "no (eager)"
    warmup = f", warm-up {facts.warmup_seconds:.1f} s" if facts.warmup_seconds is not None else ""
    if facts.warmup_graphs is not None:
        cached = f", {facts.cache_hits} from the compile cache" if facts.cache_hits else ""
        warmup += f" ({facts.warmup_graphs} graphs{cached})"
    if facts.graphs_since_warmup:  # requests that paid a compilation
        warmup += f"; {facts.graphs_since_warmup} graphs compiled while serving"
    return f"{facts.backend}, {facts.how}{warmup}"


def servers_table(candidate: Candidate) -> Table:
    """Per server started for the candidate (per ladder attempt): its outcome, load and ready time, kernels, budget."""
    rows = []
    for start in server_starts(candidate):
        health = start.health
        rows.append(
            (
                start.offload or "n/a",
                start.outcome,
                _num(start.ready_s, 1, " s"),
                _num(health.load_seconds if health else None, 1, " s"),
                _num(health.kernel_choice_seconds if health else None, 1, " s"),
                _num(health.ready_seconds if health else None, 1, " s"),
                _kernels(health.kernel_paths)
                + (f"; attention {health.attention}" if health.attention else "")
                + _accumulation(health)
                + _lora(health)
                if health
                else "n/a",
                format_budget(health.max_memory) if health else "n/a",
                _placement(health) if health else "n/a",
                compiled_text(health) if health else "n/a",
            )
        )
    headers = (
        "Offload",
        "Result",
        "Start to ready",
        "Load",
        "of which kernel choice",
        "Load + doctor",
        "Kernel paths",
        "Memory budget",
        "Placement",
        "Compiled",
    )
    return Table(headers, tuple(rows))


def _seeds_added(assessment: Assessment) -> str:
    """'edit-one +2 (6 in all), edit-two +2 (6 in all)': per fixture, the seeds --seeds auto added and the
    seeds it was decided on."""
    run = assessment.candidate.run
    fixtures = run.parity_fixtures if run is not None else {}
    decided_on = {k: v.parity.n for k, v in fixtures.items() if v.parity is not None}
    return ", ".join(
        f"{fixture_id} +{added}" + (f" ({decided_on[fixture_id]} in all)" if fixture_id in decided_on else "")
        for fixture_id, added in sorted(assessment.candidate.seeds_added.items())
    )


def provenance_table(report: ReportData) -> Table:
    p = report.document.provenance
    rows: list[tuple[str, str]] = [
        ("ditq", f"{p.ditq_version} ({p.git_revision or 'not a git checkout'})"),
        ("device (report)", p.device),
        ("python / platform", f"{p.python} / {p.platform}"),
        ("libraries", ", ".join(f"{k} {v}" for k, v in p.libraries.items())),
        ("memory budget", report.document.memory_budget or "whole device"),
        ("report command", p.report_command),
    ]
    for assessment in report.assessments:
        if assessment.candidate.seeds_added:
            rows.append((f"{assessment.candidate.name} seeds added", _seeds_added(assessment)))
    for name, commands in p.run_commands.items():
        rows.extend((f"{name} command", command) for command in commands)
    for candidate in report.all_candidates:
        if candidate.run and candidate.run.device:
            rows.append((f"{candidate.name} device", candidate.run.device))
    return Table(("What", "Value"), tuple(rows))
