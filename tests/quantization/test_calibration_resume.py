"""A killed ``ditq quantize --calibrate gptq`` resumes: the groups it finished are kept beside the output, taken back
by the same command run again (their requests not run again), and the artifact is the uninterrupted run's, byte for
byte; a group kept from other inputs, or a corrupt one, is ignored with a line naming it and calibrated again."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import ditq.quantization.calibrated as calibrated
from ditq.cli import main
from ditq.demo import default_model_dir
from ditq.errors import InputError
from ditq.quantization.calibrated import Calibration, calibrated_layers
from ditq.quantization.calibration_resume import CalibrationResume
from ditq.quantization.rewrite import StoredLayer
from ditq.schemes import W4A16

# three Hessian groups of the demo transformer's 42 targets (22.5 MiB of Hessians): three passes over the requests
ARGS = ["--scheme", "w4a8", "--calibrate", "gptq", "--calibration-seeds", "0", "--calibration-steps", "1",
        "--calibration-memory", "8MiB", "--device", "cpu"]  # fmt: skip


def _files(folder: Path) -> dict[str, str]:
    """Every regular file of an artifact -> its sha256 (what a byte-for-byte comparison needs)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _counted(monkeypatch: pytest.MonkeyPatch, stop_at: int | None = None) -> list[int]:
    """The calibration passes run from now on (each group's hooks entered), numbered; ``stop_at``: that pass is
    killed (Ctrl-C) while its requests run."""
    passes: list[int] = []
    hooks = calibrated.hessian_hooks

    @contextmanager
    def counting(module: torch.nn.Module, names: Any, device: Any = None) -> Iterator[Any]:
        passes.append(len(passes) + 1)
        with hooks(module, names, device) as found:
            if len(passes) == stop_at:
                raise KeyboardInterrupt
            yield found

    monkeypatch.setattr(calibrated, "hessian_hooks", counting)
    return passes


def test_a_killed_calibration_resumes_to_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    source = str(default_model_dir())
    whole = _counted(monkeypatch)
    assert main(["quantize", source, str(tmp_path / "whole"), *ARGS]) == 0
    assert whole == [1, 2, 3]  # three groups, one pass each
    assert not (tmp_path / ".ditq-resume-whole").exists()  # removed once the artifact is written

    out = tmp_path / "out"
    killed = _counted(monkeypatch, stop_at=2)
    assert main(["quantize", source, str(out), *ARGS]) == 1  # "ditq quantize: interrupted"
    assert killed == [1, 2] and not out.exists()
    kept = tmp_path / ".ditq-resume-out"
    assert sorted(p.name for p in kept.iterdir()) == ["RESUME.json", "transformer.group-0001.safetensors"]

    resumed = _counted(monkeypatch)
    with caplog.at_level(logging.INFO, logger="ditq.quantization.calibrated"):
        assert main(["quantize", source, str(out), *ARGS]) == 0
    assert resumed == [1, 2]  # groups 2 and 3 only: the first is taken back
    assert f"calibration pass 1 of 3: 16 layers taken back from {kept}" in caplog.text
    assert _files(out) == _files(tmp_path / "whole")  # the manifest too: it says nothing of the resume
    assert not kept.exists()


def _layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _calibration(model: torch.nn.Sequential, resume: CalibrationResume, seed: int = 1) -> Calibration:
    def run() -> None:
        with torch.no_grad():
            model(torch.randn(256, 64, generator=torch.Generator().manual_seed(seed)))

    record = {"seed": seed}
    return Calibration(run=run, record=record, memory_bytes=64 * 64 * 4, resume=resume)  # a group per layer


def _resume(tmp_path: Path) -> CalibrationResume:
    source = tmp_path / "model"
    source.mkdir(exist_ok=True)
    (source / "weights.bin").write_bytes(b"w")
    return CalibrationResume.beside(tmp_path / "out", source)


SCHEMES = {"0": W4A16.with_group_size(32), "2": W4A16.with_group_size(32)}


