"""Forward error of llm-compressor's checkpoints (tests/data/llmc) as ditq loads them, against their BF16 source.

    python benchmarks/llmc_forward_error.py --out benchmarks/results/llmc_forward_error_cpu_COMMIT.json

The tiny demo transformer in W8A8, FP8_DYNAMIC and W8A16 (groups of 16), loaded in float32 through
ditq.load_component, run on the same seeded input as tests/test_interop_llmc.py; relative L2 of the output
against the BF16 source's. The test asserts < 0.05; this records the values.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from result_names import result_path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=result_path("llmc_forward_error", "cpu"))
    args = parser.parse_args()
    sys.path.insert(0, str(TESTS))
    from test_interop_llmc import _forward
    from tiny_models import LLMC_SCHEMES, llmc_pipeline_dir

    from ditq.runtime.loader import load_component

    with tempfile.TemporaryDirectory() as tmp:
        source = llmc_pipeline_dir(Path(tmp) / "source", "source")
        reference = _forward(load_component(source, "transformer", dtype=torch.float32))
        errors = {}
        for fixture in LLMC_SCHEMES:
            model = load_component(
                llmc_pipeline_dir(Path(tmp) / fixture, fixture), "transformer", dtype=torch.float32
            )
            got = _forward(model)
            errors[fixture] = round(
                float(torch.linalg.vector_norm(got - reference) / torch.linalg.vector_norm(reference)), 5
            )
    payload = {"command": f"python benchmarks/llmc_forward_error.py --out {args.out}", "relative_l2": errors}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
