"""The in-process baseline: a real (tiny, untrained) demo pipeline through ditq.runtime, sealed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import save_tiny_pipeline

from ditq.judge.baseline import BaselineOptions, make_baseline, verify_seal
from ditq.probe.records import is_success, read_records
from ditq.runtime.stage_metrics import StageMetrics

demo = pytest.importorskip("ditq.demo")


def test_in_process_baseline_is_recorded_and_sealed(tmp_path: Path, fixture_set) -> None:
    model = tmp_path / "model"
    save_tiny_pipeline(model)
    fixtures, refs = fixture_set
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        summary = make_baseline(
            BaselineOptions(
                model=model, fixtures=fixtures, refs=refs, out=out, seeds=[3], steps=2, progress=False
            )
        )
        assert (summary.completed, summary.failed) == (3, 0)
        runs.append({r.fixture_id: r for r in read_records(out)})
        assert verify_seal(out) == []
        run = json.loads((out / "RUN.json").read_text())
        assert run["kind"] == "baseline" and run["endpoints"] == ["in-process"] and run["model"] == str(model)
    for fixture_id, record in runs[0].items():
        assert is_success(record) and record.http is None and record.endpoint == "in-process"
        assert record.size == {"gen-one": "32x48", "edit-one": "48x32", "edit-two": "32x32"}[fixture_id]
        # the metrics ditq serve would have answered: its shape, in milliseconds
        metrics = StageMetrics.model_validate(record.metrics)
        assert metrics.generation_ms > 0 and metrics.queue_wait_ms == 0.0
        assert metrics.num_inference_steps == 2 and len(metrics.denoise_step_latencies_ms or []) == 2
        assert runs[1][fixture_id].sha256 == record.sha256  # same model, seed and settings: same image
