"""Memory by request stage: the report's table, chart and the check of the cost model's predicted peaks, from the
stage memory a ditq server on CUDA reports with every response."""

from __future__ import annotations

import json
from pathlib import Path

from ditq.report import build_report, load_candidate
from ditq.report.stages import prediction_check, stage_memory_table, stage_rows

from .synthetic import SEEDS, RunSpec, write_run

GIB = 2**30
WALLS = {1: 2.0, 2: 2.5, 3: 3.0, 4: 3.5}


def _with_stage_memory(run: Path, predicted_over: float) -> None:
    """The run's records as a CUDA server reports them: 10 GiB held, each stage's peak growing with the reference
    count, and a predicted peak ``predicted_over`` above the measured one (a fraction)."""
    records = run / "records.jsonl"
    lines = []
    for line in records.read_text().splitlines():
        record = json.loads(line)
        refs = record["n_references"]
        stages = {"text_encoding": 10.5 + 0.25 * refs, "first_step": 12 + refs, "later_steps": 11 + 0.5 * refs,
                  "decoding": 13.0, "other": 10.0}  # fmt: skip
        peak = max(stages.values())
        record["offload"] = "auto"
        record["metrics"] = {
            "peak_memory_mb": peak * 1024,
            "stage_peak_memory_mb": {k: v * 1024 for k, v in stages.items()},
            "memory_at_start_mb": 10 * 1024,
            "predicted_peak_memory_mb": peak * 1024 * (1 + predicted_over),
            "text_encoding_ms": 300.0,
            "denoise_step_latency_ms": 120.0,
            "decoding_ms": 90.0,
        }
        lines.append(json.dumps(record))
    records.write_text("\n".join(lines) + "\n")


def test_the_report_shows_memory_by_stage_and_how_well_the_peaks_were_predicted(tmp_path: Path) -> None:
    baseline = write_run(tmp_path, RunSpec("bf16", "baseline", WALLS))
    candidate = write_run(
        tmp_path, RunSpec("fp8", "healthy", {k: v * 0.7 for k, v in WALLS.items()}), baseline
    )
    _with_stage_memory(candidate, predicted_over=0.04)

    loaded = load_candidate(candidate)
    rows = stage_rows(loaded)
    assert [(r.offload, r.n_references, r.requests) for r in rows] == [
        ("auto", k, len(SEEDS)) for k in (1, 2, 3, 4)
    ]
    four = rows[-1]
    assert four.start_bytes == 10 * GIB and four.peak_bytes == 16 * GIB
    assert four.stage_peaks["first_step"] == 16 * GIB and four.stage_peaks["decoding"] == 13 * GIB
    assert four.error is not None and abs(four.error - 0.04) < 1e-6
    check = prediction_check(loaded)
    assert check is not None and check.requests == 4 * len(SEEDS) and abs(check.worst_error - 0.04) < 1e-6
    table = stage_memory_table(loaded)
    assert table.headers[4:9] == ("text_encoding", "first_step", "later_steps", "decoding", "other")
    assert table.rows[-1][-1] == "+4.0 %"

    result = build_report([candidate], baseline, tmp_path / "report")
    markdown = result.markdown.read_text()
    assert "### Memory by stage" in markdown
    assert (
        "The predicted peak was within 4.0 % of the measured one for every one of the 8 requests" in markdown
    )
    assert (tmp_path / "report" / "charts" / "memory_by_stage.png").stat().st_size > 0


def test_without_stage_memory_there_is_no_stage_section(tmp_path: Path) -> None:
    baseline = write_run(tmp_path, RunSpec("bf16", "baseline", WALLS))
    candidate = write_run(tmp_path, RunSpec("w8a8", "healthy", WALLS), baseline)
    assert stage_rows(load_candidate(candidate)) == [] and prediction_check(load_candidate(candidate)) is None
    markdown = build_report([candidate], baseline, tmp_path / "report").markdown.read_text()
    assert "Memory by stage" not in markdown.split("## Charts")[0]
