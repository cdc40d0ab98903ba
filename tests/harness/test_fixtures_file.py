"""Fixtures are validated on load; every error names the fixture and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, SEED_FIXTURES_COPY

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
