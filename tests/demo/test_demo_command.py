"""`ditq demo`'s own sweep passes the sweep's output rule as `make demo` runs it: its fixtures are written apart from
its output folder (a sweep folder may not hold its inputs), and a second run resumes into the same folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ditq.cli import _build_parser
from ditq.commands.demo import demo_options
from ditq.errors import InputError
from ditq.sweep import check_sweep_output


def _options(argv: list[str]):  # type: ignore[no-untyped-def]
    return demo_options(_build_parser(argv).parse_args(argv))


@pytest.mark.parametrize("out", ["demo-out", "nested/demo-out"])
def test_the_demo_sweep_is_written_apart_from_its_inputs(
    out: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    options = _options(["demo", "--out", out])  # make demo's command, from a fresh clone's root
    check_sweep_output(options)  # the rule run_sweep holds the folder to before anything starts
    assert options.fixtures.is_file()
    assert os.path.commonpath([options.fixtures.resolve(), (tmp_path / out).resolve()]) != str(tmp_path / out)
    (tmp_path / out).mkdir(parents=True)
    (tmp_path / out / "SWEEP.json").write_text("{}")  # an earlier demo's folder: written into again (resume)
    check_sweep_output(_options(["demo", "--out", out]))


def test_a_demo_whose_folder_holds_the_users_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("not ditq's")
    with pytest.raises(InputError, match="not a sweep ditq wrote"):
        check_sweep_output(_options(["demo", "--out", str(tmp_path)]))
