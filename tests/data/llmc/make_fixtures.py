"""Make the llm-compressor checkpoints the interop tests read: ``model_free_ptq`` in W8A8, FP8_DYNAMIC and W8A16
over the BF16 transformer of ditq's tiny demo pipeline (seed 0).

Writes, beside this script:

- ``source/transformer/``: the BF16 transformer (``config.json`` + ``diffusion_pytorch_model.safetensors``);
- ``<scheme>/transformer/`` for w8a8, fp8_dynamic and w8a16 (its preset with groups of 16 inputs, the tiny
  model's Linears being narrower than the preset's 128): what ``model_free_ptq`` wrote for it, unchanged
  (its ``config.json`` with the flat ``quantization_config``, and its safetensors);
- ``PROVENANCE.json``: the versions and the ignore list used.

Blocks only, as ditq quantizes them: every module outside ``transformer_blocks`` is ignored by a regex, and
the RMSNorm scales inside the blocks (1-D weights, which model_free_ptq would otherwise try to quantize) by
name. llm-compressor runs in its own environment (``--llmc-python``); nothing is downloaded.

Usage: python tests/data/llmc/make_fixtures.py --llmc-python LLMC_VENV/bin/python
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
SCHEMES = {"w8a8": "W8A8", "fp8_dynamic": "FP8_DYNAMIC", "w8a16": "W8A16"}
# W8A16's preset scales groups of 128 inputs; the tiny model's Linears are 32 or 64 wide, so its groups are 16
GROUP_SIZES = {"w8a16": 16}
LLMC_SNIPPET = """
import json, sys
from compressed_tensors.quantization import preset_name_to_scheme
from llmcompressor import model_free_ptq
scheme = preset_name_to_scheme(sys.argv[3], ["Linear"])
if int(sys.argv[5]):
    scheme.weights.group_size = int(sys.argv[5])
model_free_ptq(sys.argv[1], sys.argv[2], scheme=scheme, ignore=json.loads(sys.argv[4]), device="cpu")
"""
VERSIONS_SNIPPET = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({p: m.version(p) for p in ('llmcompressor', 'compressed-tensors', 'torch')}))"
)


def non_linear_weights(transformer: Path) -> list[str]:
    """Module names whose ``.weight`` is not 2-D (RMSNorm scales)."""
    names: list[str] = []
    for path in sorted(transformer.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.endswith(".weight") and len(handle.get_slice(name).get_shape()) != 2:
                    names.append(name[: -len(".weight")])
    return sorted(names)


def add_index(transformer: Path) -> None:
    """``diffusion_pytorch_model.safetensors.index.json`` naming the one weight file for every tensor."""
    weights = transformer / "diffusion_pytorch_model.safetensors"
    with safe_open(str(weights), "pt") as handle:
        weight_map = dict.fromkeys(handle.keys(), weights.name)
    index = {"metadata": {"total_size": weights.stat().st_size}, "weight_map": weight_map}
    (transformer / f"{weights.name}.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llmc-python", type=Path, required=True, help="python of a venv with llmcompressor")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parents[2]))
    from ditq.demo import build_tiny_pipeline

    with tempfile.TemporaryDirectory() as scratch:
        pipeline_dir = Path(scratch) / "pipeline"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_tiny_pipeline(seed=0).to(torch.bfloat16).save_pretrained(pipeline_dir)
        source = pipeline_dir / "transformer"
        ignore = ["re:^(?!transformer_blocks\\.).*", *non_linear_weights(source)]
        shutil.rmtree(HERE / "source", ignore_errors=True)
        shutil.copytree(source, HERE / "source" / "transformer")
        add_index(
            source
        )  # model_free_ptq finds a single file only as model.safetensors, else through an index
        for name, preset in SCHEMES.items():
            out = Path(scratch) / name
            argv = [
                str(args.llmc_python),
                "-c",
                LLMC_SNIPPET,
                str(source),
                str(out),
                preset,
                json.dumps(ignore),
                str(GROUP_SIZES.get(name, 0)),
            ]
            subprocess.run(argv, check=True)
            shutil.rmtree(HERE / name, ignore_errors=True)
            (HERE / name).mkdir()
            shutil.copytree(out, HERE / name / "transformer")
    versions = json.loads(
        subprocess.run(
            [str(args.llmc_python), "-c", VERSIONS_SNIPPET], check=True, capture_output=True, text=True
        ).stdout
    )
    provenance = {
        "made_by": "tests/data/llmc/make_fixtures.py",
        "source": "ditq.demo.build_tiny_pipeline(seed=0).transformer in bfloat16",
        "schemes": SCHEMES,
        "group_sizes": GROUP_SIZES,
        "ignore": ignore,
        "versions": versions,
    }
    (HERE / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2) + "\n")


if __name__ == "__main__":
    main()
