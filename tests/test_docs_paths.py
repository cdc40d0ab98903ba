"""Every file the front door and the docs name exists: a path into the repository (``ditq/...``, ``tests/...``,
``benchmarks/...``) or a relative link in README.md and docs/, and a test named as ``FILE::test_name`` is in that
file. A file that is gone may still be cited from the history, as ``git show COMMIT:PATH`` on the same line."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# a path from the repository's root: one of its top folders, then a name
ROOTED = re.compile(r"(?<![\w./:-])((?:ditq|tests|benchmarks|tools|docs|seed|\.ci)/[\w./-]*[\w/])(::\w+)?")
LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)\s#]+)")
PLACEHOLDER = re.compile(r"[*<>{}]|\bCOMMIT\b|\bCARD\b")


def _missing(doc: Path) -> list[str]:
    """``doc:line: path`` for each path in ``doc`` that names nothing in the tree."""
    missing = []
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        historical = set(re.findall(r"git show \w+:([\w./-]+)", line))
        named = [(REPO / path, path, test) for path, test in ROOTED.findall(line)]
        named += [((doc.parent / link).resolve(), link, "") for link in LINK.findall(line)]
        for target, path, test in named:
            if PLACEHOLDER.search(path) or path in historical:
                continue
            if not target.exists():
                missing.append(f"{doc.relative_to(REPO)}:{number}: {path}")
            elif test and f"def {test[2:]}(" not in target.read_text():
                missing.append(f"{doc.relative_to(REPO)}:{number}: {path}{test}")
    return missing


def test_every_path_the_docs_name_exists() -> None:
    assert [line for doc in DOCS for line in _missing(doc)] == []
