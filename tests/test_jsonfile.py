"""The one JSON reader: bounds on size, depth and integer length, every key once, and a failure as one line that
names the file, whichever file of ditq's it is (a component config, model_index.json, MANIFEST.json, PLAN.json,
RUN.json, records.jsonl)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import ditq
from ditq.cli import main
from ditq.errors import InputError
from ditq.jsonfile import MAX_JSON_DEPTH, JsonRefused, loads, read_bounded, read_json

HOSTILE = {
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "just too deep": b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
    "5000-digit integer": b'{"a": ' + b"9" * 5000 + b"}",
    "duplicate key": b'{"a": 1, "a": 2}',
    "not UTF-8": b'{"a": "\xff"}',
    "not JSON": b"{not json",
}
REASONS = {
    "deep": f"nested more than {MAX_JSON_DEPTH} deep",
    "just too deep": f"nested more than {MAX_JSON_DEPTH} deep",
    "5000-digit integer": "an integer of 5000 digits",
    "duplicate key": "key 'a' given twice",
    "not UTF-8": "not valid JSON (not UTF-8 text)",
    "not JSON": "not valid JSON (Expecting property name",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_loads_refuses_in_one_line(kind: str) -> None:
    with pytest.raises(JsonRefused) as info:
        loads(HOSTILE[kind])
    assert str(info.value).startswith(REASONS[kind]) and "\n" not in str(info.value)


def test_loads_reads_what_is_inside_the_bounds() -> None:
    nested = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert loads(nested) is not None
    assert loads(b'{"size": 18446744073709551615, "x": [1.5, null, "s"]}')["size"] == 2**64 - 1


def test_read_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(HOSTILE["deep"])
    with pytest.raises(InputError, match=rf"^{path}: nested more than"):
        read_json(path)
    with pytest.raises(InputError, match=rf"^{tmp_path / 'missing.json'}: no such file$"):
        read_json(tmp_path / "missing.json")
    with pytest.raises(InputError, match=rf"^{tmp_path}: not a regular file \(a directory\)$"):
        read_json(tmp_path)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(
        InputError, match=rf"^{fifo}: not a regular file \(a FIFO\)$"
    ):  # no writer: never hangs
        read_json(fifo)
    path.write_bytes(b"[" + b"0," * 20 + b"0]")
    with pytest.raises(InputError, match=rf"^{path}: larger than 16 bytes"):
        read_bounded(path, max_bytes=16)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny source, its w8a8 artifact and a plan: files of the kinds ditq reads."""
    from tiny_models import make_model_dir, plan_file

    from ditq.plan import write_plan

    root = tmp_path_factory.mktemp("chain")
    source = make_model_dir(root, "flux")
    ditq.quantize(source, root / "artifact", "w8a8", link=True)  # absolute links: copied elsewhere below
    write_plan(root / "PLAN.json", plan_file(source))
    return {"source": source, "artifact": root / "artifact", "plan": root / "PLAN.json"}


# file kind -> (the file, the command that reads it)
READERS: dict[str, tuple[str, Callable[[dict[str, Path], Path], list[str]]]] = {
    "config.json": (
        "artifact/transformer/config.json",
        lambda c, w: ["doctor", "--artifact", str(w / "artifact"), "--device", "cpu"],
    ),
    "model_index.json": (
        "artifact/model_index.json",
        lambda c, w: ["doctor", "--artifact", str(w / "artifact"), "--device", "cpu"],
    ),
    "MANIFEST.json": (
        "artifact/MANIFEST.json",
        lambda c, w: ["generate", str(w / "artifact"), "--prompt", "p", "--device", "cpu", "--skip-doctor"],
    ),
    "PLAN.json": (
        "PLAN.json",
        lambda c, w: ["quantize", str(c["source"]), str(w / "out"), "--plan", str(w / "PLAN.json")],
    ),
    "RUN.json": ("run/RUN.json", lambda c, w: ["gate", str(w / "run")]),
    "records.jsonl": ("run/records.jsonl", lambda c, w: ["gate", str(w / "run")]),
}
PAYLOADS = ["deep", "5000-digit integer", "duplicate key"]


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("kind", sorted(READERS))
def test_every_file_ditq_reads_refuses_hostile_json_in_one_line(
    kind: str, payload: str, chain: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28, item 13: these were tracebacks everywhere but in the server's request bodies."""
    work = tmp_path / "work"
    shutil.copytree(chain["artifact"], work / "artifact", symlinks=True)
    shutil.copy(chain["plan"], work / "PLAN.json")
    (work / "run").mkdir()
    (work / "run" / "records.jsonl").write_text("")  # a run without RUN.json: the seed's evidence
    relative, argv = READERS[kind]
    target = work / relative
    target.write_bytes(HOSTILE[payload] + (b"\n" if kind == "records.jsonl" else b""))
    capsys.readouterr()
    assert main(argv(chain, work)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(target) in err[0] and REASONS[payload] in err[0], err
