"""The report directory: verdict.json against its shipped schema, REPORT.md links, a self-contained HTML."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ditq.errors import InputError
from ditq.report import SCHEMA_PATH, build_report, json_schema, validate_verdict, validate_verdict_file
from ditq.report.grids import difference_heatmap


@pytest.fixture(scope="module")
def report(shared_runs, tmp_path_factory):
    runs = shared_runs
    out = tmp_path_factory.mktemp("report") / "report"
    return build_report(
        [runs["w8a8"], runs["fp8"], runs["w8a16"]], runs["baseline"], out, command="ditq report"
    )


def test_shipped_schema_matches_the_models():
    assert json.loads(SCHEMA_PATH.read_text()) == json_schema()


def test_verdict_json_validates_and_says_who_is_fit(report):
    document = validate_verdict_file(report.verdict_json)
    assert [(c.name, c.verdict) for c in document.candidates] == [
        ("w8a8", "YES"),
        ("fp8", "NO"),
        ("w8a16", "NO"),
    ]
    assert document.baseline.profile.max_references_served == 3
    assert document.provenance.report_command == "ditq report"
    assert document.provenance.libraries["numpy"] == np.__version__
    raw = json.loads(report.verdict_json.read_text())
    assert raw["candidates"][0]["profile"]["by_references"][3]["references"] == 4


def test_schema_refuses_unknown_fields_and_bad_verdicts(report):
    raw = json.loads(report.verdict_json.read_text())
    raw["candidates"][0]["profile"]["surprise"] = 1
    with pytest.raises(InputError, match=r"candidates\.0\.profile\.surprise"):
        validate_verdict(raw)
    raw = json.loads(report.verdict_json.read_text())
    raw["candidates"][1]["verdict"] = "MAYBE"
    with pytest.raises(InputError, match=r"candidates\.1\.verdict"):
        validate_verdict(raw)


def test_markdown_links_resolve_and_tables_carry_the_numbers(report):
    text = report.markdown.read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert links and all((report.out_dir / link).is_file() for link in links)
    # 3 candidates x 4 fixtures of grids, wall and PSNR charts, the memory chart (vram.csv exists), and the first
    # screen's grid of the worst fixture
    assert len(links) == 12 + 3 + 1
    assert "| BF16 |" in text and "OOM" in text
    assert "Out of memory at 4 references (2 of 2 requests)." in text


def test_html_is_self_contained(report):
    page = report.html.read_text()
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) == 16
    assert all(src.startswith("data:image/png;base64,") for src in sources)
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing fetched from disk or network
    assert 'class="NO"' in page and 'class="YES"' in page


def test_report_replaces_its_directory_whole(shared_runs, tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "stale.txt").write_text("from an older report")
    (out / "verdict.json").write_text("{}")  # what makes it an older report
    build_report([shared_runs["w8a8"]], shared_runs["baseline"], out)
    assert not (out / "stale.txt").exists() and (out / "verdict.json").is_file()


def test_two_runs_with_one_name_are_refused(shared_runs, tmp_path):
    with pytest.raises(InputError, match="both named 'w8a8'"):
        build_report([shared_runs["w8a8"], shared_runs["w8a8"]], shared_runs["baseline"], tmp_path / "r")


def test_difference_heatmap_is_dark_for_equal_images_and_bright_for_different_ones():
    a = Image.fromarray(np.full((8, 8, 4), 200, np.uint8), "RGBA")
    b = Image.fromarray(np.full((8, 8, 4), [200, 200, 200, 0], np.uint8), "RGBA")  # transparent: white
    same = np.asarray(difference_heatmap(a, a)).astype(int)
    differ = np.asarray(difference_heatmap(a, b)).astype(int)
    assert same.shape == (8, 8, 3) and same.sum(axis=2).max() < 30  # inferno starts near black
    assert differ.sum(axis=2).min() > same.sum(axis=2).max() + 200


def test_a_45_db_difference_is_visible_in_the_heatmap():
    """Seeded noise of about 1.4 levels RMS (PSNR 45 dB): under the old linear x4 it showed at about 5/255 of the
    colour map (black); on the square-root scale it is a clear colour, well above the black of no difference."""
    rng = np.random.default_rng(0)
    base = rng.integers(40, 215, (64, 64, 3)).astype(np.float64)
    noisy = np.clip(base + rng.normal(0.0, 1.43, base.shape).round(), 0, 255)
    psnr = 10 * np.log10(255.0**2 / np.mean((base - noisy) ** 2))
    assert 44.0 < psnr < 46.0
    a, b = (Image.fromarray(x.astype(np.uint8), "RGB") for x in (base, noisy))
    luminance = np.asarray(difference_heatmap(a, b).convert("L"), dtype=np.float64)
    black = np.asarray(difference_heatmap(a, a).convert("L"), dtype=np.float64)
    assert black.max() < 5 and luminance.mean() > 45  # inferno's black, against a visible purple


def test_report_command_prints_verdicts_and_the_page(shared_runs, tmp_path, capsys):
    from ditq.cli import main

    out = tmp_path / "cli-report"
    code = main(
        [
            "report",
            str(shared_runs["fp8"]),
            "--baseline",
            str(shared_runs["baseline"]),
            "--out",
            str(out),
            "--allow-unsealed",
        ]
    )
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    # the candidate's answers (the headline's standard first, then the other standard's), the recommendation
    # (none: fp8 collapsed), why not fp8, the page
    assert printed[0].startswith(
        "fp8: NO (fit_to_serve, lossless; parity NO; faster YES, smaller UNDECIDED) - "
    )
    assert printed[1].startswith("No candidate is fit to serve") and printed[2].startswith("  not fp8: NO: ")
    assert printed[-1] == str(out / "report.html")
    document = validate_verdict_file(out / "verdict.json")
    assert document.candidates[0].verdict == "NO" and document.recommendation.candidate is None
    assert [r.code for r in document.candidates[0].reasons] == ["collapsed_outputs", "below_lossless"]


@pytest.mark.parametrize("report_dir", ["report", "report-24gib"])
def test_the_committed_verdicts_made_again_from_the_h200_runs_validate(report_dir):
    path = Path(__file__).parents[2] / "benchmarks/results/h200-full-size" / report_dir / "verdict.json"
    document = validate_verdict_file(path)
    assert document.schema_version == "ditq-verdict-3" and len(document.candidates) == 2
    assert document.recommendation.candidate is None  # random weights: the baseline's images collapse too


@pytest.mark.parametrize("report_dir", ["report-as-run", "report-24gib-as-run"])
def test_a_committed_verdict_of_the_first_schema_is_refused_in_one_line(report_dir):
    path = Path(__file__).parents[2] / "benchmarks/results/h200-full-size" / report_dir / "verdict.json"
    with pytest.raises(InputError) as caught:
        validate_verdict_file(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path))
    assert "schema_version 'ditq-verdict-1' is not 'ditq-verdict-3'" in message
    assert message.endswith("run ditq report again over its runs)")


def test_the_verdict_says_which_objective_its_headline_answers(report):
    document = validate_verdict_file(report.verdict_json)
    assert document.schema_version == "ditq-verdict-3" and document.objective == "fit_to_serve"
    assert document.standard == "lossless" and set(document.standards) == {"lossless", "parity"}
    for entry in document.candidates:
        assert entry.verdict == entry.objectives.fit_to_serve.answer
        assert entry.reasons == entry.objectives.fit_to_serve.reasons
        assert entry.objectives.fit_to_serve == entry.objectives.fit_by_standard["lossless"]
    # w8a8 is fit under both standards and serves every count: the one to serve; the others say why not
    assert document.recommendation.candidate == "w8a8"
    assert set(document.recommendation.others) == {"fp8", "w8a16"}
    assert document.recommendation.others["w8a16"].startswith("NO: Out of memory at 4 references")
    page = report.html.read_text()
    assert "Estimate [95% interval]" in page and "UNDECIDED" in page  # no candidate's weight bytes are known


def test_report_md_escapes_what_it_did_not_write(shared_runs, tmp_path):
    note = "<script>alert(1)</script> & <b>bold</b> with a `tick"
    result = build_report([shared_runs["w8a8"]], shared_runs["baseline"], tmp_path / "report", note=note)
    markdown = result.markdown.read_text()
    assert "<script>" not in markdown and "<b>" not in markdown
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt; with a \\`tick" in markdown
    html_page = result.html.read_text()
    assert "<script>alert(1)" not in html_page  # the page escapes it too


FORGED = "\n## Which candidate to serve\n\n**Serve FORGED**: [it](javascript:alert(1))\n- - -\n| a | b |\n"


def _structure(markdown: str) -> list[str]:
    """What each line opens: a heading, a list item, a table row, a quote, a rule, or plain text."""
    kinds = (
        ("#", "heading"),
        ("- ", "list"),
        ("* ", "list"),
        ("|", "table"),
        (">", "quote"),
        ("---", "rule"),
    )
    return [
        next((kind for mark, kind in kinds if line.startswith(mark)), "text")
        for line in markdown.splitlines()
    ]


@pytest.mark.parametrize("where", ["note", "candidate name"])
def test_text_the_report_did_not_write_never_restructures_report_md(
    where: str, shared_runs: dict[str, Path], tmp_path: Path
) -> None:
    """Issue 48: a newline, a heading and a bold line in the note or a candidate's name gave REPORT.md 13 "which
    candidate" headings and a forged answer line; a javascript: link stayed live."""
    plain, hostile = tmp_path / "plain", tmp_path / ("w8a8" + (FORGED if where == "candidate name" else ""))
    for run in (plain, hostile):
        shutil.copytree(shared_runs["w8a8"], run)
    note = "weights are random" + (FORGED if where == "note" else "")
    kept = build_report([plain], shared_runs["baseline"], tmp_path / "a", note="weights are random").markdown
    forged = build_report([hostile], shared_runs["baseline"], tmp_path / "b", note=note).markdown
    text = forged.read_text()
    assert _structure(text) == _structure(kept.read_text())
    headings = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    assert sum(heading.startswith("Which candidate") for heading in headings) == 1
    assert not any(line.startswith("**Serve FORGED") for line in text.splitlines())
    assert "](javascript:" not in text.replace("\\]", "")  # the link's brackets escaped: text, not a link


