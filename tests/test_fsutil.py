"""The one rule for replacing an output (``ditq.fsutil.check_output``): no command, in any mode, deletes or writes
into a folder ditq did not write, an input, the current directory or the home folder; a refused or failed
command leaves nothing behind. Each case runs the real command line on a tiny model and checks that every file
that was there before is there after, byte for byte."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from harness_kit import mine, write_fixture_set
from PIL import Image
from tiny_models import save_tiny_pipeline

import ditq
from ditq.cli import main
from ditq.errors import InputError


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny demo pipeline saved as a diffusers folder (the source every case quantizes or loads)."""
    root = tmp_path_factory.mktemp("tiny")
    return save_tiny_pipeline(root / "model")


def _pictures(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), "red").save(folder / "cat.png")
    (folder / "prompts.txt").write_text("one [cat]: the cat, but blue\n")
    return folder


# Each case: (tmp folder, tiny model) -> (argv or a callable, the folder that must survive, cwd or None).
Case = Callable[[Path, Path], tuple[list[str] | Callable[[], object], Path, Path | None]]


def _quantize_into_a_folder_of_other_files(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    out = mine(tmp / "existing")
    return ["quantize", str(model), str(out), "--scheme", "w8a8", "--force"], out, None


def _quantize_into_the_current_directory(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    here = mine(tmp / "here")
    return ["quantize", str(model), ".", "--scheme", "w8a8", "--force"], here, here


def _quantize_into_home(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    home = mine(tmp / "home")
    (home / "MANIFEST.json").write_text("{}")  # even with ditq's marker: the home folder is never replaced
    os.environ["HOME"] = str(home)
    return ["quantize", str(model), str(home), "--scheme", "w8a8", "--force"], home, None


def _save_into_a_folder_of_other_files(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    from ditq.demo import load_demo_pipeline

    pipeline = load_demo_pipeline(model)
    ditq.quantize_(pipeline, "w8a8")
    out = mine(tmp / "saved")
    return lambda: ditq.save(pipeline, out, force=True), out, None


def _fixtures_into_their_own_folder(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    pics = _pictures(tmp / "pics")
    return ["fixtures", "init", str(pics), "--out", str(pics), "--size", "32x32", "--force"], pics, None


def _fixtures_into_the_parent_of_the_pictures(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    parent = mine(tmp / "parent")
    _pictures(parent / "pics")
    argv = ["fixtures", "init", str(parent / "pics"), "--out", str(parent), "--size", "32x32", "--force"]
    return argv, parent, None


def _report_into_a_folder_of_other_files(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    out = mine(tmp / "report")
    run = mine(tmp / "run")
    return ["report", str(run), "--baseline", str(run), "--out", str(out), "--allow-unsealed"], out, None


def _probe_into_a_folder_of_other_files(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    fixtures, refs = write_fixture_set(mine(tmp / "fx"))
    out = mine(tmp / "run")
    argv = ["probe", "--endpoint", "http://127.0.0.1:9", "--fixtures", str(fixtures), "--refs", str(refs)]
    return [*argv, "--out", str(out), "--server-wait", "0", "--no-progress"], out, None


def _baseline_into_the_refs(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    fixtures, refs = write_fixture_set(mine(tmp / "fx"))
    argv = ["baseline", str(model), "--fixtures", str(fixtures), "--refs", str(refs), "--out", str(refs)]
    return [*argv, "--device", "cpu", "--no-progress"], tmp / "fx", None


def _sweep_into_a_folder_of_other_files(tmp: Path, model: Path):  # type: ignore[no-untyped-def]
    fixtures, refs = write_fixture_set(mine(tmp / "fx"))
    out = mine(tmp / "sweep")
    argv = ["sweep", str(model), "--schemes", "w8a8", "--fixtures", str(fixtures), "--refs", str(refs)]
    return [*argv, "--out", str(out), "--device", "cpu", "--seeds", "1"], out, None


CASES: dict[str, Case] = {
    "quantize --force into a folder of other files": _quantize_into_a_folder_of_other_files,
    "quantize --force into the current directory": _quantize_into_the_current_directory,
    "quantize --force into the home folder": _quantize_into_home,
    "ditq.save(force=True) into a folder of other files": _save_into_a_folder_of_other_files,
    "fixtures init DIR --out DIR --force": _fixtures_into_their_own_folder,
    "fixtures init PARENT/pics --out PARENT --force": _fixtures_into_the_parent_of_the_pictures,
    "report --out a folder of other files": _report_into_a_folder_of_other_files,
    "probe --out a folder of other files": _probe_into_a_folder_of_other_files,
    "baseline --out its own refs": _baseline_into_the_refs,
    "sweep --out a folder of other files": _sweep_into_a_folder_of_other_files,
}


@pytest.mark.parametrize("name", list(CASES))
def test_no_command_replaces_or_writes_into_a_folder_it_did_not_write(
    name: str, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", os.environ.get("HOME", "/"))  # restored after the home case
    run, kept, cwd = CASES[name](tmp_path, tiny)
    before = _files(kept)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    if callable(run):
        with pytest.raises(InputError) as refused:
            run()
        message = str(refused.value)
    else:
        assert main(run) == 2
        err = capsys.readouterr().err.strip().splitlines()
        lines = [line for line in err if not line.startswith(("WARNING ", "INFO "))]  # log lines aside
        assert len(lines) == 1, err
        message = lines[0]
    assert "Traceback" not in message
    assert any(
        word in message
        for word in ("the output", "ditq wrote", "current directory", "home folder", "no such", "--allow")
    ), message
    assert _files(kept) == before  # nothing deleted, nothing changed, nothing added
    assert not [p for p in tmp_path.rglob(".ditq-tmp-*")]


def test_force_replaces_a_folder_ditq_wrote_of_the_same_kind_only(tiny: Path, tmp_path: Path) -> None:
    from ditq.fsutil import FIXTURES_SET

    artifact = ditq.quantize(tiny, tmp_path / "artifact", "w8a8").path
    ditq.quantize(tiny, artifact, "fp8", force=True)  # an artifact: replaced
    fixtures = tmp_path / "fixtures"
    assert (
        main(
            ["fixtures", "init", str(_pictures(tmp_path / "pics")), "--out", str(fixtures), "--size", "32x32"]
        )
        == 0
    )
    assert (fixtures / FIXTURES_SET.markers[0]).is_file()
    with pytest.raises(InputError, match=r"not an artifact ditq wrote \(no MANIFEST\.json\)"):
        ditq.quantize(tiny, fixtures, "w8a8", force=True)  # a fixtures set is not an artifact
    assert (
        main(
            ["fixtures", "init", str(tmp_path / "pics"), "--out", str(fixtures), "--size", "32x32", "--force"]
        )
        == 0
    )


def test_a_failed_write_leaves_no_folder_behind(tmp_path: Path) -> None:
    from ditq.fsutil import ARTIFACT, atomic_directory

    final = tmp_path / "new" / "deeper" / "artifact"
    with pytest.raises(RuntimeError), atomic_directory(final, ARTIFACT) as tmp:
        (tmp / "half.bin").write_bytes(b"half")
        raise RuntimeError("stopped half-way")
    assert list(tmp_path.iterdir()) == []  # neither the temporary nor the parents made for it


def test_a_refused_fixtures_init_leaves_no_folder_behind(tmp_path: Path) -> None:
    pics = _pictures(tmp_path / "pics")
    (pics / "cat.png").write_bytes(b"not a picture")
    out = tmp_path / "new" / "sub" / "fixtures"
    assert main(["fixtures", "init", str(pics), "--out", str(out), "--size", "32x32"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pics"]
