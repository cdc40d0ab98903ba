"""`ditq plan` on the bundled demo model: the plan, its end-to-end check, what the search cost; optionally the sweep.

    python benchmarks/plan_demo.py --schemes fp8,w8a8 --out benchmarks/results/plan_demo_cpu_COMMIT.json \\
        [--calibrate gptq] [--low-rank R] [--sweep demo-plan-out [--sweep-seeds auto] [--sweep-standard parity]]

Runs ``ditq plan ditq/demo/model --schemes S --out PLAN.json`` (the demo's fixtures, seeds 2301-2304, 8 steps, the
parity target measured in process) and records its wall and CPU time, the machine's core count and load average
before and after (other work on the machine slows every step; the load average says how much there was), the
mix, the quantized share of the block Linears' parameters, the 4-bit share (layers, and parameters of the
planned Linears and of every Linear of the transformer), the planned Linears' stored bytes (``stored_bytes``, as
the artifact stores them), each fixture's verified PSNR against its floor and compare's decision, and how well
the proxy predicted the images. ``--calibrate`` and ``--low-rank`` are ``ditq plan``'s (and ``ditq quantize``'s):
how each 4-bit candidate is rounded while measured and in the artifact. The plan itself is written beside the JSON
(``<out stem>.PLAN.json``). With ``--sweep DIR``, ``ditq demo --out DIR --plan PLAN.json`` then runs the whole chain
over the planned candidate beside the uniform ones, and its verdict lines and the planned candidate's fit-to-serve
answer are recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from result_names import result_path

MODEL = "ditq/demo/model"  # relative to the repository root, so the plan names no machine path
# each fixture's parity decision as compare records it: candidate minus pair (dB), its interval, over n seeds
PARITY_FIELDS = ("decision", "difference_db", "low_db", "high_db", "floor_db", "n")


def _ditq(*args: str) -> list[str]:
    return [sys.executable, "-m", "ditq.cli", *args]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_plan(schemes: str, rounding: list[str], plan_path: Path) -> dict[str, object]:
    argv = _ditq("plan", MODEL, "--schemes", schemes, *rounding, "--out", str(plan_path))
    load_before, cpu_before = os.getloadavg(), _cpu_seconds()
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode not in (0, 1) or not plan_path.is_file():
        sys.exit(f"ditq plan failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {
        "command": shlex.join(["ditq", *argv[3:]]),
        "exit_code": done.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(_cpu_seconds() - cpu_before, 1),
        "goal_s": 300,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "progress": [line for line in done.stderr.splitlines() if line.startswith("plan: ")],
        "printed": done.stdout.splitlines(),
    }


def _linear_params() -> dict[str, tuple[int, int]]:
    """Every Linear of the demo's transformer: name -> (out, in)."""
    import torch
    from diffusers import AutoModel

    model = AutoModel.from_pretrained(MODEL, subfolder="transformer")
    return {
        n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }


def _four_bit(plan: dict) -> dict[str, object]:
    """How much of the transformer the plan puts in 4 bits, and the planned Linears' stored bytes."""
    from ditq.checkpoint.stored import stored_bytes
    from ditq.schemes import get_scheme

    shapes = _linear_params()
    params = {name: out * inp for name, (out, inp) in shapes.items()}
    four = [
        name
        for name, choice in plan["layers"].items()
        if choice != "keep" and get_scheme(choice).num_bits == 4
    ]
    planned = sum(params[name] for name in plan["layers"])
    rank = plan.get("rounding", {}).get("low_rank") or 0

    def stored(name: str, choice: str) -> int:
        out, inp = shapes[name]
        return (
            2 * out * inp  # the demo's weights are bfloat16
            if choice == "keep"
            else stored_bytes(get_scheme(choice).fitted(inp), out, inp, rank)
        )

    return {
        "layers": len(four),
        "of_layers": len(plan["layers"]),
        "fraction_of_planned_linear_params": round(sum(params[n] for n in four) / planned, 4),
        "fraction_of_transformer_linear_params": round(
            sum(params[n] for n in four) / sum(params.values()), 4
        ),
        "transformer_linears": len(shapes),
        "goal_fraction": 0.6,
        "planned_linear_bytes": {
            "plan": sum(stored(name, choice) for name, choice in plan["layers"].items()),
            "fp8": sum(stored(name, "fp8") for name in plan["layers"]),
            "source_bfloat16": sum(2 * params[name] for name in plan["layers"]),
        },
    }