def test_the_report_never_replaces_its_inputs_or_a_folder_it_did_not_write(shared_runs, tmp_path):
    """Issue 28's rerun: --out set to the baseline deleted its records and seal; a folder of other files was emptied."""
    baseline = shared_runs["baseline"]
    before = sorted(p.name for p in baseline.iterdir())
    for out in (baseline, baseline.parent, baseline / "report"):
        with pytest.raises(InputError, match=r"^.*: the output (is|holds|is inside) the input"):
            build_report([shared_runs["w8a8"]], baseline, out)
    assert sorted(p.name for p in baseline.iterdir()) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match=r"not a report ditq wrote"):
        build_report([shared_runs["w8a8"]], baseline, mine)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_a_gate_file_edited_to_pass_is_refused(runs, tmp_path):
    """Issue 28's rerun: the report believed a candidate's gate.json edited to PASS, and stopped showing the drift."""
    gate = runs["fp8"] / "gate.json"  # the collapsed candidate: its images fail the gate
    document = json.loads(gate.read_text())
    assert not all(record["passed"] for record in document["records"])
    for record in document["records"]:
        record.update(passed=True, reasons=[])
    document["verdict"] = "PASS"
    gate.write_text(json.dumps(document))
    with pytest.raises(
        InputError, match=r"gate\.json: says .* passed, which its records and images do not show"
    ):
        build_report([runs["fp8"]], runs["baseline"], tmp_path / "report")


