"""A model given by its hub id (``org/name[@revision]``): resolved to a snapshot folder of the local hub cache.

``resolve_model(spec)`` is the one place a model argument becomes a directory. A path that exists is that path,
always: a local folder wins over a hub id of the same spelling. A ``str`` that does not exist and reads as
``org/name`` or ``org/name@revision`` (no ``..``, nothing absolute, the hub's own rules for names) is resolved by
``huggingface_hub.snapshot_download`` into the cache that ``HF_HUB_CACHE``, else ``HF_HOME``/hub, names, read from
the environment at the call (so a setting made after import counts). ``HF_HUB_OFFLINE`` (or ``local_files_only``)
reads the cache only, and a lookup that may go to the network says so first (logged). A missing ``str`` whose first
component exists here (``artifacts/typo`` beside a folder ``artifacts``) is a mistyped path: refused, never looked
up. Anything else is returned as a path, for the caller's own "not a directory".

Only what ditq and diffusers read is fetched: ``model_index.json`` and, in each component folder, its JSON
configs, safetensors weights (the requested variant's and the default ones; without a variant, the default
ones only), and tokenizer or processor files (``*.txt``, ``*.model``, ``*.jinja``, ``*.tiktoken``). Pickled
weights (``*.bin``, ``*.pt``), ONNX and Flax files, images and READMEs are not.

The cache is read as confined (``_confined_snapshot``): an id resolves only to a snapshot folder of its own
cache entry (``models--org--name/snapshots/<commit>``); a ``refs/`` file holds a commit hash (40 hex digits,
read at most 64 bytes, a regular file), or the id is refused; and every path met on the way (the entry, its
snapshot, each file, each link into its ``blobs/``) stays inside that entry and is a regular file or folder. Ids
are checked with huggingface_hub's own validator first. ``resolve_source`` returns what was asked and what it
resolved to (``HubSource``: id, revision, commit), which is what a quantizer records; ``hub_origin(path)`` reads a
snapshot folder's repository and commit back from its path, which only names a served model.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ditq.errors import InputError
from ditq.fsutil import file_kind, read_bounded

__all__ = [
    "HubSource",
    "hub_cache_dir",
    "hub_origin",
    "hub_patterns",
    "parse_hub_id",
    "refuse_missing_local",
    "refuse_missing_source",
    "resolve_model",
    "resolve_source",
]

_ALLOW_PATTERNS = (
    "model_index.json",
    "*/*.json",
    "*/*.safetensors",
    "*/*.txt",
    "*/*.model",
    "*/*.jinja",
    "*/*.tiktoken",
)
# A variant's weights and index (``diffusion_pytorch_model.fp16.safetensors``, ``model.fp16-00001-of-00002.safetensors``,
# ``diffusion_pytorch_model.safetensors.index.fp16.json``): left out when no variant is asked for.
_VARIANT_PATTERNS = ("*/*.*.safetensors", "*/*.safetensors.index.*.json")

# The hub's rules for a repository id: one "/", each part starting with a letter or digit, no "--" or "..".
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]*))?$")
_SNAPSHOT = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")
log = logging.getLogger(__name__)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REF_BYTES = 64  # a commit hash is 40 bytes; a ref longer than this is not one (and is not echoed)
_SNAPSHOT_ENTRIES = 100_000  # a diffusers snapshot holds tens of files
_ELSEWHERE = "point HF_HOME or HF_HUB_CACHE at a cache that holds it, or give a local path"


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when ``spec`` reads as ``org/name[@revision]``, else None."""
    match = _HUB_ID.match(spec)
    if match is None or ".." in spec or "--" in match["repo"] or "//" in spec or spec.endswith("/"):
        return None
    return match["repo"], match["revision"]


def hub_patterns(variant: str | None) -> tuple[list[str], list[str]]:
    """(allow_patterns, ignore_patterns) for ``snapshot_download``: what ditq and diffusers read of a model."""
    return list(_ALLOW_PATTERNS), [] if variant else list(_VARIANT_PATTERNS)