def _summary(plan: dict) -> dict[str, object]:
    verification = plan["verification"]
    floors = plan["target"]["per_fixture_db"]
    return {
        "mix": dict(Counter(plan["layers"].values())),
        "rounding": plan.get("rounding", {"method": "rtn"}),
        "quantized_fraction": plan["quantized_fraction"],
        "goal_quantized_fraction": 0.9,
        "four_bit": _four_bit(plan),
        "per_fixture": {
            fixture: {
                "psnr_db": db,
                "floor_db": floors[fixture],
                "above_floor_db": round(db - floors[fixture], 2),
                "decision": verification["decisions"].get(fixture),
            }
            for fixture, db in verification["psnr_db"].items()
        },
        "meets_target": verification["meets_target"],
        "rounds": verification["rounds"],
        "calibration": plan["calibration"],
        "cost": plan["cost"],
    }


def _run_sweep(out: Path, plan_path: Path, seeds: str | None, standard: str | None) -> dict[str, object]:
    argv = _ditq("demo", "--out", str(out), "--plan", str(plan_path), "--no-progress")
    if standard is not None:
        argv += ["--standard", standard]
    if seeds is not None:
        argv += ["--seeds", seeds]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.monotonic() - started
    verdict_path = out / "report" / "verdict.json"
    planned = None
    if verdict_path.is_file():
        document = json.loads(verdict_path.read_text())
        entry = next((c for c in document["candidates"] if c["name"] == "plan"), None)
        if entry is not None:
            fit = entry["objectives"]["fit_to_serve"]
            planned = {"fit_to_serve": fit["answer"], "reasons": [r["message"] for r in fit["reasons"]]}
    compared = out / "plan" / "run" / "compare.json"  # the planned candidate's, against the baseline
    parity = None
    if compared.is_file():
        fixtures = json.loads(compared.read_text())["fixtures"]
        parity = {
            fixture: {"psnr_db": entry["psnr_db"]["mean"]}
            | {key: (entry.get("parity") or {}).get(key) for key in PARITY_FIELDS}
            for fixture, entry in fixtures.items()
        }
    return {
        "planned_candidate_parity": parity,
        # the folder as a placeholder: the result names no machine path
        "command": shlex.join(["ditq", *argv[3:]]).replace(str(out), "<sweep dir>"),
        "exit_code": done.returncode,
        "wall_s": round(wall, 1),
        "verdicts": [
            line for line in done.stdout.splitlines() if re.match(r"^\S+: (YES|NO|UNDECIDED) \(", line)
        ],
        "planned_candidate": planned,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="fp8,w8a8", help="ditq plan --schemes (default fp8,w8a8)")
    parser.add_argument("--calibrate", choices=("rtn", "gptq"), help="ditq plan --calibrate (default: rtn)")
    parser.add_argument("--low-rank", type=int, metavar="R", help="ditq plan --low-rank")
    parser.add_argument("--out", type=Path, default=result_path("plan_demo", "cpu"))
    parser.add_argument("--sweep", type=Path, help="also run `ditq demo --plan` into this folder")
    parser.add_argument(
        "--sweep-seeds", help="the sweep's --seeds (default: the demo's; auto: settle undecided fixtures)"
    )
    parser.add_argument(
        "--sweep-standard",
        choices=("lossless", "parity"),
        help="the sweep's --standard, which its fit-to-serve answers use (default: the demo's)",
    )
    args = parser.parse_args()
    argv = [*sys.argv[1:]]
    if args.sweep is not None:  # the folder as a placeholder: the result names no machine path
        argv = [a.replace(str(args.sweep), "<sweep dir>") for a in argv]
    os.chdir(Path(__file__).resolve().parents[1])
    plan_path = args.out.with_name(f"{args.out.stem}.PLAN.json")
    payload: dict[str, object] = {
        "what": "ditq plan on the bundled demo model (CPU), then its plan checked end to end",
        "script": shlex.join(["python", "benchmarks/plan_demo.py", *argv]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    rounding = ["--calibrate", args.calibrate] if args.calibrate else []
    rounding += ["--low-rank", str(args.low_rank)] if args.low_rank else []
    payload["plan"] = _run_plan(args.schemes, rounding, plan_path)
    payload["result"] = _summary(json.loads(plan_path.read_text()))
    if args.sweep is not None:
        if args.sweep.exists():
            shutil.rmtree(args.sweep)
        payload["sweep"] = _run_sweep(args.sweep, plan_path, args.sweep_seeds, args.sweep_standard)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(payload["result"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