def _rounded(model: torch.nn.Sequential, resume: CalibrationResume, seed: int = 1) -> dict[str, StoredLayer]:
    """Both targets GPTQ-rounded with a rank-4 branch (bfloat16 tensors kept too), their groups kept in ``resume``."""
    return calibrated_layers(model, SCHEMES, _calibration(model, resume, seed), low_rank=4, component="c")


def test_a_group_from_other_inputs_or_corrupt_is_ignored_with_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, resume = _layers(), _resume(tmp_path)
    first = _rounded(model, resume)
    group_1, group_2 = resume.path("c", 1), resume.path("c", 2)
    assert group_1.is_file() and group_2.is_file()
    passes = _counted(monkeypatch)
    again = _rounded(model, resume)
    assert passes == [] and list(again["0"].tensors) == list(first["0"].tensors)
    assert "low_rank_up" in again["0"].tensors
    for prefix, layer in first.items():
        assert again[prefix].rel_l2 == layer.rel_l2
        assert all(torch.equal(again[prefix].tensors[n], t) for n, t in layer.tensors.items())

    with caplog.at_level(logging.WARNING):  # other requests: both groups are stale
        _rounded(model, resume, seed=2)
    assert passes == [1, 2]
    assert f"ignoring {group_1}: made from other inputs (calibration.seed changed)" in caplog.text

    caplog.clear()
    group_2.write_bytes(group_2.read_bytes()[:-10])  # truncated, as a full disk would leave it
    with caplog.at_level(logging.WARNING):
        _rounded(model, resume, seed=2)
    assert passes == [1, 2, 3] and f"ignoring {group_2}: not a whole group file" in caplog.text

    caplog.clear()
    data = bytearray(group_1.read_bytes())
    data[-1] ^= 0xFF  # a changed byte of a tensor: its header still reads
    group_1.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        _rounded(model, resume, seed=2)
    assert passes == [1, 2, 3, 4] and "its tensors do not match their digest" in caplog.text

    group_1.write_bytes(b"\xff" * 12)  # garbage: a line, no traceback
    with caplog.at_level(logging.WARNING):
        _rounded(model, resume, seed=2)
    assert passes == [1, 2, 3, 4, 5] and f"ignoring {group_1}: not a whole group file" in caplog.text

    caplog.clear()
    os.utime(tmp_path / "model" / "weights.bin", ns=(1, 1))  # the model file rewritten (or copied) since
    with caplog.at_level(logging.WARNING):
        _rounded(model, _resume(tmp_path), seed=2)
    assert passes == [1, 2, 3, 4, 5, 6, 7] and "made from other inputs (source changed)" in caplog.text


def test_a_group_taken_back_keeps_its_layers_rows_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, resume = _layers(), _resume(tmp_path)

    def run() -> None:
        rows = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
        rows[:5, 0] = float("nan")  # NaN through the first Linear, then the ReLU: the second's 5 rows too
        with torch.no_grad():
            model(rows)

    calibration = Calibration(run=run, record={"seed": 1}, memory_bytes=64 * 64 * 4, resume=resume)
    first = calibrated_layers(model, SCHEMES, calibration, component="c")
    assert {p: (s.rows_left_out, s.rows) for p, s in first.items()} == {"0": (5, 256), "2": (5, 256)}
    passes = _counted(monkeypatch)
    again = calibrated_layers(model, SCHEMES, calibration, component="c")
    assert passes == [] and {p: (s.rows_left_out, s.rows) for p, s in again.items()} == {
        "0": (5, 256),
        "2": (5, 256),
    }


def test_the_resume_folder_is_only_ever_ditqs_own(tmp_path: Path) -> None:
    theirs = tmp_path / ".ditq-resume-out"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"\.ditq-resume-out: not a calibration resume folder ditq wrote"):
        _resume(tmp_path)
    assert (theirs / "notes.txt").read_text() == "mine"
