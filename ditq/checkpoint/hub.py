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

The snapshot folder names its repository and commit (``.../models--org--name/snapshots/<commit>``):
``hub_origin(path)`` reads them back, which is how a quantizer records its source.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ditq.errors import InputError

__all__ = [
    "hub_cache_dir",
    "hub_origin",
    "hub_patterns",
    "parse_hub_id",
    "refuse_missing_local",
    "refuse_missing_source",
    "resolve_model",
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


def resolve_model(spec: str | Path, variant: str | None = None, local_files_only: bool = False) -> Path:
    """The directory ``spec`` names: a path that exists; else, for a ``str`` hub id, its snapshot in the hub cache
    (downloaded unless ``HF_HUB_OFFLINE`` or ``local_files_only``); else ``Path(spec)`` unchanged. A ``Path`` is
    never read as a hub id. ``variant`` (``fp16``) also fetches that variant's weights.

    A hub id that cannot be resolved is an InputError of one line naming the id and what to set.
    """
    if isinstance(spec, Path) or Path(spec).exists() or (parsed := parse_hub_id(spec)) is None:
        return Path(spec)
    refuse_missing_local(spec)
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
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
    return Path(folder)


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
    repo_folder = cache / f"models--{repo_id.replace('/', '--')}"
    ref = repo_folder / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    if commit and (repo_folder / "snapshots" / commit).is_dir():
        missing = f"its snapshot {commit} in the hub cache {cache} is incomplete"
    elif repo_folder.is_dir():
        have = sorted(p.name for p in (repo_folder / "refs").glob("*") if p.is_file())
        held = f" (it holds {', '.join(have)})" if have else ""
        missing = f"revision {revision or 'main'} is not in the hub cache {cache}{held}"
    else:
        missing = f"not a local directory, and not in the hub cache {cache}"
    return f"{spec}: {missing}; {what}, {_ELSEWHERE}"
