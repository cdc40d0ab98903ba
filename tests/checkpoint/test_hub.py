"""Hub ids (``org/name[@revision]``) through a local hub cache laid out as huggingface_hub lays it, offline: no test
here reaches the network."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file

import ditq
from ditq.checkpoint.hub import hub_patterns, parse_hub_id, resolve_model
from ditq.checkpoint.manifest import read_manifest
from ditq.cli import main
from ditq.demo import default_model_dir
from ditq.errors import InputError

REPO = "acme/demo"  # not ditq/demo: a folder of this checkout, and a local path wins
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF_HOME whose hub cache holds the demo model as ``acme/demo`` at COMMIT, ``refs/main`` naming it."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--acme--demo"
    shutil.copytree(default_model_dir(), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


@pytest.fixture
def offline(hub_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The environment a user sets: HF_HOME at the cache, HF_HUB_OFFLINE=1 (read at the call, not at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(hub_home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return hub_home / "hub" / "models--acme--demo" / "snapshots" / COMMIT


@pytest.mark.parametrize(("spec", "revision"), [(REPO, "main"), (f"{REPO}@{COMMIT}", COMMIT)])
def test_quantize_from_a_hub_id_records_the_id_revision_and_commit(
    spec: str, revision: str, offline: Path, tmp_path: Path
) -> None:
    assert main(["quantize", spec, str(tmp_path / "out"), "--scheme", "w8a8"]) == 0
    inputs = read_manifest(tmp_path / "out")["inputs"]
    assert (inputs["hub_id"], inputs["revision"], inputs["commit"]) == (REPO, revision, COMMIT)
    assert inputs["source"] == str(offline)


def test_load_pipeline_from_a_hub_id_and_a_pinned_commit(offline: Path) -> None:
    stored = load_file(offline / "transformer" / "diffusion_pytorch_model.safetensors")
    for spec in (REPO, f"{REPO}@{COMMIT}", f"{REPO}@main"):
        pipeline = ditq.load_pipeline(spec, device="cpu")
        weights = pipeline.transformer.state_dict()
        assert all(torch.equal(weights[name], tensor) for name, tensor in stored.items()), spec


def test_a_local_directory_wins_over_a_hub_id(offline: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "demo").mkdir(parents=True)
    assert resolve_model(REPO) == Path(REPO)
    assert resolve_model(Path("nobody/absent")) == Path("nobody/absent")  # a Path is a path, never an id


def _one_line_error(spec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["quantize", spec, str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "command",
    [["quantize", "{id}", "{tmp}/out"], ["plan", "{id}", "--out", "{tmp}/PLAN.json"], ["serve", "{id}"],
     ["generate", "{id}", "--prompt", "a red star"],
     ["baseline", "{id}", "--fixtures", "{tmp}/f.json", "--refs", "{tmp}", "--out", "{tmp}/run"],
     ["sweep", "{id}", "--fixtures", "{tmp}/f.json", "--refs", "{tmp}", "--out", "{tmp}/sweep"]],
)  # fmt: skip
def test_every_command_taking_a_model_resolves_a_hub_id(
    command: list[str], offline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An id absent from the cache is the resolver's one line, before anything is loaded or written."""
    argv = [part.format(id="nobody/absent", tmp=tmp_path) for part in command]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"ditq {command[0]}: error: nobody/absent: not a local directory, and not in the hub cache "
        f"{offline.parents[2]}; HF_HUB_OFFLINE is set (unset it, with network access, to download it), point "
        "HF_HOME or HF_HUB_CACHE at a cache that holds it, or give a local path"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_revision_absent_from_the_cache_is_one_line(offline: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    line = _one_line_error(f"{REPO}@v2", tmp_path, capsys)
    assert f"{REPO}@v2: revision v2 is not in the hub cache" in line and "(it holds main)" in line
    assert "HF_HUB_OFFLINE" in line and "HF_HOME" in line


def test_a_model_absent_from_the_cache_is_one_line_naming_what_to_set(
    offline: Path, tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    line = _one_line_error("nobody/absent", tmp_path, capsys)
    assert line.startswith(
        "ditq quantize: error: nobody/absent: not a local directory, and not in the hub cache"
    )
    assert all(setting in line for setting in ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "a local path"))


def test_local_files_only_reads_the_cache_alone(offline: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert (
        ditq.quantize(REPO, tmp_path / "out", "w8a16", local_files_only=True).manifest["inputs"]["hub_id"]
        == REPO
    )
    with pytest.raises(
        InputError, match=r"^nobody/absent: not a local directory.*; local_files_only is set \("
    ):
        ditq.load_pipeline("nobody/absent", device="cpu", local_files_only=True)


@pytest.mark.parametrize(
    "spec",
    ["../demo", "/ditq/demo", "ditq/../demo", "ditq/demo/transformer", "./demo", "~/demo", "ditq--x/demo",
     "ditq/demo@", "ditq/demo@../main", "ditq/", "demo", "C:/demo"],
)  # fmt: skip
def test_paths_are_never_hub_ids(spec: str) -> None:
    assert parse_hub_id(spec) is None


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [("Qwen/Qwen-Image", ("Qwen/Qwen-Image", None)), ("org/na.me_1@refs/pr/3", ("org/na.me_1", "refs/pr/3")),
     (f"ditq/demo@{COMMIT}", ("ditq/demo", COMMIT))],
)  # fmt: skip
def test_hub_ids(spec: str, parsed: tuple[str, str | None]) -> None:
    assert parse_hub_id(spec) == parsed


def test_only_what_diffusers_reads_is_fetched() -> None:
    """The default files of each component and its configs and tokenizer files; a variant's weights only when
    that variant is asked for."""
    repo = [
        "model_index.json", "README.md", "assets/teaser.png",
        "transformer/config.json", "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json", "transformer/diffusion_pytorch_model.bin",
        "transformer/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_flax_model.msgpack",
        "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/spiece.model", "processor/chat_template.jinja",
        "scheduler/scheduler_config.json",
    ]  # fmt: skip
    allow, ignore = hub_patterns(None)
    fetched = set(filter_repo_objects(repo, allow_patterns=allow, ignore_patterns=ignore))
    assert fetched == {
        "model_index.json", "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/spiece.model", "processor/chat_template.jinja",
        "scheduler/scheduler_config.json",
    }  # fmt: skip
    allow, ignore = hub_patterns("fp16")
    with_fp16 = set(filter_repo_objects(repo, allow_patterns=allow, ignore_patterns=ignore))
    assert with_fp16 - fetched == {"transformer/diffusion_pytorch_model.fp16.safetensors"}


@pytest.mark.parametrize("offline_env", [None, "1"])
def test_a_lookup_says_it_goes_to_the_network_and_hf_hub_offline_keeps_it_off(
    offline_env: str | None, tmp_path: Path
) -> None:
    """In a process of its own, with the hub's endpoint a closed loopback port (huggingface_hub reads it at import):
    without HF_HUB_OFFLINE the lookup logs that it fetches from the hub first, then fails in one line; with it, it
    reads the cache only and says nothing of a fetch."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_ENDPOINT="http://127.0.0.1:9")
    if offline_env is not None:
        env["HF_HUB_OFFLINE"] = offline_env
    done = subprocess.run(
        [sys.executable, "-m", "ditq.cli", "quantize", "nobody/absent", "out"], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    fetching = "nobody/absent: not a local directory; fetching it from the hub into"
    assert (fetching in done.stderr) == (offline_env is None), done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ditq quantize: error: nobody/absent: not a local directory, and not in the hub cache"
    )


# A hostile hub cache: the id resolves only to a snapshot of its own entry, through refs holding a commit, every
# path inside that entry, a regular file or folder; anything else is one line and nothing is written.

SPOOF = "evil/spoof"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _spoof_entry(hub: Path) -> Path:
    entry = hub / "models--evil--spoof"
    (entry / "refs").mkdir(parents=True)
    (entry / "snapshots").mkdir()
    return entry


def _ref_out_of_the_cache(hub: Path) -> str:
    shutil.copytree(default_model_dir(), hub.parent / "outside-model")
    (_spoof_entry(hub) / "refs" / "main").write_text("../../../outside-model")
    return SPOOF


def _ref_to_another_repository(hub: Path) -> str:
    (_spoof_entry(hub) / "refs" / "main").write_text(f"../../models--acme--demo/snapshots/{COMMIT}")
    return SPOOF


def _snapshot_linked_to_another_repository(hub: Path) -> str:
    entry = _spoof_entry(hub)
    (entry / "refs" / "main").write_text(OTHER)
    (entry / "snapshots" / OTHER).symlink_to(hub / "models--acme--demo" / "snapshots" / COMMIT)
    return SPOOF


def _fifo_ref(hub: Path) -> str:
    os.mkfifo(_spoof_entry(hub) / "refs" / "main")
    return SPOOF


def _huge_ref(hub: Path) -> str:
    (_spoof_entry(hub) / "refs" / "main").write_bytes(b"a" * (64 << 20))
    return SPOOF


def _file_linked_out_of_the_entry(hub: Path) -> str:
    entry = _spoof_entry(hub)
    (entry / "refs" / "main").write_text(OTHER)
    snapshot = entry / "snapshots" / OTHER
    shutil.copytree(default_model_dir(), snapshot)
    outside = hub.parent / "evil-config.json"
    outside.write_text((snapshot / "transformer" / "config.json").read_text())
    (snapshot / "transformer" / "config.json").unlink()
    (snapshot / "transformer" / "config.json").symlink_to(outside)
    return SPOOF


@pytest.mark.parametrize(
    ("craft", "said"),
    [
        (_ref_out_of_the_cache, "does not hold a commit hash"),
        (_ref_to_another_repository, "does not hold a commit hash"),
        (_snapshot_linked_to_another_repository, "not a snapshot of its own cache entry"),
        (_fifo_ref, "is a FIFO"),
        (_huge_ref, "it holds 67108864 bytes"),
        (_file_linked_out_of_the_entry, "not a file of its own cache entry"),
        (lambda hub: "good/demo.", "not a hub id huggingface_hub accepts"),
        (lambda hub: "good/demo-", "not a hub id huggingface_hub accepts"),
    ],
    ids=["ref out of the cache", "ref to another repository", "snapshot linked to another repository",
         "FIFO ref", "64 MiB ref", "file linked out of its entry", "trailing dot", "trailing dash"],
)  # fmt: skip
def test_a_hostile_hub_cache_is_refused_in_one_line(
    craft: Callable[[Path], str],
    said: str,
    hub_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    home = tmp_path / "hf-home"
    shutil.copytree(hub_home, home, symlinks=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    spec = craft(home / "hub")
    out = tmp_path / "out"
    started = time.monotonic()
    assert main(["quantize", spec, str(out), "--scheme", "w8a8"]) == 2
    assert time.monotonic() - started < 20  # a FIFO is never opened for reading
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and len(lines[0]) < 600, lines
    assert not out.exists()


def test_a_snapshot_whose_files_link_into_its_own_blobs_resolves(
    hub_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What huggingface_hub itself writes: each file of a snapshot a relative link into its entry's blobs/."""
    home = tmp_path / "hf-home"
    shutil.copytree(hub_home, home)
    entry = home / "hub" / "models--acme--demo"
    (entry / "blobs").mkdir()
    for path in sorted(p for p in (entry / "snapshots" / COMMIT).rglob("*") if p.is_file()):
        blob = entry / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.move(path, blob)
        path.symlink_to(os.path.relpath(blob, path.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    from ditq.checkpoint.hub import resolve_source

    folder, origin = resolve_source(REPO)
    assert folder == entry / "snapshots" / COMMIT and origin is not None and origin.commit == COMMIT
