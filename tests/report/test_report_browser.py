"""report.html in a real headless browser (Debian's chromium): it renders, every image decodes, no errors.

The page's own inline script writes ``data-images`` ("N/M loaded") and ``data-errors`` on <html>;
``--dump-dom`` returns the DOM after the load event, so the check needs no display and no driver.
A screenshot is kept as a test artifact: under $DITQ_TEST_ARTIFACTS when set, else the test's
temporary directory; its path is printed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ditq.report import build_report
from ditq.report.html import CHECK_SCRIPT

from .synthetic import LadderSpec, write_ladder_candidate

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: `apt-get install chromium` (Debian) runs the browser check"
)

_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=10000",
)


def _chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    command = [CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def _page_state(page: Path, profile: Path) -> tuple[str | None, str | None, str]:
    done = _chromium(page, profile, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    images = re.search(r'data-images="([^"]*)"', done.stdout)
    errors = re.search(r'data-errors="([^"]*)"', done.stdout)
    return (images.group(1) if images else None), (errors.group(1) if errors else None), done.stderr


def _console_problems(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


@pytest.fixture(scope="module")
def report(shared_runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    # a candidate served through an offload ladder brings the ladder and servers tables onto the page
    spec = LadderSpec(walls={1: (9.0, 1.0, 2.0), 2: (12.0, 3.0, 4.0)}, served_at={1: "model", 2: "block"})
    ladder = write_ladder_candidate(root, "w8a8-ladder", spec)
    runs = [shared_runs["w8a8"], shared_runs["fp8"], shared_runs["w8a16"], ladder]
    return build_report(runs, shared_runs["baseline"], root / "report", note="Synthetic runs.")


def test_report_renders_with_every_image_loaded_and_no_errors(report, tmp_path):
    page = report.html.read_text()
    count = len(re.findall(r"<img ", page))
    assert "Offload ladder" in page and "Synthetic runs." in page
    images, errors, stderr = _page_state(report.html, tmp_path / "profile")
    assert images == f"{count}/{count} loaded"
    assert errors == "0"
    assert _console_problems(stderr) == []

    artifacts = Path(os.environ.get("DITQ_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "report-screenshot.png"
    done = _chromium(
        report.html, tmp_path / "profile2", f"--screenshot={screenshot}", "--window-size=1280,2400"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with Image.open(screenshot) as shot:
        pixels = np.asarray(shot.convert("L"), dtype=np.float32)
    assert pixels.shape == (2400, 1280)
    assert pixels.std() > 10  # tables, text and images, not a blank page
    print(f"report screenshot: {screenshot}")


def test_the_answer_is_on_the_first_screen_at_1400_by_900(report, tmp_path):
    """A newcomer's window: which candidate to serve, why and how sure, the seconds-per-image chart and the worst
    fixture's grid all end above the fold."""
    done = _chromium(report.html, tmp_path / "profile", "--dump-dom", "--window-size=1400,900")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    facts = dict(re.findall(r'data-(viewport|answer-bottom|answer-images)="([^"]*)"', dom))
    # the layout's width is the window's; its height does not change the layout (headless chromium leaves part of
    # the 900 to its window), so "above the fold" is: ending within the top 900 CSS pixels of the page
    assert facts["viewport"].startswith("1400x")
    bottoms = [int(b) for b in facts["answer-images"].split(",")]
    assert len(bottoms) == 2  # the chart and the worst fixture's grid
    assert 0 < max(bottoms) <= int(facts["answer-bottom"]) <= 900, facts
    answer = dom[dom.index('id="answer"') :]
    recommended = report.data.document.recommendation.candidate
    assert recommended is not None and f"Serve {recommended}" in answer[: answer.index("</section>")]
    assert "How sure:" in answer[: answer.index("</section>")]
    artifacts = Path(os.environ.get("DITQ_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "report-first-screen.png"
    done = _chromium(report.html, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1400,900")
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    print(f"first screen: {shot}")


def test_the_check_catches_a_broken_image_and_a_script_error(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text(
        f"<!DOCTYPE html><html><head><link rel='icon' href='data:,'><script>{CHECK_SCRIPT}</script></head><body>"
        "<img src='data:image/png;base64,bm90IGEgcG5n'><script>undefinedFunction();</script></body></html>"
    )
    images, errors, stderr = _page_state(page, tmp_path / "profile")
    assert images == "0/1 loaded"
    assert errors == "2"  # the undecodable image and the script error
    assert any("undefinedFunction" in line for line in _console_problems(stderr))
