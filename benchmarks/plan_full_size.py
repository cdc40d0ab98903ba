"""``ditq plan`` on the full-size Qwen-Image-2.1 pipeline, timed phase by phase: the proxy-based search at real size.

    python benchmarks/plan_full_size.py --pipeline DIR --out plan_full_size_CARD_COMMIT.json [--device cuda]

DIR is a pipeline ``tools/full_size_pipeline.py`` wrote (built here first when DIR does not exist yet:
``--preset full`` on the device, about 40 s on an H200). The plan runs in this process through ``make_plan``,
as ``ditq plan`` does, on ``--fixtures`` of the pipeline's fixtures (default: the 0- and 1-reference ones), with
the settings a proxy-based search at this size needs: final images for ``--image-blocks`` blocks only, one seed,
one proxy seed and step, ``--max-layers`` Linears measured one by one, a fixed ``--target-db`` (a bfloat16
source has no bfloat16 parity pair to measure a band against), one verification round. Each line the planner
says is recorded with the seconds since the start, so the JSON holds the time of every phase beside the plan's own
cost and result.

CPU dry run of every step on the tiny preset (torchvision missing is handled as ``full_size_pipeline`` does):

    python benchmarks/plan_full_size.py --pipeline /tmp/tiny-pipeline --preset tiny --device cpu \\
        --out /tmp/plan_full_size_tiny.json --steps 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # full_size_pipeline

import full_size_pipeline  # noqa: E402

from ditq.plan.planner import PlanOptions, make_plan  # noqa: E402
from ditq.runtime.options import LoadOptions  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pipeline", type=Path, required=True, help="full_size_pipeline.py's OUT (built if missing)"
    )
    parser.add_argument("--preset", choices=sorted(full_size_pipeline.PRESETS), default="full")
    parser.add_argument("--out", type=Path, required=True, help="the timing JSON (PLAN.json beside it)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--fixtures", default="generate-0ref,edit-1ref", help="comma list of fixture ids")
    parser.add_argument("--schemes", default="fp8,w8a8,w8a16")
    parser.add_argument("--target-db", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--image-blocks", type=int, default=4)
    parser.add_argument("--max-layers", type=int, default=256)
    args = parser.parse_args()

    started = time.monotonic()
    build = None
    if not args.pipeline.exists():
        build = full_size_pipeline.build(args.pipeline, args.preset, device=args.device)
    work = args.out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    chosen = args.fixtures.split(",")
    every = json.loads((args.pipeline / "fixtures" / "fixtures.json").read_text())
    missing = sorted(set(chosen) - set(every))
    if missing:
        parser.error(f"--fixtures: {missing} not in {args.pipeline / 'fixtures' / 'fixtures.json'}")
    fixtures = work / "fixtures.json"
    fixtures.write_text(json.dumps({f: every[f] for f in chosen}, indent=2) + "\n")

    said: list[dict[str, Any]] = []

    def say(line: str) -> None:
        said.append({"seconds": round(time.monotonic() - started, 1), "line": line})
        print(line, file=sys.stderr, flush=True)

    options = PlanOptions(
        model=args.pipeline,
        out=args.out.with_suffix(".PLAN.json"),
        fixtures=fixtures,
        refs=args.pipeline / "fixtures" / "refs",
        schemes=tuple(args.schemes.split(",")),
        target_db=args.target_db,
        seeds="1",
        proxy_seeds=1,
        proxy_steps=1,
        steps=args.steps,
        load=LoadOptions(device=args.device),
        work=work / "runs",
        max_rounds=1,
        max_layers=args.max_layers,
        image_blocks=args.image_blocks,
        command=("python", *sys.argv),
    )
    # the processor's video processor needs torchvision, which the CPU test environment does not have
    no_video = importlib.util.find_spec("torchvision") is None
    plan_started = time.monotonic()
    with full_size_pipeline.without_video_processor() if no_video else nullcontext():
        plan = make_plan(options, say)
    result = {
        "command": "python " + " ".join(sys.argv),
        "python": platform.python_version(),
        "build": build,
        "plan_seconds": round(time.monotonic() - plan_started, 1),
        "phases": said,
        "fixtures": chosen,
        "quantized_fraction": plan.quantized_fraction,
        "mix": {s: sum(1 for v in plan.layers.values() if v == s) for s in {*plan.layers.values()}},
        "verification": None if plan.verification is None else plan.verification.model_dump(),
        "calibration": None if plan.calibration is None else plan.calibration.model_dump(),
        "cost": None if plan.cost is None else plan.cost.model_dump(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("plan_seconds", "quantized_fraction", "mix", "cost")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
