"""Wall time of `make demo` from a fresh clone (set-up included): the demo's goal is at most 10 minutes on 2 cores.

    python benchmarks/demo_wall.py --out benchmarks/results/demo_wall_cpu_COMMIT.json

Clones the current commit into a temporary directory, runs `make demo` there (it creates .venv, installs,
then runs `ditq demo --out demo-out`), and records the total wall time, the sweep's own time as the demo
prints it, the verdicts, the machine's core count and its load average before and after (other work on
the machine slows every step; the load average says how much there was).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from result_names import result_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=result_path("demo_wall", "cpu"))
    args = parser.parse_args()
    source = Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="ditq-demo-wall-"))
    try:
        subprocess.run(["git", "clone", "-q", str(source), str(work / "ditq")], check=True)
        load_before = os.getloadavg()
        started = time.monotonic()
        done = subprocess.run(["make", "demo"], cwd=work / "ditq", capture_output=True, text=True)
        wall = time.monotonic() - started
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    output = done
    lines = output.stdout.splitlines()
    sweep = next((line for line in lines if line.startswith("demo: ")), None)
    verdicts = [line for line in lines if re.match(r"^(w8a16|w8a8|fp8|plan): (YES|NO|UNDECIDED)", line)]
    # which candidate to serve, then one line on each other one
    recommendation = [line for line in lines if line.startswith(("Serve ", "No candidate", "  not "))]
    payload = {
        "command": "python benchmarks/demo_wall.py --out " + str(args.out),
        "measured": "git clone (this commit) && make demo",
        "commit": commit,
        "exit_code": output.returncode,
        "wall_s": round(wall, 1),
        "goal_s": 600,
        "sweep_line": sweep,
        "verdicts": verdicts,
        "recommendation": recommendation,
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(payload, indent=1))
    return 0 if output.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
