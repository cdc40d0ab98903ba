"""The demo's parity band: PSNR between two acceptable runs of the unquantized demo model.

    python benchmarks/demo_parity.py --demo-out demo-out --out benchmarks/results/demo_parity_cpu_COMMIT.json

The demo's baseline (``demo-out/baseline``: ``ditq serve`` in float32, through HTTP) and a second run of
the same model in process in bfloat16 (``ditq baseline`` without ``--endpoint``) are two implementations
and settings of BF16-class inference, as the seed's band was (two BF16 stacks, 27.6 dB). Their PSNR
against each other is the band a quantized candidate is judged against; ``ditq demo`` measures the same
pair in every run (``--parity-in-process``). Run ``ditq demo`` first (about 3.5 minutes on two cores; this
script about one more). The JSON records the commands, the PSNR per fixture and seed, per fixture and overall
its mean with a 95 % interval over seeds (``ditq.judge.stats.mean_interval``, as the report's intervals are taken),
min and max, and the versions.
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

from result_names import result_path


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


def _with_interval(values: list[float]) -> dict[str, object]:
    """Mean, 95 % interval over seeds (``ditq.judge.stats``), min and max of PSNR values (dB)."""
    from ditq.judge.stats import mean_interval

    interval = mean_interval(values)
    return {
        "mean": round(interval.estimate, 2),
        "low": round(interval.low, 2),
        "high": round(interval.high, 2),
        "confidence": interval.confidence,
        "method": interval.method,
        "n": interval.n,
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--demo-out", type=Path, default=Path("demo-out"), help="a finished `ditq demo --out` dir"
    )
    parser.add_argument("--out", type=Path, default=result_path("demo_parity", "cpu"))
    args = parser.parse_args()

    from ditq import demo
    from ditq.demo.settings import DEMO

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
    per_seed: dict[str, dict[str, float]] = {}
    for row in result["rows"]:
        if row["status"] != "ok":
            raise SystemExit(
                f"compare: {row['fixture_id']} s{row['seed']} is {row['status']}: {row['error']}"
            )
        per_seed.setdefault(row["fixture_id"], {})[str(row["seed"])] = row["psnr_db"]
    every = [value for seeds in per_seed.values() for value in seeds.values()]
    payload = {
        "command": shlex.join(["python", *sys.argv]),
        "what": "PSNR of the demo model run in process in bfloat16 against the demo's float32 served baseline",
        "runs": {"a": str(args.demo_out / "baseline"), "b": str(second)},
        "commands": [_shown(baseline), _shown(compare)],
        "steps": sweep["steps"],
        "seeds": sweep["seeds"],
        "parity_db": result["overall"]["psnr_db"]["mean"],
        "psnr_db": _with_interval(every),  # over every fixture and seed
        "ssim": result["overall"]["ssim"],
        "per_fixture_psnr_db": {k: _with_interval(list(v.values())) for k, v in per_seed.items()},
        "per_seed_psnr_db": per_seed,  # fixture -> seed -> PSNR of the pair's two images
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
