"""ditq quantize vs llm-compressor's model_free_ptq on a synthetic Qwen-Image-2.1-width checkpoint.

Builds a diffusers directory whose transformer is ``QwenImage21Transformer2DModel`` at its default
widths with 4 blocks (about 1.0 B parameters, random BF16, 2 shards), then runs in separate
processes, one after the other on the same folder:

- ``ditq quantize SRC OUT --scheme w8a8`` (the boundary layers it keeps are recorded), and
- llm-compressor's ``model_free_ptq(SRC/transformer, OUT, scheme="W8A8", ignore=<the same layers, plus the
  1-D norm weights it would otherwise try to quantize>)`` in its own virtual environment
  (``--llmc-python``), so both quantize exactly the same tensors.

Each run is timed (wall clock) and its peak RSS read by ``/usr/bin/time``; afterwards the mean relative L2
error of every quantized weight against the source is computed the same way for both outputs.
Usage: python benchmarks/quantize_bench.py --llmc-python .venv-bench/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from result_names import result_path
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = result_path("quantize_bench", "cpu")
LLMC_SNIPPET = """
import json, sys
from llmcompressor import model_free_ptq
model_free_ptq(sys.argv[1], sys.argv[2], scheme="W8A8", ignore=json.loads(sys.argv[3]), device="cpu")
"""


def build_checkpoint(root: Path, layers: int, seed: int) -> dict[str, Any]:
    """Random BF16 weights (std 0.02) for QwenImage21Transformer2DModel at default widths, in 2 shards."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    with torch.device("meta"):
        model = QwenImage21Transformer2DModel(num_layers=layers)
    transformer = root / "transformer"
    transformer.mkdir(parents=True)
    model.save_config(str(transformer))
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(str(root / "scheduler"))
    index = {
        "_class_name": "DiffusionPipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    names = sorted(shapes)
    half = len(names) // 2
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for number, chunk in enumerate((names[:half], names[half:]), start=1):
        file_name = f"diffusion_pytorch_model-{number:05d}-of-00002.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=generator) * 0.02).to(torch.bfloat16) for n in chunk}
        save_file(tensors, str(transformer / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file_name))
        del tensors
    numels = {n: int(torch.Size(s).numel()) for n, s in shapes.items()}
    doc = {"metadata": {"total_size": 2 * sum(numels.values())}, "weight_map": weight_map}
    (transformer / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(doc, indent=2))
    return {
        "class": "QwenImage21Transformer2DModel",
        "num_layers": layers,
        "parameters": sum(numels.values()),
        "largest_tensor_bytes": 2 * max(numels.values()),
        "shards": 2,
        "dtype": "bfloat16",
    }


def non_linear_weights(source: Path) -> list[str]:
    """Module names whose ``.weight`` is not 2-D (RMSNorm scales): model_free_ptq must be told to skip them."""
    names: list[str] = []
    for path in sorted((source / "transformer").glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.endswith(".weight") and len(handle.get_slice(name).get_shape()) != 2:
                    names.append(name[: -len(".weight")])
    return sorted(names)


def timed(argv: list[str], scratch: Path) -> dict[str, Any]:
    """Run ``argv`` under /usr/bin/time: wall seconds, peak RSS, CPU seconds, and the load average around it.

    /usr/bin/time forks the command from its own small process, so the peak RSS is the command's alone
    (a child forked from this process would start out counting this process's pages).
    """
    report = scratch / "time.txt"
    load_before = os.getloadavg()
    start = time.perf_counter()
    run = subprocess.run(
        ["/usr/bin/time", "-o", str(report), "-f", "%M %U %S", *argv], capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(
            f"{shlex.join(argv)} failed ({run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}"
        )
    peak_kib, user, system = report.read_text().split()[-3:]
    return {
        "wall_s": round(wall, 2),
        "peak_rss_bytes": int(peak_kib) * 1024,
        "user_s": float(user),
        "sys_s": float(system),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def weight_errors(source: Path, output: Path) -> dict[str, float]:
    """Relative L2 of (int8 weight x float32 scale) vs the source BF16 weight, per quantized tensor."""

    def tensors(folder: Path) -> dict[str, Path]:
        where: dict[str, Path] = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as handle:
                where.update(dict.fromkeys(handle.keys(), path))
        return where

    out, src = tensors(output), tensors(source)
    errors: dict[str, float] = {}
    for name in sorted(n for n in out if n.endswith(".weight_scale")):
        prefix = name[: -len("_scale")]
        with safe_open(str(out[prefix]), "pt") as q, safe_open(str(out[name]), "pt") as s:
            weight = q.get_tensor(prefix).to(torch.float32) * s.get_tensor(name).to(torch.float32)
        with safe_open(str(src[prefix]), "pt") as handle:
            reference = handle.get_tensor(prefix).to(torch.float32)
        errors[prefix] = float((weight - reference).norm() / reference.norm())
    return errors


def summarize(errors: dict[str, float]) -> dict[str, Any]:
    values = list(errors.values())
    return {
        "quantized_tensors": len(values),
        "mean_rel_l2": sum(values) / len(values),
        "max_rel_l2": max(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llmc-python", type=Path, required=True, help="python of a venv with llmcompressor")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--workdir", type=Path, help="where to build the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        model = build_checkpoint(root / "src", args.layers, seed=0)
        print(f"built {model['parameters'] / 1e9:.3f} B parameters", flush=True)
        ditq_run = timed(
            [
                sys.executable,
                "-m",
                "ditq.cli",
                "quantize",
                str(root / "src"),
                str(root / "ditq-out"),
                "--scheme",
                "w8a8",
            ],
            root,
        )
        manifest = json.loads((root / "ditq-out" / "MANIFEST.json").read_text())
        ignore = sorted(manifest["components"]["transformer"]["ignored"]) + non_linear_weights(root / "src")
        print(f"ditq: {ditq_run}", flush=True)
        llmc_run = timed(
            [
                str(args.llmc_python),
                "-c",
                LLMC_SNIPPET,
                str(root / "src" / "transformer"),
                str(root / "llmc-out"),
                json.dumps(ignore),
            ],
            root,
        )
        print(f"llm-compressor: {llmc_run}", flush=True)
        ditq_run.update(
            summarize(weight_errors(root / "src" / "transformer", root / "ditq-out" / "transformer"))
        )
        llmc_run.update(summarize(weight_errors(root / "src" / "transformer", root / "llmc-out")))
    llmc_versions = subprocess.run(
        [
            str(args.llmc_python),
            "-c",
            "import importlib.metadata as m; print("
            "m.version('llmcompressor'), m.version('compressed-tensors'), m.version('torch'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    result = {
        "command": shlex.join(["python", "benchmarks/quantize_bench.py", *sys.argv[1:]]),
        "git_commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "note": "2-core machine shared with other work; see load averages",
        },
        "versions": {
            "torch": torch.__version__,
            "llmcompressor": llmc_versions[0],
            "llmcompressor_compressed_tensors": llmc_versions[1],
            "llmcompressor_torch": llmc_versions[2],
        },
        "model": model,
        "ignored_layers": ignore,
        "ditq": ditq_run,
        "llmcompressor": llmc_run,
        "ratios": {
            "speedup_wall": round(llmc_run["wall_s"] / ditq_run["wall_s"], 2),
            "peak_rss_fraction": round(ditq_run["peak_rss_bytes"] / llmc_run["peak_rss_bytes"], 3),
            "error_ratio": round(ditq_run["mean_rel_l2"] / llmc_run["mean_rel_l2"], 4),
        },
    }
    result["goals"] = {
        "speedup_wall >= 3": result["ratios"]["speedup_wall"] >= 3,
        "peak_rss_fraction <= 0.25": result["ratios"]["peak_rss_fraction"] <= 0.25,
        "error no worse": result["ratios"]["error_ratio"] <= 1.0,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"]), json.dumps(result["goals"]))


if __name__ == "__main__":
    main()
