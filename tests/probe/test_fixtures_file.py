"""Fixtures are validated on load; every error names the fixture and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness_kit import FIXTURES, SEED_FIXTURES_COPY

from ditq.errors import InputError
from ditq.probe.fixtures import fixture_digest, load_fixtures, parse_seeds


def _write(tmp_path: Path, fixtures: dict) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(fixtures))
    return path


def test_valid_fixtures_load(fixture_set: tuple[Path, Path]) -> None:
    path, refs = fixture_set
    fixtures = load_fixtures(path, refs)
    assert list(fixtures) == list(FIXTURES)
    assert fixtures["edit-two"].reference_paths == (refs / "ref-a.png", refs / "ref-b.png")
    assert fixtures["gen-one"].size == "32x48" and fixtures["edit-two"].negative_prompt == "blur"


@pytest.mark.parametrize(
    ("fixture_id", "change", "message"),
    [
        (
            "edit-one",
            {"references": ["ref-missing"]},
            r"'edit-one'.*'references'.*ref-missing\.png.*not found",
        ),
        ("edit-one", {"width": 40}, r"'edit-one'.*'width' is 40, not a multiple of 16"),
        ("gen-one", {"height": 0}, r"'gen-one'.*'height' must be a positive integer"),
        ("gen-one", {"mode": "inpaint"}, r"'gen-one'.*'mode' is 'inpaint'"),
        ("gen-one", {"references": ["ref-a"]}, r"'gen-one'.*'references' must be empty"),
        ("edit-one", {"references": []}, r"'edit-one'.*'references' is empty"),
        ("edit-one", {"colour": "red"}, r"'edit-one'.*unknown field 'colour'"),
        ("edit-one", {"prompt": " "}, r"'edit-one'.*'prompt' must be a non-empty string"),
    ],
)
def test_bad_fixture_names_fixture_and_field(
    tmp_path: Path, fixture_set: tuple[Path, Path], fixture_id: str, change: dict, message: str
) -> None:
    _, refs = fixture_set
    fixtures = json.loads(json.dumps(FIXTURES))
    fixtures[fixture_id].update(change)
    with pytest.raises(InputError, match=message):
        load_fixtures(_write(tmp_path, fixtures), refs)


def test_missing_field_is_named(tmp_path: Path, fixture_set: tuple[Path, Path]) -> None:
    fixtures = json.loads(json.dumps(FIXTURES))
    del fixtures["edit-two"]["height"]
    with pytest.raises(InputError, match=r"'edit-two': missing field 'height'"):
        load_fixtures(_write(tmp_path, fixtures), fixture_set[1])


def test_seed_fixtures_file_shape_is_accepted(tmp_path: Path) -> None:
    seed_fixtures = SEED_FIXTURES_COPY
    refs = tmp_path / "refs"
    refs.mkdir()
    for fixture in json.loads(seed_fixtures.read_text()).values():
        for ref in fixture["references"]:
            (refs / f"{ref}.png").write_bytes(b"png")
    fixtures = load_fixtures(seed_fixtures, refs)
    assert [len(f.references) for f in fixtures.values()] == [1, 2, 4, 3]


def test_digest_follows_reference_bytes(fixture_set: tuple[Path, Path]) -> None:
    path, refs = fixture_set
    before = fixture_digest(load_fixtures(path, refs))
    assert fixture_digest(load_fixtures(path, refs)) == before
    (refs / "ref-b.png").write_bytes((refs / "ref-a.png").read_bytes())
    assert fixture_digest(load_fixtures(path, refs)) != before


def test_parse_seeds() -> None:
    assert parse_seeds("2301-2304") == [2301, 2302, 2303, 2304]
    assert parse_seeds("5,1-2,5") == [1, 2, 5]
    assert parse_seeds("0") == [0]
    for bad in ("x", "4-2", "1,,2", "-3"):
        with pytest.raises(InputError, match="--seeds"):
            parse_seeds(bad)


def test_the_bundled_demo_fixtures_load() -> None:
    from ditq import demo

    fixtures = load_fixtures(demo.fixtures_path(), demo.references_dir())
    assert fixtures and all(f.width % 16 == 0 and f.height % 16 == 0 for f in fixtures.values())


def _pictures(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    Image.new("RGB", (40, 24), (200, 30, 30)).save(folder / "red.png")
    Image.new("RGBA", (24, 24), (20, 160, 40, 128)).save(folder / "green.webp")
    (folder / "notes.txt").write_text("not a picture")
    return folder


def test_fixtures_init_writes_a_set_the_probe_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ditq.cli import main

    folder = _pictures(tmp_path / "pictures")
    (folder / "prompts.txt").write_text(
        "# one per line\ncity: a city at night\n\nrecolor [red]: make it blue\npair [red green]: both together\n"
    )
    assert main(["fixtures", "init", str(folder), "--size", "64x48"]) == 0
    out = folder / "fixtures"
    assert f"--fixtures {out / 'fixtures.json'} --refs {out / 'refs'}" in capsys.readouterr().out
    fixtures = load_fixtures(out / "fixtures.json", out / "refs")
    assert {k: (f.mode, f.references, f.size) for k, f in fixtures.items()} == {
        "city": ("generate", (), "64x48"),
        "recolor": ("edit", ("red",), "64x48"),
        "pair": ("edit", ("red", "green"), "64x48"),
    }
    assert sorted(p.name for p in (out / "refs").iterdir()) == ["green.png", "red.png"]  # webp became PNG


@pytest.mark.parametrize(
    ("prompts", "size", "message"),
    [
        ("a: x\na: y\n", "64x64", "line 2: fixture id 'a' given twice"),
        ("edit [blue]: x\n", "64x64", "line 1: no picture 'blue' in the folder (have: green, red)"),
        ("just words\n", "64x64", "line 1: expected 'ID: PROMPT' or 'ID [REF ...]: PROMPT'"),
        ("# nothing\n", "64x64", "no request in the prompts file"),
        ("a: x\n", "60x64", "--size width: 60 is not a positive multiple of 16"),
    ],
)
def test_fixtures_init_refuses_in_one_line_and_writes_nothing(
    prompts: str, size: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ditq.cli import main

    folder = _pictures(tmp_path / "pictures")
    (folder / "prompts.txt").write_text(prompts)
    assert main(["fixtures", "init", str(folder), "--size", size]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and message in error[0]
    assert sorted(p.name for p in folder.iterdir()) == ["green.webp", "notes.txt", "prompts.txt", "red.png"]


def test_the_sweep_refuses_a_bad_fixtures_file_before_any_server_starts(tmp_path: Path) -> None:
    from ditq.demo import default_model_dir
    from ditq.sweep import SweepOptions

    empty = tmp_path / "fixtures.json"
    empty.write_text("{}")
    (tmp_path / "refs").mkdir()
    with pytest.raises(InputError, match="expected a non-empty object mapping fixture id to fixture"):
        SweepOptions(
            model=default_model_dir(),
            schemes=("w8a8",),
            fixtures=empty,
            refs=tmp_path / "refs",
            out=tmp_path / "out",
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "bad",
    ["../../x", "/abs/path/NAME", "a/b", "a\\b", "..", ".hidden", "nul\x00byte", "tab\there", "x" * 129],
)
def test_fixture_and_reference_ids_are_plain_names(
    tmp_path: Path, fixture_set: tuple[Path, Path], bad: str
) -> None:
    _, refs = fixture_set
    as_fixture = json.loads(json.dumps(FIXTURES))
    as_fixture[bad] = as_fixture.pop("gen-one")
    with pytest.raises(InputError, match=r"bad\.json: fixture id: .* is not a plain name"):
        load_fixtures(_write(tmp_path, as_fixture), refs)
    as_reference = json.loads(json.dumps(FIXTURES))
    as_reference["edit-one"]["references"] = [bad]
    with pytest.raises(InputError, match=r"'edit-one': field 'references': .* is not a plain name"):
        load_fixtures(_write(tmp_path, as_reference), refs)


def test_a_plain_name_may_hold_dots_dashes_spaces_and_letters_of_any_script(
    tmp_path: Path, fixture_set: tuple[Path, Path]
) -> None:
    _, refs = fixture_set
    fixtures = json.loads(json.dumps(FIXTURES))
    fixtures["gen one.v2-été"] = fixtures.pop("gen-one")
    assert "gen one.v2-été" in load_fixtures(_write(tmp_path, fixtures), refs)
