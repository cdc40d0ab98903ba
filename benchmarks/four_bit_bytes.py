"""Stored bytes of the full-size Qwen-Image-2.1 transformer and text encoder per scheme: BF16, fp8, w8a8, w4a16, w4a8.

    python benchmarks/four_bit_bytes.py --out benchmarks/results/four_bit_bytes_cpu_COMMIT.json

Each component is built on the meta device at its full size (``tools/full_size_pipeline.py``'s preset: the
transformer at diffusers' defaults, the text encoder at Qwen3-VL-8B-Instruct's sizes), its Linears decided as
``ditq quantize --components auto`` decides them (``ditq.quantization.targets.plan_targets``), and every tensor
counted as the artifact stores it: a quantized Linear by its scheme's stored tensors (``stored_bytes``, the
scheme fitted to the layer: 4-bit groups of 128, per channel where 128 does not divide the layer's in_features),
everything else in BF16. No weights, no device: the bytes follow from the shapes alone (the on-GPU footprint is the
same, but for the 4-bit paths' repack, which keeps 4 bits: ``ditq.kernels.w4_triton``). Goal (issue 46): transformer
+ text encoder in w4a8 at most 0.55x their fp8 bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

SCHEMES = ("fp8", "w8a8", "w4a16", "w4a8")
GOAL = 0.55


def component_bytes(model: torch.nn.Module, component: str) -> dict[str, Any]:
    """BF16 and each scheme's bytes of one component, as stored and as loaded (less the output head the quantizer
    declares unused where the pipeline reads no logits: ``ditq.runtime.unused``)."""
    from diffusers import QwenImage21Pipeline

    from ditq.checkpoint.stored import stored_bytes
    from ditq.quantization.targets import output_heads, plan_targets, reads_logits
    from ditq.schemes import get_scheme

    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    sizes = {name: t.numel() * t.element_size() for name, t in model.state_dict().items()}
    plan = plan_targets(model, component, shapes)
    bf16 = sum(sizes.values())
    out: dict[str, Any] = {"bf16": bf16, "targets": len(plan.targets), "kept": len(plan.ignored)}
    target_weights = sum(sizes[f"{prefix}.weight"] for prefix in plan.targets)
    for name in SCHEMES:
        stored = 0
        for prefix, scheme in plan.uniform(get_scheme(name)).items():
            layer = plan.targets[prefix]
            stored += stored_bytes(scheme, layer.out_features, layer.in_features)
        out[name] = bf16 - target_weights + stored
    heads = {} if reads_logits(QwenImage21Pipeline) else output_heads(model)
    unused = sum(
        sizes[f"{head}.weight"] for head in heads
    )  # kept in BF16 (not a target): the same in every scheme
    out["unused_output_heads"] = {"modules": sorted(heads), "bytes": unused}
    out["loaded"] = {name: out[name] - unused for name in ("bf16", *SCHEMES)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import full_size_pipeline as fsp

    preset = fsp.PRESETS["full"]
    config = fsp.text_encoder_config(preset, fsp.build_tokenizer())
    components: dict[str, Any] = {}
    for name, build in (("transformer", lambda: fsp.build_transformer(preset)),
                        ("text_encoder", lambda: fsp.build_text_encoder(config))):  # fmt: skip
        with torch.device("meta"):
            model = build()
        components[name] = component_bytes(model, name)
    both = {key: sum(c[key] for c in components.values()) for key in ("bf16", *SCHEMES)}
    loaded = {key: sum(c["loaded"][key] for c in components.values()) for key in ("bf16", *SCHEMES)}
    ratios = {name: round(loaded[name] / loaded["fp8"], 4) for name in ("bf16", *SCHEMES)}
    transformer = components["transformer"]
    result = {
        "command": "python " + " ".join(sys.argv),
        "bytes": {**components, "transformer+text_encoder": both, "transformer+text_encoder_loaded": loaded},
        "ratio_to_fp8_loaded": ratios,
        "ratio_to_fp8_stored": {name: round(both[name] / both["fp8"], 4) for name in ("bf16", *SCHEMES)},
        "ratio_to_fp8_transformer": {
            name: round(transformer[name] / transformer["fp8"], 4) for name in SCHEMES
        },
        "goal": {"w4a8_loaded_ratio_to_fp8_max": GOAL, "met": ratios["w4a8"] <= GOAL},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, value in loaded.items():
        print(f"{name:6s} {value / 2**30:8.2f} GiB loaded  x fp8 {ratios[name]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
