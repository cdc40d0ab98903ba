"""What a step cache buys a served request: s/image and skipped steps per reference count for each setting, against
the same scheme and step count without one, and the cache's own deviation from it (``ditq compare``), from the
whole-pipeline script's servers (``benchmarks/h200_whole_pipeline.sh``: its ``whole`` stage with ``+steps-N`` and
``+cache-KIND-VALUE`` entries, then its ``cachecompare`` stage):

    python3 benchmarks/step_cache_served.py SERVE_WHOLE_DIR --out step_cache_served.json

An entry ``SCHEME+steps-N+cache-KIND-VALUE`` is set against ``SCHEME+steps-N``. Per reference count: the mean wall
time over the seeds (``ditq probe``'s records), the mean skipped steps (the server's own count), the speed-up
(uncached s/image over cached) and, from the entry's ``run/compare.json``, the mean PSNR and SSIM against the
uncached images with their range over seeds and fixtures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from served_speed import _records_file

from ditq.fsutil import atomic_write_json

_CACHE = re.compile(r"\+cache-([a-z-]+)-([0-9.:]+)")


def _records(folder: Path) -> list[dict[str, Any]]:
    path = _records_file(folder)
    assert path is not None  # main lists only the folders that hold one
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _by_references(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    found: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        found.setdefault(record["n_references"], []).append(record)
    rows = {}
    for refs, group in sorted(found.items()):
        skipped = [r["metrics"].get("skipped_steps") for r in group]
        rows[refs] = {
            "seconds_per_image_by_seed": {str(r["seed"]): round(r["wall_s"], 4) for r in group},
            "seconds_per_image_mean": round(statistics.mean(r["wall_s"] for r in group), 4),
            "skipped_steps_mean": None if None in skipped else round(statistics.mean(skipped), 2),
        }
    return rows


def _compare(folder: Path) -> dict[str, Any] | None:
    path = folder / "run" / "compare.json"
    if not path.is_file():
        return None
    answer = json.loads(path.read_text())
    rows = [row for row in answer["rows"] if row["status"] == "ok"]
    by_refs: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_refs.setdefault(row["n_references"], []).append(row)
    return {
        "images": len(rows),
        "psnr_db_mean": answer["overall"]["psnr_db"]["mean"],
        "psnr_db_min": answer["overall"]["psnr_db"]["min"],
        "ssim_mean": answer["overall"]["ssim"]["mean"],
        "ssim_min": answer["overall"]["ssim"]["min"],
        "psnr_db_by_references": {
            str(refs): round(statistics.mean(r["psnr_db"] for r in group), 2)
            for refs, group in sorted(by_refs.items())
        },
        "lossless_decision": (answer.get("lossless") or {}).get("decision"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("serve_dir", type=Path, help="the whole stage's folder: one sub-folder per server")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    entries = {f.name: f for f in sorted(args.serve_dir.iterdir()) if _records_file(f) is not None}
    if not entries:
        parser.error(f"{args.serve_dir}: no SERVER/run/records.jsonl")
    rows = {name: {"by_references": _by_references(_records(folder))} for name, folder in entries.items()}
    for name, row in rows.items():
        match = _CACHE.search(name)
        if match is None:
            row["cache"] = None
            continue
        row["cache"] = f"{match.group(1)}:{match.group(2)}"
        uncached = _CACHE.sub("", name)
        if uncached not in rows:
            continue
        row["against"] = uncached
        row["speedup_by_references"] = {
            str(refs): round(
                rows[uncached]["by_references"][refs]["seconds_per_image_mean"] / r["seconds_per_image_mean"],
                3,
            )
            for refs, r in row["by_references"].items()
            if refs in rows[uncached]["by_references"]
        }
        speedups = list(row["speedup_by_references"].values())
        row["speedup_mean"] = round(statistics.mean(speedups), 3) if speedups else None
        row["against_uncached"] = _compare(entries[name])
    atomic_write_json(args.out, {"command": " ".join(["python3", *sys.argv]), "servers": rows})
    for name, row in rows.items():
        cells = " ".join(
            f"r{refs} {r['seconds_per_image_mean']:.3f}s/{r['skipped_steps_mean']}"
            for refs, r in row["by_references"].items()
        )
        extra = ""
        if "speedup_mean" in row:
            fidelity = row.get("against_uncached") or {}
            extra = f" | x{row['speedup_mean']} vs {row['against']}, PSNR {fidelity.get('psnr_db_mean')} dB"
        print(f"{name}: {cells}{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