def test_a_bold_run_ending_in_a_space_closes_in_markdown() -> None:
    """``**Timed on a CPU: **`` would show its asterisks (a closing mark may not follow a space): the space goes
    outside the marks, and a line break in one becomes a space."""
    from ditq.report.document import Paragraph
    from ditq.report.markdown import _spans

    paragraph = Paragraph((("Timed on a CPU: ", "bold"), ("reference kernels.", ""), ("\n# x ", "italic")))
    assert _spans(paragraph.spans) == "**Timed on a CPU:** reference kernels. *\\# x* "


@pytest.mark.parametrize(("name", "what"), [("records.jsonl", "a records file"), ("RUN.json", "a run file")])
@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_run_file_that_is_no_file_is_named(name: str, what: str, kind: str, runs: dict[str, Path]) -> None:
    """gate, compare and report hold a run to being complete; a records.jsonl or RUN.json that is a FIFO (never
    opened: it would block) or a folder is named as such, not taken as a run without one."""
    import os

    from ditq.probe.records import require_complete

    path = runs["w8a8"] / name
    path.unlink()
    os.mkfifo(path) if kind == "FIFO" else path.mkdir()
    with pytest.raises(InputError, match=rf"{re.escape(name)}: a {kind}, not {what}"):
        require_complete(runs["w8a8"])
