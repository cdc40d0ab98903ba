"""The demo's parity band: PSNR between two acceptable runs of the unquantized demo model.

    python benchmarks/demo_parity.py --demo-out demo-out --out benchmarks/results/demo_parity.json

The demo's baseline (``demo-out/baseline``: ``ditq serve`` in float32, through HTTP) and a second run of
the same model in process in bfloat16 (``ditq baseline`` without ``--endpoint``) are two implementations
and settings of BF16-class inference, as the seed's band was (two BF16 stacks, 27.6 dB). Their PSNR
against each other is the band a quantized candidate is judged against; ``ditq demo`` states it as
``DemoSettings.parity_db``. Run ``ditq demo`` first; the JSON records the commands, the per-fixture and
overall PSNR, and the versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path


def _ditq(*args: str) -> list[str]:
    return [sys.executable, "-m", "ditq.cli", *args]


def _shown(argv: list[str]) -> str:
    """As recorded: ``ditq ...`` (no interpreter path); the model and references as ditq's own."""
    from ditq import demo
    from ditq.report.provenance import shell_command

    return (
        shell_command(argv)
        .replace(str(demo.default_model_dir()), "<ditq.demo model>")
        .replace(str(demo.references_dir()), "<ditq.demo references>")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--demo-out", type=Path, default=Path("demo-out"), help="a finished `ditq demo --out` dir"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/demo_parity.json"))
    args = parser.parse_args()

    from ditq import demo
    from ditq.commands.demo import DEMO

    sweep = json.loads((args.demo_out / "SWEEP.json").read_text())
    second = args.demo_out / "parity-bf16-in-process"
    baseline = _ditq(
        "baseline",
        str(demo.default_model_dir()),
        "--fixtures",
        sweep["fixtures"],
        "--refs",
        str(demo.references_dir()),
        "--out",
        str(second),
        "--seeds",
        sweep["seeds"] or DEMO.seeds,
        "--steps",
        str(sweep["steps"]),
        "--no-progress",
    )
    started = time.monotonic()
    subprocess.run(baseline, check=True)
    seconds = time.monotonic() - started
    compare = _ditq(
        "compare", str(second), "--baseline", str(args.demo_out / "baseline"), "--no-lpips", "--json"
    )
    (result,) = json.loads(subprocess.run(compare, check=True, capture_output=True, text=True).stdout)
    payload = {
        "command": shlex.join(["python", *sys.argv]),
        "what": "PSNR of the demo model run in process in bfloat16 against the demo's float32 served baseline",
        "runs": {"a": str(args.demo_out / "baseline"), "b": str(second)},
        "commands": [_shown(baseline), _shown(compare)],
        "steps": sweep["steps"],
        "seeds": sweep["seeds"],
        "parity_db": result["overall"]["psnr_db"]["mean"],
        "psnr_db": result["overall"]["psnr_db"],
        "ssim": result["overall"]["ssim"],
        "per_fixture_psnr_db": {k: v["psnr_db"] for k, v in result["fixtures"].items()},
        "bf16_in_process_seconds": round(seconds, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps({k: payload[k] for k in ("parity_db", "psnr_db", "per_fixture_psnr_db")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
