"""Whole-process time of ``ditq verify ARTIFACT --source MODEL`` at full widths on the CPU, against another checkout.

    python benchmarks/verify_bench.py --work /tmp/verify-bench --against OTHER_CHECKOUT \
        --out benchmarks/results/verify_bench_cpu_COMMIT.json

Builds the slim pipeline under ``--work`` (``tools/full_size_pipeline.py --preset slim``: the full-size pipeline's
widths with two of each stack of layers, 5.4 GB; kept and reused), quantizes it once with ``--scheme`` (round to
nearest, this checkout), then runs ``python -m ditq.cli verify`` in a fresh process ``--repeat`` times for this
checkout and, with ``--against``, for that one (on PYTHONPATH), in turn, after one warm-up of each. Records each
run's wall, user and sys seconds and peak RSS (``os.wait4``), the medians, and this/against pair by pair. Both
checkouts verify the same artifact; a run that does not pass every check is recorded and fails the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ditq from this checkout, installed or not

from ditq.fsutil import atomic_write_json

REPO = Path(__file__).resolve().parents[1]


def commit_of(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def timed(argv: list[str], checkout: Path) -> dict[str, Any]:
    """One run of argv in ``checkout`` (``python -m`` puts the working directory first on the path, before
    PYTHONPATH and an installed ditq), with it on PYTHONPATH too: its exit code, wall, user, sys and peak RSS.
    The peak is wait4's, which counts this small process's pages at the fork (about 18 MiB; ``quantize_bench``'s
    ``timed`` forks from /usr/bin/time to leave them out)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    errors = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return {
        "exit": process.returncode,
        "wall_s": round(time.perf_counter() - start, 3),
        "user_s": round(usage.ru_utime, 3),
        "sys_s": round(usage.ru_stime, 3),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3),  # kilobytes on Linux
        "stderr_tail": errors.decode(errors="replace")[-300:] if process.returncode else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--work", type=Path, required=True, help="where the slim pipeline and its artifact live"
    )
    parser.add_argument("--against", type=Path, help="another ditq checkout to time beside this one")
    parser.add_argument("--scheme", default="w4a8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = args.work.resolve()
    model, artifact = work / "slim", work / f"slim-{args.scheme}"
    if not (model / "model_index.json").is_file():
        subprocess.run(
            [
                sys.executable,
                str(REPO / "tools/full_size_pipeline.py"),
                "--preset",
                "slim",
                "--out",
                str(model),
            ],
            check=True,
        )
    if not (artifact / "MANIFEST.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ditq.cli",
                "quantize",
                str(model),
                str(artifact),
                "--scheme",
                args.scheme,
            ],
            check=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    argv = [sys.executable, "-m", "ditq.cli", "verify", str(artifact), "--source", str(model)]
    checkouts = {"this": REPO} | ({"against": args.against.resolve()} if args.against else {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    for name, checkout in checkouts.items():  # each runs its own ditq; a warm-up fills the page cache
        where = subprocess.run(
            [sys.executable, "-c", "import ditq; print(ditq.__file__)"],
            cwd=checkout,
            env={**os.environ, "PYTHONPATH": str(checkout)},
            capture_output=True,
            text=True,
        ).stdout.strip()
        if not Path(where).is_relative_to(checkout):
            raise SystemExit(f"{name}: ditq imports from {where}, not from {checkout}")
        timed(argv, checkout)
    for _ in range(args.repeat):
        for name, checkout in checkouts.items():
            runs[name].append(timed(argv, checkout))
            print(name, json.dumps(runs[name][-1]), flush=True)
    report: dict[str, Any] = {
        "command": " ".join(["ditq", *argv[3:]]),
        "scheme": args.scheme,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "checkouts": {name: {"commit": commit_of(path)} for name, path in checkouts.items()},
        "runs": runs,
    }
    for name, results in runs.items():
        report["checkouts"][name].update(
            {
                f"median_{key}": statistics.median(r[key] for r in results)
                for key in ("wall_s", "user_s", "sys_s")
            }
        )
    if args.against:
        report["this_over_against_wall"] = [
            round(a["wall_s"] / b["wall_s"], 3) for a, b in zip(runs["this"], runs["against"], strict=True)
        ]
    atomic_write_json(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0 if all(r["exit"] == 0 for results in runs.values() for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
