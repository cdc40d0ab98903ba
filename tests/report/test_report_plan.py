"""The report's plan section from a hand-written PLAN.json: sentences, the sensitivity chart, the table of moves."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from ditq.plan import LayerSensitivity, PlanFile, PlanTarget, PlanVerification, ProxyCalibration
from ditq.report.plan import plan_chart, plan_sentences, plan_table

LAYERS = {"blocks.0.to_q": "fp8", "blocks.0.to_k": "w8a8", "blocks.1.to_q": "keep"}
PROXY = {"blocks.0.to_q": 0.001, "blocks.0.to_k": 0.004, "blocks.1.to_q": 0.02}


def _plan() -> PlanFile:
    return PlanFile(
        source="models/tiny",
        schemes=["fp8", "w8a8"],
        target=PlanTarget(kind="parity", db=49.0, per_fixture_db={"a": 49.0, "b": 52.5}, margin_db=0.5),
        layers=LAYERS,
        sensitivity=[
            *(LayerSensitivity(layer=n, params=100, proxy={"fp8": e, "w8a8": e / 3}) for n, e in PROXY.items()),
            LayerSensitivity(layer="blocks.0", unit="block", params=200, proxy={"fp8": 0.005}, psnr_db={"fp8": 47.0}),
        ],
        quantized_fraction=0.6667,
        verification=PlanVerification(
            psnr_db={"a": 50.1, "b": 53.0}, min_db=50.1, meets_target=True, seeds=[1, 2],
            decisions={"a": "inside", "b": "undecided"}, rounds=2, artifact=True,
        ),
        calibration=ProxyCalibration(offset_db={"a": 4.0, "b": 5.0}, residual_db=1.2, spearman=0.9, points=8),
        reasons={"blocks.0.to_k": "at w8a8: why", "blocks.1.to_q": "kept: why"},
    )  # fmt: skip


def test_the_sentences_say_the_mix_the_target_and_the_check():
    text = " ".join(plan_sentences(_plan()))
    assert "1 fp8, 1 w8a8, 1 keep; 66.7% of their parameters quantized" in text
    assert "a 49.00, b 52.50 dB" in text and "0.5 dB above it" in text
    assert "a 50.10 (inside), b 53.00 (undecided) dB; target met" in text
    assert "rank correlation 0.9" in text and "2 search-and-verify rounds" in text


def test_the_table_lists_the_moved_layers_most_sensitive_first():
    table = plan_table(_plan())
    assert table.headers == ("Layer", "Planned", "fp8 proxy", "w8a8 proxy", "Why")
    assert table.rows == (
        ("blocks.1.to_q", "keep", "0.02", "0.00667", "kept: why"),
        ("blocks.0.to_k", "w8a8", "0.004", "0.00133", "at w8a8: why"),
    )


def test_the_chart_has_a_row_per_layer(tmp_path: Path):
    path = plan_chart(_plan(), tmp_path / "plan.png")
    assert path is not None
    with Image.open(path) as image:
        assert image.format == "PNG" and image.height > image.width / 4


def test_a_chart_of_hundreds_of_layers_shows_the_most_sensitive(tmp_path: Path):
    names = [f"blocks.{i}.proj" for i in range(300)]
    plan = _plan().model_copy(
        update={
            "layers": dict.fromkeys(names, "fp8"),
            "sensitivity": [
                LayerSensitivity(layer=n, params=1, proxy={"fp8": 1e-3 + i * 1e-6})
                for i, n in enumerate(names)
            ],
        }
    )
    path = plan_chart(plan, tmp_path / "many.png")
    assert path is not None
    with Image.open(path) as image:  # 120 rows at 0.2 inch, not 300
        assert image.height < 0.2 * 200 * 110
