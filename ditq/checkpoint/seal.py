"""The seals of an artifact's ``MANIFEST.json``, and what each proves.

- ``MANIFEST.json.sha256`` (``sha256sum`` format), always written: the manifest's sha256, and through the digests
  the manifest holds, every file's. It proves that nothing changed by accident since the artifact was written,
  not who wrote it: anyone can edit the files and recompute every digest and this seal.
- ``MANIFEST.json.hmac``, written when ``DITQ_SEAL_KEY`` is set: ``hmac-sha256:<hex>  MANIFEST.json``, the
  HMAC-SHA256 of the manifest under that key. Re-sealing needs the key, so ``verify`` with the key set proves
  that whoever sealed the artifact held it. Without the key it cannot be checked, and is reported as not
  checked, never as passed; with the key set, an artifact without it fails (a plain seal proves no provenance).

Only artifacts take a keyed seal; a baseline's ``SEAL.json`` holds plain sha256 digests.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from ditq.errors import InputError
from ditq.fsutil import atomic_write_bytes, open_regular

__all__ = [
    "MANIFEST",
    "MANIFEST_KEYED_SEAL",
    "MANIFEST_SEAL",
    "SEAL_KEY_ENV",
    "keyed_seal_verdict",
    "manifest_digests",
    "seal_key",
    "write_seals",
]

MANIFEST = "MANIFEST.json"
MANIFEST_SEAL = "MANIFEST.json.sha256"
MANIFEST_KEYED_SEAL = "MANIFEST.json.hmac"
SEAL_KEY_ENV = "DITQ_SEAL_KEY"
_KEYED_SEAL_BYTES = 256  # "hmac-sha256:" + 64 hex digits + "  MANIFEST.json\n" is 93


def seal_key() -> bytes | None:
    """``DITQ_SEAL_KEY`` as the bytes the environment holds (any bytes: a key need not be text), or None where
    it is not set. Where the environment is text only, a key that cannot be encoded is an InputError."""
    if os.supports_bytes_environ:
        key = os.environb.get(SEAL_KEY_ENV.encode())
    else:  # pragma: no cover - Windows: the environment is text
        text = os.environ.get(SEAL_KEY_ENV)
        try:
            key = None if text is None else text.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"{SEAL_KEY_ENV} cannot be encoded as bytes: give the key as text") from None
    if key is None:
        return None
    if not key or key != key.strip():
        raise InputError(
            f"{SEAL_KEY_ENV} is empty or has surrounding whitespace: give the key exactly, or unset it"
        )
    return key


def manifest_digests(path: Path, key: bytes | None) -> tuple[str, str | None]:
    """(sha256, HMAC-SHA256 under ``key`` or None) of the manifest at ``path``, read once, streamed."""
    plain = hashlib.sha256()
    keyed = None if key is None else hmac.new(key, digestmod=hashlib.sha256)
    with open_regular(path) as handle:
        while chunk := handle.read(1 << 20):
            plain.update(chunk)
            if keyed is not None:
                keyed.update(chunk)
    return plain.hexdigest(), None if keyed is None else keyed.hexdigest()


def _keyed_line(mac: str) -> bytes:
    return f"hmac-sha256:{mac}  {MANIFEST}\n".encode()


def write_seals(root: Path, key: bytes | None) -> None:
    """The plain seal of ``root/MANIFEST.json``, and its keyed seal where ``key`` is given."""
    digest, mac = manifest_digests(Path(root) / MANIFEST, key)
    atomic_write_bytes(Path(root) / MANIFEST_SEAL, f"{digest}  {MANIFEST}\n".encode())
    if mac is not None:
        atomic_write_bytes(Path(root) / MANIFEST_KEYED_SEAL, _keyed_line(mac))


def keyed_seal_verdict(root: Path, key: bytes | None, mac: str | None) -> tuple[bool | None, str]:
    """(True: the keyed seal matches under ``key``; False: it does not, or is missing; None: not checked, no key),
    and a one-line detail. ``mac``: the manifest's HMAC under ``key`` (``manifest_digests``)."""
    path = Path(root) / MANIFEST_KEYED_SEAL
    present = os.path.lexists(path)
    if key is None or mac is None:
        if present:
            return None, f"keyed: not checked ({SEAL_KEY_ENV} is not set)"
        return None, "not keyed: a plain seal proves integrity, not provenance"
    if not present:
        return False, f"no {MANIFEST_KEYED_SEAL}: {MANIFEST} is not sealed with {SEAL_KEY_ENV}"
    try:
        with open_regular(path) as handle:
            recorded = handle.read(_KEYED_SEAL_BYTES)
    except InputError as error:  # a FIFO or a folder in its place
        return False, str(error)
    if hmac.compare_digest(recorded, _keyed_line(mac)):
        return True, f"keyed: HMAC-SHA256 under {SEAL_KEY_ENV} matches"
    return (
        False,
        f"{MANIFEST_KEYED_SEAL} does not match {MANIFEST} under {SEAL_KEY_ENV} (altered, or another key)",
    )
