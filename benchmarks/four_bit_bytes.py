"""Stored bytes of the full-size Qwen-Image-2.1 transformer and text encoder per scheme: BF16, fp8, w8a8, w4a16, w4a8.

    python benchmarks/four_bit_bytes.py --out benchmarks/results/four_bit_bytes_cpu_COMMIT.json

Each component is built on the meta device at its full size (``tools/full_size_pipeline.py``'s preset: the
transformer at diffusers' defaults, the text encoder at Qwen3-VL-8B-Instruct's sizes), its Linears decided as
``ditq quantize --components auto`` decides them (``ditq.quantization.targets.plan_targets``), and every tensor
counted as the artifact stores it: a quantized Linear by its scheme's stored tensors (``stored_bytes``, the
scheme fitted to the layer: 4-bit groups of 128, per channel where 128 does not divide the layer's in_features),
the 4-bit schemes' token embedding by its ``Scheme.embedding`` (int8 rows, ``w8a16``'s codec), everything else in
BF16, itemised by kind in ``kept_bf16_bytes`` (the embedding, each reason the planner keeps a Linear for with the
module names, biases, norms...). No weights, no device: the bytes follow from the shapes alone (the on-GPU footprint is the
same, but for the 4-bit paths' repack, which keeps 4 bits: ``ditq.kernels.w4_triton``). Goal (issue 46): transformer
+ text encoder in w4a8 at most 0.55x their fp8 bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

SCHEMES = ("fp8", "w8a8", "w4a16", "w4a8")
GOAL = 0.55


def _pattern(prefix: str) -> str:
    """A module name with its block indices as N (``model.language_model.layers.N.mlp.up_proj``)."""
    return re.sub(r"\.\d+(?=\.|$)", ".N", prefix)


def kept_breakdown(
    model: torch.nn.Module, plan: Any, sizes: dict[str, int], heads: set[str]
) -> dict[str, dict[str, int]]:
    """The BF16 bytes a scheme keeps, by kind: the token embedding, the Linears the planner keeps (by its reason,
    then by module name with block indices as N), the quantized Linears' biases, the unused output head, and every
    other module by its class (norms, other embeddings...)."""
    from ditq.quantization.targets import token_embedding

    found = token_embedding(model, {name: tuple(t.shape) for name, t in model.state_dict().items()})
    embedding = None if found is None else found[0]
    kinds: dict[str, dict[str, int]] = {}
    for name, size in sizes.items():
        prefix, _, local = name.rpartition(".")
        if prefix in plan.targets and local == "weight":
            continue
        if prefix in heads:
            kind, detail = "output head (declared unused: not loaded)", prefix
        elif prefix == embedding:
            kind, detail = "token embedding", f"{prefix}: {plan.ignored.get(prefix, 'kept')}"
        elif prefix in plan.targets:
            kind, detail = "biases of quantized Linears", _pattern(prefix)
        elif isinstance(model.get_submodule(prefix), torch.nn.Linear):
            kind, detail = f"Linear kept: {plan.ignored[prefix]}", _pattern(prefix)
        else:
            kind, detail = f"not a Linear: {type(model.get_submodule(prefix)).__name__}", _pattern(prefix)
        bucket = kinds.setdefault(kind, {})
        bucket[detail] = bucket.get(detail, 0) + size
    ordered = sorted(kinds.items(), key=lambda item: -sum(item[1].values()))
    return {kind: dict(sorted(d.items(), key=lambda i: -i[1])) for kind, d in ordered}


def component_bytes(model: torch.nn.Module, component: str) -> dict[str, Any]:
    """BF16 and each scheme's bytes of one component, as stored and as loaded (less the output head the quantizer
    declares unused where the pipeline reads no logits: ``ditq.runtime.unused``), and what each keeps in BF16."""
    from diffusers import QwenImage21Pipeline

    from ditq.checkpoint.stored import stored_bytes
    from ditq.quantization.targets import output_heads, plan_targets, reads_logits
    from ditq.schemes import get_scheme

    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    sizes = {name: t.numel() * t.element_size() for name, t in model.state_dict().items()}
    # the 8-bit schemes keep the token embedding; the 4-bit ones store it as Scheme.embedding says
    plans = {
        embeddings: plan_targets(model, component, shapes, embeddings=embeddings)
        for embeddings in (False, True)
    }
    bf16 = sum(sizes.values())
    heads = {} if reads_logits(QwenImage21Pipeline) else output_heads(model)
    out: dict[str, Any] = {"bf16": bf16}
    kept: dict[str, Any] = {}
    for name in SCHEMES:
        scheme = get_scheme(name)
        plan = plans[scheme.embedding is not None]
        stored = 0
        for prefix, layer_scheme in plan.uniform(scheme).items():
            layer = plan.targets[prefix]
            stored += stored_bytes(layer_scheme, layer.out_features, layer.in_features)
        out[name] = bf16 - sum(sizes[f"{prefix}.weight"] for prefix in plan.targets) + stored
        out.setdefault("targets", {})[name] = len(plan.targets)
        out.setdefault("kept", {})[name] = len(plan.ignored)
        out.setdefault("quantized_embeddings", {})[name] = sorted(plan.embeddings)
        kept[name] = kept_breakdown(model, plan, sizes, set(heads))
    unused = sum(
        sizes[f"{head}.weight"] for head in heads
    )  # kept in BF16 (not a target): the same in every scheme
    out["unused_output_heads"] = {"modules": sorted(heads), "bytes": unused}
    out["loaded"] = {name: out[name] - unused for name in ("bf16", *SCHEMES)}
    out["kept_bf16_bytes"] = kept
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
    for component, counted in components.items():
        for scheme in ("fp8", "w4a8"):
            print(f"{component} {scheme}: kept in BF16")
            for kind, details in counted["kept_bf16_bytes"][scheme].items():
                top = ", ".join(f"{d} {b / 1e9:.3f}" for d, b in list(details.items())[:3])
                print(f"  {sum(details.values()) / 1e9:7.3f} GB  {kind}  ({top})")
    for name, value in loaded.items():
        print(f"{name:6s} {value / 1e9:8.3f} GB loaded  x fp8 {ratios[name]:.4f}")
    print(f"goal: w4a8 at most {GOAL}x fp8 loaded: {'met' if ratios['w4a8'] <= GOAL else 'not met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
