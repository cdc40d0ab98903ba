"""The served-speed table of a whole-device run: s/image by reference count for each server, their ratios, and
where a request's time goes, from the servers' own files (``benchmarks/h200_whole_pipeline.sh``'s whole stage:
SERVE_DIR/ENTRY/{health.json, run/records.jsonl}).

    python3 benchmarks/served_speed.py SERVE_DIR --baseline bf16+compile --eager bf16 --out served_speed.json
    python3 benchmarks/served_speed.py --server bf16=SERVE_DIR/bf16 --server bf16+compile=SWEEP_DIR/baseline \
        --server fp8-fast=SWEEP_DIR/fp8-fast --out served_speed.json     # a sweep's servers beside the whole stage's

A server's folder holds ``run/records.jsonl`` (the whole stage's, a sweep candidate's) or ``records.jsonl`` (a
sweep's baseline), and ``health.json`` where the whole stage wrote one (a sweep keeps no health answer: its start-up
fields are null).

Per server and reference count: the mean wall time over the seeds (``ditq probe``'s records), and for the last
seed (each fixture's second request: warm) the text encoding, the first (prefix) step, the median cached step, the
decode and the postprocessing (PNG and the answer). Ratios divide each server's mean by the baseline's and the eager
server's at the same reference count (lower is better). Start-up: ready seconds, compile warm-up, its graphs and how
many came from the compile cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditq.fsutil import atomic_write_json


def _records_file(folder: Path) -> Path | None:
    for path in (folder / "run" / "records.jsonl", folder / "records.jsonl"):
        if path.is_file():
            return path
    return None


def _server(folder: Path) -> dict[str, Any]:
    health_file = folder / "health.json"
    health = json.loads(health_file.read_text()) if health_file.is_file() else {}
    records_file = _records_file(folder)
    if records_file is None:
        raise SystemExit(f"{folder}: no run/records.jsonl or records.jsonl")
    records = [json.loads(line) for line in records_file.read_text().splitlines() if line]
    by_refs: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_refs.setdefault(record["n_references"], []).append(record)
    rows = {}
    for refs, found in sorted(by_refs.items()):
        found.sort(key=lambda r: r["seed"])
        warm = found[-1]["metrics"]
        steps = warm["denoise_step_latencies_ms"]
        rows[refs] = {
            "seconds_per_image_by_seed": {str(r["seed"]): r["wall_s"] for r in found},
            "seconds_per_image_mean": round(statistics.mean(r["wall_s"] for r in found), 4),
            "warm_text_encoding_ms": round(warm["text_encoding_ms"], 1),
            "warm_prefix_step_ms": round(steps[0], 1),
            "warm_cached_step_ms": round(statistics.median(steps[1:]), 1),
            "warm_decoding_ms": round(warm["decoding_ms"], 1),
            "warm_postprocess_ms": round(warm["postprocess_time_ms"], 1),
        }
    compiled = health.get("compile") or {}
    return {
        "ready_seconds": health.get("ready_seconds"),
        "load_seconds": health.get("load_seconds"),
        "calibration_seconds": health.get("calibration_seconds"),
        "compile_warmup_seconds": compiled.get("warmup_seconds"),
        "compile_graphs": compiled.get("warmup_graphs"),
        "compile_cache_hits": compiled.get("cache_hits"),
        "kernel_paths": health.get("kernel_paths"),
        "accumulate": health.get("accumulate"),
        "attention": health.get("attention"),
        "by_references": rows,
    }


def _ratios(servers: dict[str, Any], name: str, against: str) -> dict[str, float]:
    mine, theirs = servers[name]["by_references"], servers[against]["by_references"]
    return {f"r{refs}": round(mine[refs]["seconds_per_image_mean"] / theirs[refs]["seconds_per_image_mean"], 3)
            for refs in mine if refs in theirs}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "serve_dir", type=Path, nargs="?", help="the whole stage's folder: one sub-folder per server"
    )
    parser.add_argument("--server", action="append", default=[], metavar="NAME=FOLDER",
                        help="one more server by name (repeatable): a sweep's baseline or candidate folder")  # fmt: skip
    parser.add_argument("--baseline", default="bf16+compile", help="the server ratios divide by")
    parser.add_argument("--eager", default="bf16", help="the eager server ratios divide by too")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    folders = {}
    if args.serve_dir is not None:
        folders = {folder.name: folder for folder in sorted(args.serve_dir.iterdir())
                   if (folder / "run" / "records.jsonl").is_file()}  # fmt: skip
    for entry in args.server:
        name, sep, folder = entry.partition("=")
        if not sep or not name or not folder:
            parser.error(f"--server {entry!r}: expected NAME=FOLDER")
        folders[name] = Path(folder)
    if not folders:
        parser.error("no server: give SERVE_DIR or --server NAME=FOLDER")
    servers = {name: _server(folder) for name, folder in folders.items()}
    for name, server in servers.items():
        for against in (args.baseline, args.eager):
            if against in servers and name != against:
                server[f"seconds_per_image_vs_{against}"] = _ratios(servers, name, against)
    atomic_write_json(args.out, {"command": " ".join(["python3", *sys.argv]), "servers": servers})
    for name, server in servers.items():
        print(f"{name}: ready {server['ready_seconds']} s, warm-up {server['compile_warmup_seconds']} s "
              f"({server['compile_graphs']} graphs, {server['compile_cache_hits']} from the cache)")  # fmt: skip
        for refs, row in server["by_references"].items():
            ratio = server.get(f"seconds_per_image_vs_{args.baseline}", {}).get(f"r{refs}", float("nan"))
            eager = server.get(f"seconds_per_image_vs_{args.eager}", {}).get(f"r{refs}", float("nan"))
            print(f"  r{refs}: {row['seconds_per_image_mean']:.3f} s ({ratio:.3f}x {args.baseline}, {eager:.3f}x "
                  f"{args.eager}); warm: text {row['warm_text_encoding_ms']} ms, prefix {row['warm_prefix_step_ms']}"
                  f" ms, cached {row['warm_cached_step_ms']} ms, decode {row['warm_decoding_ms']} ms, answer "
                  f"{row['warm_postprocess_ms']} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
