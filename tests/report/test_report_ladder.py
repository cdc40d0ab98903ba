"""Serving through an offload ladder: warm-up left out of the timing, the ladder's history, the servers.

The runs are written as ditq probe and ditq sweep write them (tests/report/synthetic.py): each probe
invocation is one server start, stamped on its records with its offload mode; RUN.json holds what each
server said on /health; CANDIDATE.json holds the ladder's attempts and the weight bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ditq.report import build_report, load_candidate, validate_verdict_file
from ditq.report.capacity import capacity_matrix
from ditq.report.document import compilation_sentence
from ditq.report.model import Record, mark_cold
from ditq.report.tables import (
    _placement,
    capacity_summary_table,
    capacity_table,
    compiled_text,
    ladder_table,
    servers_table,
)
from ditq.runfiles import ServerHealth, write_model

from .synthetic import LadderSpec, write_ladder_candidate, write_ladder_run

# per reference count, the requests' seconds in the order they ran: the first is the server's cold one
CANDIDATE = LadderSpec(
    walls={1: (9.0, 1.0, 2.0, 6.0), 2: (12.0, 3.0, 4.0, 8.0)}, served_at={1: "model", 2: "block"}
)
BASELINE = LadderSpec(
    walls={1: (10.0, 2.0, 3.0, 7.0), 2: (14.0, 4.0, 5.0, 9.0)},
    served_at={1: "model", 2: "block"},
    kernel_paths={},
)
TIGHT = LadderSpec(walls=CANDIDATE.walls, served_at={1: "model", 2: None})  # 2 references never fit
NOTE = "The weights are random: PSNR and SSIM measure numerical deviation, not image quality."


def _never_loaded(root: Path) -> Path:
    candidate = root / "fp8"
    candidate.mkdir()
    attempts = [
        {
            "offload": mode,
            "command": f"ditq serve --offload {mode}",
            "status": "out_of_memory_at_load",
            "seconds": 20.0,
            "message": "the server exited with code 3 before it was healthy",
        }
        for mode in ("none", "model", "block")
    ]
    stages = {"serve": {"status": "failed", "seconds": 60.0, "message": "the model did not load"}}
    description = {"name": "fp8", "scheme": "fp8", "attempts": attempts, "stages": stages}
    (candidate / "CANDIDATE.json").write_text(json.dumps(description))
    return candidate


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sweep")
    attempts = write_ladder_run(root / "baseline", BASELINE, kind="baseline")
    write_model(root / "baseline-attempts.json", attempts)
    return {
        "root": root,
        "baseline": root / "baseline",
        "attempts": root / "baseline-attempts.json",
        "w8a8": write_ladder_candidate(root, "w8a8", CANDIDATE),
        "tight": write_ladder_candidate(root, "tight", TIGHT),
        "fp8": _never_loaded(root),
    }


@pytest.fixture(scope="module")
def report(sweep, tmp_path_factory):
    runs = [sweep["w8a8"], sweep["tight"], sweep["fp8"]]
    out = tmp_path_factory.mktemp("report") / "report"
    return build_report(runs, sweep["baseline"], out, baseline_attempts=sweep["attempts"], note=NOTE)


def _record(
    invocation: int | None, refs: int, size: str, t_start: float, ok: bool = True, endpoint: str = "a"
) -> Record:
    return Record(
        fixture_id="fx",
        seed=0,
        n_references=refs,
        wall_s=1.0,
        http=200 if ok else 503,
        error=None if ok else "HTTP 503: out of memory",
        structure={},
        peak_memory_bytes=None,
        success=ok,
        out_of_memory=not ok,
        size=size,
        invocation=invocation,
        endpoint=endpoint,
        t_start=t_start,
    )


def test_the_first_served_request_of_each_shape_per_server_start_is_cold():
    history = [
        _record(0, 1, "32x32", 3.0),
        _record(0, 1, "32x32", 1.0, ok=False),  # out of memory: not served, so not the warm-up
        _record(0, 1, "32x32", 2.0),  # started before the line above it was written
        _record(0, 1, "64x64", 4.0),  # another size is another shape
        _record(0, 2, "32x32", 5.0),
        _record(1, 1, "32x32", 6.0),  # a new server start warms up again
        _record(1, 1, "32x32", 7.0),
        _record(1, 1, "32x32", 8.0, endpoint="b"),  # a second server in the same invocation warms up too
        _record(None, 1, "32x32", 0.0),  # the seed's records: not known, so warm
    ]
    cold = [r.cold for r in mark_cold(history)]
    assert cold == [False, False, True, True, True, True, False, True, False]


def test_cold_requests_are_shown_apart_from_the_mean_and_median(sweep):
    run = load_candidate(sweep["w8a8"]).run
    assert run is not None
    one, two = capacity_matrix(run)
    # warm 1.0, 2.0, 6.0: mean 3.0, median 2.0; the cold 9.0 is the first request
    assert (one.wall_mean_s, one.wall_median_s, one.wall_min_s, one.wall_max_s) == (3.0, 2.0, 1.0, 6.0)
    assert (one.wall_first_s, one.includes_cold, one.offload) == (9.0, False, ("model",))
    assert (two.wall_mean_s, two.wall_median_s, two.wall_first_s, two.offload) == (5.0, 4.0, 12.0, ("block",))
    row = capacity_table([one]).rows[0]
    assert row[2:9] == ("model", "1 device", "4/4", "3.00", "2.00", "1.00–6.00", "9.00")


def test_a_shape_without_a_warm_request_is_timed_by_its_cold_one_and_says_so(tmp_path):
    spec = LadderSpec(walls={1: (5.0,), 2: (7.0, 1.0, 2.0)}, served_at={1: "model", 2: "model"})
    run = load_candidate(write_ladder_candidate(tmp_path, "single", spec)).run
    assert run is not None
    one, two = capacity_matrix(run)
    assert (one.wall_mean_s, one.wall_median_s, one.wall_first_s, one.includes_cold) == (5.0, 5.0, 5.0, True)
    assert (two.wall_mean_s, two.wall_median_s, two.includes_cold) == (1.5, 1.5, False)
    assert capacity_table([one]).rows[0][8] == "5.00 (also in the statistics: a shape had no warm request)"


def test_peak_memory_is_the_server_process_not_the_whole_device(sweep):
    run = load_candidate(sweep["w8a8"]).run
    assert run is not None and run.memory_description is not None
    assert run.peak_memory_bytes == 20000 * 2**20  # the device's used memory reached 30002 MiB
    assert run.memory_description.measures == "server process (driver count)"


def test_offload_ladder_table_shows_every_rung_from_the_history(report):
    w8a8 = report.data.assessments[0].candidate
    assert ladder_table(w8a8).rows == (
        ("none", "—", "did not load (out of memory)", "", "", ""),
        ("model", "1", "4/4", "0", "2.00", "14.65 GiB"),
        ("model", "2", "0/4", "4", "n/a", "n/a"),
        ("block", "2", "4/4", "0", "4.00", "8.79 GiB"),
    )
    baseline_rows = ladder_table(report.data.baseline).rows  # from --baseline-attempts
    assert baseline_rows[0][:3] == ("none", "—", "did not load (out of memory)")
    assert [r[:3] for r in baseline_rows[1:]] == [
        ("model", "1", "4/4"),
        ("model", "2", "0/4"),
        ("block", "2", "4/4"),
    ]


def test_capacity_summary_says_offload_median_and_peak_or_oom(report):
    table = capacity_summary_table(report.data)
    assert table.headers == ("Row", "1 refs", "2 refs")
    assert table.rows == (
        ("BF16", "model, 3.00 s, 14.65 GiB", "block, 5.00 s, 8.79 GiB"),
        ("w8a8", "model, 2.00 s, 14.65 GiB", "block, 4.00 s, 8.79 GiB"),
        ("tight", "model, 2.00 s, 14.65 GiB", "OOM"),
        ("fp8", "did not load (OOM)", "did not load (OOM)"),
    )


def test_a_ladder_ending_out_of_memory_is_said_and_is_a_reason(report):
    text = report.markdown.read_text()
    assert (
        "The offload ladder (none → model → block) ended with requests still out of memory at 2 references."
        in text
    )
    assert "Every request was served by the end of the offload ladder (none → model → block): " in text
    assert "The model did not load at any offload mode tried (none → model → block)." in text
    tight = report.data.document.candidates[1]
    oom = [r.message for r in tight.reasons if r.code == "out_of_memory"]
    assert oom == ["Out of memory at 2 references (4 of 4 requests) with block offload."]


def test_servers_kernel_paths_load_time_budget_and_weights(report):
    w8a8 = report.data.assessments[0].candidate
    budget = (
        "24.00 GiB on cuda:0 (of 140.00 GiB): 512 MiB outside the allocator (CUDA context, libraries), "
        "allocator capped at 23.50 GiB"
    )
    eager = "no (eager)"
    assert servers_table(w8a8).rows == (
        ("none", "did not load (out of memory)", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"),
        (
            "model",
            "served",
            "50.0 s",
            "41.5 s",
            "6.5 s",
            "44.0 s",
            "triton-w8a8 (196 layers)",
            budget,
            "—",
            eager,
        ),
        (
            "block",
            "served",
            "50.0 s",
            "55.5 s",
            "6.5 s",
            "58.0 s",
            "triton-w8a8 (196 layers)",
            budget,
            "—",
            eager,
        ),
    )
    placed = ServerHealth.model_validate({
        "placement": {"resident": ["transformer", "vae"], "streamed": ["text_encoder"], "vae_tiling": True,
                      "transfer_gbps": 21.5},
        "unused": {"text_encoder.lm_head": 1244659712}, "kv_cache": "int8",
    })  # fmt: skip
    assert _placement(placed) == (
        "resident transformer, vae; streamed text_encoder at 21.5 GB/s; VAE tiling; "
        "unused text_encoder.lm_head (1.16 GiB); int8 KV cache"
    )
    compiled = ServerHealth.model_validate(
        {"compile": {"backend": "inductor", "how": "repeated blocks (60 x Block)", "warmup_seconds": 41.25}}
    )
    assert compiled_text(compiled) == "inductor, repeated blocks (60 x Block), warm-up 41.2 s"
    text = report.markdown.read_text()
    assert "transformer weights 7.26 GiB (0.52× the source's 13.96 GiB)" in text
    assert "peak memory measures the server process (driver count) (nvml)" in text
    assert "| quantize | ok | 120.0 s |" in text


def test_verdict_json_carries_the_new_profile_fields(report):
    document = validate_verdict_file(report.verdict_json)
    assert document.note == NOTE
    profile = document.candidates[0].profile
    assert (profile.load_seconds, profile.kernel_paths) == (41.5, {"triton-w8a8": 196})
    assert profile.weight_bytes == int(7.26 * 2**30)
    assert document.baseline.profile.weight_bytes == int(13.96 * 2**30)  # the source's same components
    one = profile.by_references[0]
    assert (one.seconds_per_image, one.seconds_median, one.seconds_first, one.offload) == (
        3.0,
        2.0,
        9.0,
        "model",
    )
    assert profile.seconds_per_image == {"1": 3.0, "2": 5.0}
    fp8 = document.candidates[2].profile
    assert (fp8.load_seconds, fp8.kernel_paths, fp8.weight_bytes) == (None, {}, None)


def test_note_and_new_sections_render_in_markdown_and_html(report):
    text = report.markdown.read_text()
    assert text.splitlines()[2] == f"**Note:** {NOTE}"
    # the answer first, then the verdicts, then the details (the capacity summary among them)
    assert text.index("## Which candidate to serve") < text.index("## Verdicts") < text.index("## Capacity")
    page = report.html.read_text()
    assert f"<p><b>Note:</b> {NOTE}</p>" in page
    for heading in ("Capacity", "Offload ladder", "Servers", "Stages"):
        assert f">{heading}</h" in page and f" {heading}\n" in text
    assert "did not load (out of memory)" in page and "triton-w8a8 (196 layers)" in page


def test_report_command_takes_the_note_and_the_baseline_attempts(sweep, tmp_path, capsys):
    from ditq.cli import main

    out = tmp_path / "cli-report"
    argv = [
        "report",
        str(sweep["w8a8"]),
        "--baseline",
        str(sweep["baseline"]),
        "--out",
        str(out),
        "--allow-unsealed",
    ]
    assert main([*argv, "--baseline-attempts", str(sweep["attempts"]), "--note", NOTE]) == 0
    capsys.readouterr()
    assert validate_verdict_file(out / "verdict.json").note == NOTE
    baseline_section = (out / "REPORT.md").read_text().split("## BF16 (baseline)")[1].split("## w8a8")[0]
    assert "| none | — | did not load (out of memory) |" in baseline_section


def test_the_report_says_whether_the_baseline_and_candidates_ran_compiled(report):
    eager = ServerHealth.model_validate({})
    inductor = ServerHealth.model_validate({"compile": {"backend": "inductor"}})
    traced = ServerHealth.model_validate({"compile": {"backend": "eager"}})  # torch.compile's eager backend
    alike = compilation_sentence({"BF16": [inductor], "fp8": [inductor, None]})
    mixed = compilation_sentence({"BF16": [eager], "fp8": [inductor]})
    assert "inductor" in alike and "not compiled" not in alike and "like with like" not in alike
    assert (
        "BF16 not compiled; fp8 inductor" in mixed and "like with like" in mixed
    )  # who ran what, the warning
    # a server compiled with the eager backend did compile: not to be read as one that did not
    assert "not compiled" not in compilation_sentence({"BF16": [traced], "fp8": [traced]})
    assert "BF16 not compiled; fp8 eager" in compilation_sentence({"BF16": [eager], "fp8": [traced]})
    assert compilation_sentence({"BF16": [None]}) != alike  # nothing reported is not "alike"
    # the synthetic sweep's servers report no compile facts: none compiled, and the head says so
    assert compilation_sentence({"BF16": [eager], "w8a8": [eager]}) in report.markdown.read_text()