def _is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read from the environment now: ``HF_HUB_CACHE``, else the legacy
    ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME``/hub, else ``$XDG_CACHE_HOME``/huggingface/hub (~/.cache)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ
    return constants.HF_HUB_OFFLINE or _is_true(env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE"))


def hub_origin(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a hub snapshot folder (``.../models--org--name/snapshots/<commit>``), else None."""
    parts = Path(path).resolve().parts
    if len(parts) < 3 or parts[-2] != "snapshots" or (match := _SNAPSHOT.match(parts[-3])) is None:
        return None
    return f"{match['org']}/{match['name']}", parts[-1]


@dataclass(frozen=True)
class HubSource:
    """A hub id as it was asked for, and the commit of the cache's snapshot it resolved to."""

    hub_id: str
    revision: str  # as asked ("main" where none was)
    commit: str  # 40 hex digits


def resolve_model(spec: str | Path, variant: str | None = None, local_files_only: bool = False) -> Path:
    """The directory ``spec`` names (``resolve_source``)."""
    return resolve_source(spec, variant, local_files_only)[0]


def resolve_source(
    spec: str | Path, variant: str | None = None, local_files_only: bool = False
) -> tuple[Path, HubSource | None]:
    """The directory ``spec`` names: a path that exists; else, for a ``str`` hub id, its snapshot in the hub cache
    (downloaded unless ``HF_HUB_OFFLINE`` or ``local_files_only``), with the ``HubSource`` it was; else
    ``Path(spec)`` unchanged. A ``Path`` is never read as a hub id. ``variant`` (``fp16``) also fetches that
    variant's weights.

    A hub id that cannot be resolved, or whose cache entry leads elsewhere, is an InputError of one line naming
    the id and what to set.
    """
    if isinstance(spec, Path) or Path(spec).exists() or (parsed := parse_hub_id(spec)) is None:
        return Path(spec), None
    refuse_missing_local(spec)
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise InputError(f"{spec[:200]}: not a hub id huggingface_hub accepts ({_one_line(error)})") from None
    cache = hub_cache_dir()
    entry = _cache_entry(spec, cache, repo_id)
    if entry is not None:
        _read_ref(spec, entry, revision)  # refused before huggingface_hub follows it
    offline = "local_files_only" if local_files_only else "HF_HUB_OFFLINE" if _offline() else None
    if offline is None:
        log.info("%s: not a local directory; fetching it from the hub into %s (network)", spec, cache)
    allow, ignore = hub_patterns(variant)
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline is not None,
            allow_patterns=allow,
            ignore_patterns=ignore,
        )
    except GatedRepoError:
        raise InputError(
            f"{spec}: a gated model on the hub: accept its terms on its page, then set HF_TOKEN (or run `hf auth "
            "login`)"
        ) from None
    except RepositoryNotFoundError:
        raise InputError(
            f"{spec}: no such local directory, and no such model on the hub (a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise InputError(f"{spec}: the hub has no revision {revision!r} of {repo_id}") from None
    except LocalEntryNotFoundError:  # offline, or the hub unreachable, and the cache short of it
        raise InputError(_not_cached(spec, repo_id, revision, cache, offline)) from None
    except HfHubHTTPError as error:
        raise InputError(f"{spec}: the hub answered {error.response.status_code}; {_ELSEWHERE}") from None
    except HFValidationError as error:
        raise InputError(f"{spec[:200]}: not a hub id huggingface_hub accepts ({_one_line(error)})") from None
    commit = _confined_snapshot(spec, cache, repo_id, Path(folder))
    return cache / _entry_name(repo_id) / "snapshots" / commit, HubSource(repo_id, revision or "main", commit)


def _one_line(error: BaseException) -> str:
    """An error's message on one line, at most 200 characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= 200 else text[:200] + "..."


def _entry_name(repo_id: str) -> str:
    return f"models--{repo_id.replace('/', '--')}"


def _cache_entry(spec: str, cache: Path, repo_id: str) -> Path | None:
    """The id's own folder of the cache, where it exists: a folder, not a link (else an InputError)."""
    entry = cache / _entry_name(repo_id)
    if not os.path.lexists(entry):
        return None
    mode = os.lstat(entry).st_mode
    if not stat.S_ISDIR(mode):
        what = "a link" if stat.S_ISLNK(mode) else file_kind(mode)
        raise InputError(f"{spec}: the hub cache's {entry} is {what}, not a folder; {_ELSEWHERE}")
    return entry


def _read_ref(spec: str, entry: Path, revision: str | None) -> str | None:
    """The commit ``refs/<revision>`` holds (None: no such ref, or ``revision`` is a commit); a ref that is not a
    regular file holding a commit hash is an InputError naming it."""
    if revision is not None and _COMMIT.match(revision):
        return None
    ref = entry / "refs" / (revision or "main")
    if not os.path.lexists(ref):
        return None
    if ref.is_symlink() or not ref.is_file():
        what = "a link" if ref.is_symlink() else file_kind(os.stat(ref).st_mode)
        raise InputError(f"{spec}: the hub cache's {ref} is {what}, not a file holding a commit")
    size = ref.stat().st_size
    commit = "" if size > _REF_BYTES else read_bounded(ref, _REF_BYTES).decode("ascii", "replace").strip()
    if not _COMMIT.match(commit):
        raise InputError(
            f"{spec}: the hub cache's {ref} does not hold a commit hash (40 hex digits; it holds {size} bytes); "
            f"{_ELSEWHERE}"
        )
    return commit


def _confined_snapshot(spec: str, cache: Path, repo_id: str, folder: Path) -> str:
    """The commit of ``folder``, a snapshot of the id's own cache entry, after checking that every path in it is
    a folder or a regular file inside that entry (a link into its ``blobs/`` included); else an InputError."""
    entry = Path(os.path.realpath(cache)) / _entry_name(repo_id)
    snapshots = entry / "snapshots"
    real = Path(os.path.realpath(folder))
    if real.parent != snapshots or not _COMMIT.match(real.name) or Path(folder).name != real.name:
        raise InputError(f"{spec}: resolved to {folder}, not a snapshot of its own cache entry {entry}")
    seen = 0
    for dirpath, dirnames, filenames in os.walk(real):
        for name in (*dirnames, *filenames):
            seen += 1
            path = Path(dirpath) / name
            if seen > _SNAPSHOT_ENTRIES:
                raise InputError(f"{spec}: its snapshot {real} holds more than {_SNAPSHOT_ENTRIES} entries")
            _check_snapshot_entry(spec, entry, path)
    return real.name


def _check_snapshot_entry(spec: str, entry: Path, path: Path) -> None:
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return
    target = Path(os.path.realpath(path))
    if (
        stat.S_ISLNK(mode)
        and target.parent == entry / "blobs"
        and target.is_file()
        and not target.is_symlink()
    ):
        return
    what = f"a link to {target}" if stat.S_ISLNK(mode) else file_kind(mode)
    raise InputError(f"{spec}: {path} is {what}, not a file of its own cache entry {entry}")


def refuse_missing_local(spec: str) -> None:
    """A missing ``spec`` whose first component exists here (``artifacts/typo`` beside a folder ``artifacts``) is a
    mistyped path, never a hub id: an InputError naming it. (One that starts with ``./``, ``../``, ``/`` or ``~``
    never reads as a hub id.)"""
    first = Path(spec).parts[0]
    if Path(first).exists():
        raise InputError(
            f"{spec}: no such directory ({first} exists here, so it is read as a path, not looked up on the hub)"
        )


def refuse_missing_source(spec: str | Path) -> None:
    """A source that is not a hub id and is not a directory: an InputError naming it, said before anything about
    the output (the order a user fixes them)."""
    if isinstance(spec, str) and not Path(spec).exists() and parse_hub_id(spec) is not None:
        refuse_missing_local(spec)
        return  # a hub id: resolve_model looks it up
    if not Path(spec).is_dir():
        raise InputError(f"{spec}: {'not a directory' if Path(spec).exists() else 'no such directory'}")


def _not_cached(spec: str, repo_id: str, revision: str | None, cache: Path, offline: str | None) -> str:
    """One line: what the cache lacks (the model, the revision, or files of its snapshot) and what to set."""
    what = (
        f"{offline} is set (unset it, with network access, to download it)"
        if offline
        else "the hub could not be reached (check the network, or HF_ENDPOINT)"
    )
    repo_folder = cache / _entry_name(repo_id)
    try:
        commit = (_read_ref(spec, repo_folder, revision) if repo_folder.is_dir() else None) or revision
    except InputError:
        commit = revision
    if commit and (repo_folder / "snapshots" / commit).is_dir():
        missing = f"its snapshot {commit} in the hub cache {cache} is incomplete"
    elif repo_folder.is_dir():
        have = sorted(p.name for p in (repo_folder / "refs").glob("*") if p.is_file())
        held = f" (it holds {', '.join(have)})" if have else ""
        missing = f"revision {revision or 'main'} is not in the hub cache {cache}{held}"
    else:
        missing = f"not a local directory, and not in the hub cache {cache}"
    return f"{spec}: {missing}; {what}, {_ELSEWHERE}"
