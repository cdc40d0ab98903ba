"""Per-layer SQNR of ditq's 4-bit roundings at the full-size geometry of Qwen-Image-2.1's transformer: round to
nearest, GPTQ, and GPTQ + SVDQuant's low-rank branch (R = 16, 32), int4 in groups of 128 and per output channel.

    python benchmarks/four_bit_sqnr_full_size.py --out benchmarks/results/h100-four-bit/four_bit_sqnr_full_size_cpu_COMMIT.json

The model: ``QwenImage21Transformer2DModel`` at the ``full`` preset of ``tools/full_size_pipeline.py`` (diffusers'
default config: hidden 4096, 32 heads of 128, MLP 12288) but with ``--num-layers 2`` blocks instead of 32 (every
block Linear keeps its full-size shape), diffusers' default random init after ``torch.manual_seed(--model-seed)``,
the weights rounded to bfloat16 as the pipeline stores them, the forwards in float32 on the CPU. Not trained weights:
the figures describe the quantizers at this geometry on these activations, not a trained model's outliers.

Inputs (``forward_inputs``): one image of ``--image-side`` pixels (16 per latent token: 512 -> 32 x 32 = 1024 target
tokens) after ``--text-tokens`` text tokens, every value standard normal (latents of ``in_channels``, text embeddings
of ``context_in_dim``) from a seeded generator. Calibration: ``--calibration-forwards`` such forwards drawn in turn
from ``--calibration-seed``, at timesteps evenly spaced from 1 to 1/C; the layers' input Hessians gathered by ditq's
own ``hessian_hooks``. Held out: one forward drawn from ``--held-out-seed`` at timestep 0.5, each layer's inputs kept.

The targets are ditq's own (``plan_targets``: the blocks' Linears; the shared modulation, the embedders and the
output projection stay in source precision) in ``--blocks``. Each is rounded as ditq ships it: to nearest
(``ditq.numerics.quantize_weight``, w4a16's scheme with the group size) and by GPTQ (``gptq_quantize`` with
``Calibration``'s damp and column order, as ``calibrated._encode`` calls it), each alone and on the residual of
``split_low_rank``'s branch of each rank (dequantized residual + up @ down, as ``_encode`` reconstructs it). GPTQ
rounds every row against the same Hessian independently of the other rows, so a layer's weight and its residuals go
through one call (one Hessian inversion instead of three; the test checks it gives what separate calls give). The rank-R branch is the
first R of the largest rank's (one SVD; the test checks it equals ``split_low_rank(W, R)``).

Per layer and rounding, two SQNRs (dB, higher is better), as ``low_rank_fidelity.py`` defines them: the weight's,
10 log10(|W|^2 / |W - W_q|^2), and the output's on the held-out inputs X, 10 log10(sum |X W^T|^2 / sum |X (W - W_q)^T|^2);
per layer the gain of GPTQ over round to nearest and of each branch over the same rounding without it (output SQNR
differences); the calibration Hessian's effective rank, (tr H)^2 / |H|_F^2, which says how much room GPTQ has;
per Linear kind (``attn.to_q``, ``img_mlp.out``...) the median and range over the blocks. The peak resident memory is
recorded too: GPTQ's float64 inversion of img_mlp.out's 12288 x 12288 Hessian dominates it.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from four_bit_fidelity import sqnr_db
from result_names import RESULTS, commit, shown_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from ditq.numerics import dequantize_weight, quantize_weight
from ditq.quantization.calibrated import Calibration
from ditq.quantization.gptq import gptq_quantize, hessian_hooks
from ditq.quantization.low_rank import LowRankSplit, split_low_rank
from ditq.schemes import CHANNEL, GroupSize, Scheme, get_scheme, parse_group_size

BENCH = "four_bit_sqnr_full_size"
SCHEME = "w4a16"  # int4 weights; w4a8 rounds its weights the same way
PIXELS_PER_TOKEN = 16  # QwenImage21Pipeline's vae_scale_factor; latents go in unpatched (patch_size 1)
TOKENS_PER_SLOT = 4  # one img_mask slot stands for 2 x 2 latent tokens
HELD_OUT_TIMESTEP = 0.5
SHIPPED = Calibration(run=lambda: None)  # ditq's calibration as shipped: its damp and column order


@dataclass(frozen=True)
class SqnrOptions:
    """What one run measures; checked once here."""

    preset: str = "full"  # tools/full_size_pipeline.py's PRESETS: the transformer's config
    num_layers: int = 2
    blocks: tuple[int, ...] = (0, 1)
    group_sizes: tuple[GroupSize, ...] = (128, CHANNEL)
    ranks: tuple[int, ...] = (16, 32)
    image_side: int = 512
    text_tokens: int = 64
    calibration_forwards: int = 12
    model_seed: int = 0
    calibration_seed: int = 0
    held_out_seed: int = 1

    def __post_init__(self) -> None:
        if not self.blocks or not all(0 <= b < self.num_layers for b in self.blocks):
            raise ValueError(f"--blocks {list(self.blocks)}: each must be in 0..{self.num_layers - 1}")
        if self.image_side % (2 * PIXELS_PER_TOKEN):
            raise ValueError(f"--image-side {self.image_side} is not a multiple of {2 * PIXELS_PER_TOKEN}")
        if any(r < 1 for r in self.ranks) or self.text_tokens < 1 or self.calibration_forwards < 1:
            raise ValueError("--ranks, --text-tokens and --calibration-forwards must be positive")

    @property
    def image_tokens(self) -> int:
        return (self.image_side // PIXELS_PER_TOKEN) ** 2


def effective_rank(hessian: torch.Tensor) -> float:
    """(tr H)^2 / |H|_F^2 of an input Hessian (K, K): how many input directions carry the inputs' energy (K for
    white inputs, 1 for a single direction); GPTQ gains most where it is small."""
    return round(float(hessian.trace()) ** 2 / float(torch.linalg.vector_norm(hessian)) ** 2, 1)


# ---- the model and its inputs -------------------------------------------------------------------------------


def build_transformer(options: SqnrOptions) -> Any:  # a diffusers ModelMixin
    """The preset's transformer with ``num_layers`` blocks, diffusers' init, weights rounded to bfloat16, float32."""
    from diffusers import QwenImage21Transformer2DModel
    from full_size_pipeline import PRESETS

    config = {**PRESETS[options.preset].transformer, "num_layers": options.num_layers}
    torch.manual_seed(options.model_seed)
    model = QwenImage21Transformer2DModel.from_config(config)
    return torch.nn.Module.to(torch.nn.Module.to(model, torch.bfloat16), torch.float32).eval()


def forward_inputs(
    model: Any, options: SqnrOptions, generator: torch.Generator, timestep: float
) -> dict[str, Any]:
    """One text-to-image forward's keyword arguments: ``text_tokens`` then one square image, standard normal."""
    side = options.image_side // PIXELS_PER_TOKEN
    config = model.config
    slots = [False] * options.text_tokens + [True] * (side * side // TOKENS_PER_SLOT)
    return dict(
        hidden_states=torch.randn(1, side * side, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(1, options.text_tokens, config.context_in_dim, generator=generator),
        timestep=torch.tensor([timestep]),
        img_shapes=[[(1, side, side)]],
        img_mask=torch.tensor([slots]),
        return_dict=False,
    )


def calibration_timesteps(forwards: int) -> list[float]:
    return [1 - i / forwards for i in range(forwards)]  # 1, ..., 1/C


def block_targets(model: torch.nn.Module, blocks: tuple[int, ...]) -> dict[str, torch.nn.Linear]:
    """ditq's targets (``plan_targets``) in the chosen blocks: name -> Linear."""
    from ditq.quantization.targets import linear_at, plan_targets

    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    plan = plan_targets(model, "transformer", shapes)
    chosen = tuple(f"transformer_blocks.{b}." for b in blocks)
    return {name: linear_at(model, name) for name in plan.targets if name.startswith(chosen)}


@contextmanager
def kept_inputs(layers: Mapping[str, torch.nn.Module]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Within the block, every call of each layer keeps its input rows (rows, K), float32."""
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in layers}

    def hook(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
        return lambda _, args: kept[name].append(
            args[0].detach().reshape(-1, args[0].shape[-1]).float().clone()
        )

    handles = [layer.register_forward_pre_hook(hook(name)) for name, layer in layers.items()]
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture(
    model: Any, names: list[str], options: SqnrOptions, seconds: dict[str, float]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(Hessians from the calibration forwards, held-out inputs (rows, K)), name -> tensor."""
    begun = time.time()
    generator = torch.Generator().manual_seed(options.calibration_seed)
    with hessian_hooks(model, names) as found:
        for timestep in calibration_timesteps(options.calibration_forwards):
            model(**forward_inputs(model, options, generator, timestep))
    hessians = {name: found[name].hessian for name in names}
    seconds["calibration"] = round(time.time() - begun, 1)
    begun = time.time()
    generator = torch.Generator().manual_seed(options.held_out_seed)
    with kept_inputs({name: model.get_submodule(name) for name in names}) as kept:
        model(**forward_inputs(model, options, generator, HELD_OUT_TIMESTEP))
    seconds["held_out"] = round(time.time() - begun, 1)
    return hessians, {name: torch.cat(rows) for name, rows in kept.items()}


# ---- the roundings ------------------------------------------------------------------------------------------


def low_rank_branches(weight: torch.Tensor, ranks: tuple[int, ...]) -> dict[int, LowRankSplit]:
    """``split_low_rank(weight, R)`` for each R, from one SVD: the largest rank's, its first R kept."""
    if not ranks:
        return {}
    widest = split_low_rank(weight, max(ranks))
    branches = {}
    for rank in ranks:
        up, down = widest.up[:, :rank].contiguous(), widest.down[:rank].contiguous()
        residual = weight.float() - up.float() @ down.float()
        branches[rank] = LowRankSplit(up, down, residual)
    return branches


def gptq_rows(values: list[torch.Tensor], hessian: torch.Tensor, scheme: Scheme) -> list[torch.Tensor]:
    """Each weight (N, K) of ``values`` GPTQ-rounded and dequantized, all in one ``gptq_quantize`` call."""
    q, scale = gptq_quantize(
        torch.cat(values),
        hessian,
        bits=scheme.num_bits,
        group_size=scheme.group_size,
        damp=SHIPPED.damp,
        act_order=SHIPPED.act_order,
    )
    return list(dequantize_weight(q, scale).split([v.shape[0] for v in values]))


def roundings(
    weight: torch.Tensor, hessian: torch.Tensor, scheme: Scheme, branches: Mapping[int, LowRankSplit]
) -> dict[str, torch.Tensor]:
    """Rounding name -> the weight as it computes (float32 (N, K)): rtn, gptq, and each with each branch."""
    residuals = [weight, *(split.residual for split in branches.values())]
    names = ["", *(f"-lr{rank}" for rank in branches)]
    calibrated = gptq_rows(residuals, hessian, scheme)  # first: less held beside its peak
    nearest = [dequantize_weight(*quantize_weight(values, scheme)) for values in residuals]
    found = {}
    for rounding, decoded in (("rtn", nearest), ("gptq", calibrated)):
        for name, values, split in zip(names, decoded, (None, *branches.values()), strict=True):
            found[rounding + name] = (
                values if split is None else values + split.up.float() @ split.down.float()
            )
    return found


def measure_layer(
    weight: torch.Tensor, hessian: torch.Tensor, inputs: torch.Tensor, options: SqnrOptions
) -> dict[str, Any]:
    """One layer's weight and held-out output SQNR per group size and rounding, and the gains between them."""
    weight = weight.float()
    branches = low_rank_branches(weight, options.ranks)
    signal_w = float(weight.double().square().sum())
    signal_out = float((inputs @ weight.T).double().square().sum())
    found: dict[str, Any] = {
        "shape": list(weight.shape),
        "calibration_effective_rank": effective_rank(hessian),
        "held_out_rows": inputs.shape[0],
    }
    for group_size in options.group_sizes:
        scheme = get_scheme(SCHEME, group_size).fitted(weight.shape[1])
        rows = {}
        for name, decoded in roundings(weight, hessian, scheme, branches).items():
            error = weight - decoded
            rows[name] = {
                "weight_sqnr_db": sqnr_db(signal_w, float(error.double().square().sum())),
                "output_sqnr_db": sqnr_db(signal_out, float((inputs @ error.T).double().square().sum())),
            }
        found[str(group_size)] = {"group_size": scheme.group_size, "rows": rows, "gains_db": gains(rows)}
    return found


def gains(rows: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Output SQNR differences: GPTQ over round to nearest, and each branch over its rounding without it."""
    found = {"gptq_over_rtn": round(rows["gptq"]["output_sqnr_db"] - rows["rtn"]["output_sqnr_db"], 2)}
    for name, row in rows.items():
        if "-lr" in name:
            base = name.split("-lr")[0]
            found[f"{name}_over_{base}"] = round(row["output_sqnr_db"] - rows[base]["output_sqnr_db"], 2)
    return found


# ---- the run ------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}


def by_kind(layers: Mapping[str, Mapping[str, Any]], group_key: str) -> dict[str, dict[str, Any]]:
    """Per Linear kind (the name after ``transformer_blocks.N.``) and over ``all`` layers: the median and range of
    each rounding's SQNRs and of each gain."""
    kinds: dict[str, list[Mapping[str, Any]]] = {}
    for name, layer in layers.items():
        kinds.setdefault(name.split(".", 2)[2], []).append(layer)
    kinds["all"] = list(layers.values())
    table = {}
    for kind, found in kinds.items():
        entries = [layer[group_key] for layer in found]
        rows, gain_names = entries[0]["rows"], entries[0]["gains_db"]
        table[kind] = {
            "layers": len(entries),
            "calibration_effective_rank": spread([layer["calibration_effective_rank"] for layer in found]),
            **{
                metric: {r: spread([e["rows"][r][metric] for e in entries]) for r in rows}
                for metric in ("output_sqnr_db", "weight_sqnr_db")
            },
            "gains_db": {g: spread([e["gains_db"][g] for e in entries]) for g in gain_names},
        }
    return table


def print_table(summary: Mapping[str, Mapping[str, Any]]) -> None:
    for group_key, table in summary.items():
        print(f"\ngroup size {group_key}: median held-out output SQNR (dB) per kind, and the gains")
        for kind, row in table.items():
            medians = " ".join(f"{r} {s['median']:6.2f}" for r, s in row["output_sqnr_db"].items())
            gains_text = " ".join(f"{g} {s['median']:+.2f}" for g, s in row["gains_db"].items())
            print(f"  {kind:<22} {medians} | {gains_text}", flush=True)


def _command(argv: list[str], out: Path) -> str:
    """The command as run, with ``--out`` shown relative to the working directory (its name alone outside it)."""
    words, skip = [], False
    for word in argv:
        if skip or word.startswith("--out="):
            skip = False
            continue
        if word == "--out":
            skip = True
            continue
        words.append(word)
    return " ".join(["python benchmarks/four_bit_sqnr_full_size.py", *words, "--out", shown_path(out)])


def run(options: SqnrOptions) -> dict[str, Any]:
    """Build, capture, round every target and summarize; the result's fields (no provenance)."""
    seconds: dict[str, float] = {}
    started = begun = time.time()
    model = build_transformer(options)
    parameters = sum(p.numel() for p in model.parameters())
    seconds["build"] = round(time.time() - begun, 1)
    targets = block_targets(model, options.blocks)
    hessians, held_out = capture(model, list(targets), options, seconds)
    weights = {name: layer.weight.detach().to(torch.bfloat16).clone() for name, layer in targets.items()}
    config = dict(model.config)
    del model, targets
    gc.collect()
    begun = time.time()
    layers: dict[str, dict[str, Any]] = {}
    # the widest Hessians (img_mlp.out's 12288 x 12288) last, so that fewer are held beside GPTQ's own
    for name in sorted(weights, key=lambda n: (weights[n].shape[1], n)):
        layer_begun = time.time()
        layers[name] = measure_layer(weights.pop(name), hessians.pop(name), held_out.pop(name), options)
        layers[name]["seconds"] = round(time.time() - layer_begun, 1)
        gptq = {g: layers[name][str(g)]["rows"]["gptq"]["output_sqnr_db"] for g in options.group_sizes}
        print(f"{name}: {layers[name]['seconds']} s, GPTQ output SQNR {gptq} dB", flush=True)
    layers = dict(sorted(layers.items(), key=lambda item: _block_order(item[0])))
    seconds["quantize_and_measure"] = round(time.time() - begun, 1)
    seconds["total"] = round(time.time() - started, 1)
    rows_per_forward = options.text_tokens + options.image_tokens
    return {
        "model": {
            "class": "QwenImage21Transformer2DModel",
            "config": {k: v for k, v in config.items() if not k.startswith("_")},
            "parameters": parameters,
            "weights": f"diffusers' default init after torch.manual_seed({options.model_seed}), rounded to "
            "bfloat16; forwards in float32 on the CPU",
        },
        "inputs": {
            "forward": f"{options.text_tokens} text tokens then one {options.image_side}x{options.image_side} "
            f"image ({options.image_tokens} latent tokens): {rows_per_forward} rows per Linear per forward; "
            "latents and text embeddings standard normal, drawn in that order per forward from the seed's generator",
            "calibration": {
                "seed": options.calibration_seed,
                "forwards": options.calibration_forwards,
                "timesteps": calibration_timesteps(options.calibration_forwards),
                "rows": rows_per_forward * options.calibration_forwards,
            },
            "held_out": {
                "seed": options.held_out_seed,
                "timestep": HELD_OUT_TIMESTEP,
                "rows": rows_per_forward,
            },
        },
        "quantizers": {
            "scheme": SCHEME,
            "bits": 4,
            "rtn": "ditq.numerics.quantize_weight (q in [-7, 7])",
            "gptq": {"damp": SHIPPED.damp, "act_order": SHIPPED.act_order, "q_range": [-8, 7]},
            "low_rank": "ditq.quantization.low_rank.split_low_rank: bfloat16 up (N, R) and down (R, K), the "
            "residual W - up @ down rounded; W_q = dequantized residual + up @ down in float32",
        },
        "metrics": {
            "weight_sqnr_db": {"definition": "10 log10(|W|^2 / |W - W_q|^2)", "higher_is_better": True},
            "output_sqnr_db": {
                "definition": "10 log10(sum |X W^T|^2 / sum |X (W - W_q)^T|^2), X the held-out inputs",
                "higher_is_better": True,
            },
            "gains_db": {"definition": "differences of output_sqnr_db", "higher_is_better": True},
        },
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(options).items()},
        "by_kind": {str(g): by_kind(layers, str(g)) for g in options.group_sizes},
        "layers": layers,
        "seconds": seconds,
    }


def _block_order(name: str) -> tuple[int, str]:
    block, _, kind = name.removeprefix("transformer_blocks.").partition(".")
    return int(block), kind


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(word) for word in text.split(",") if word)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    defaults = SqnrOptions()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("full", "tiny"), default=defaults.preset)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers, help="blocks built (full: 32)")
    parser.add_argument(
        "--blocks", default="0,1", help="the blocks whose Linears are measured (default %(default)s)"
    )
    parser.add_argument("--group-sizes", default="128,channel", help="default %(default)s")
    parser.add_argument(
        "--ranks", default="16,32", help="low-rank branch ranks, '' for none (default %(default)s)"
    )
    parser.add_argument("--image-side", type=int, default=defaults.image_side, help="pixels")
    parser.add_argument("--text-tokens", type=int, default=defaults.text_tokens)
    parser.add_argument("--calibration-forwards", type=int, default=defaults.calibration_forwards)
    parser.add_argument("--model-seed", type=int, default=defaults.model_seed)
    parser.add_argument("--calibration-seed", type=int, default=defaults.calibration_seed)
    parser.add_argument("--held-out-seed", type=int, default=defaults.held_out_seed)
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "h100-four-bit" / f"{BENCH}_cpu_{commit()}.json"
    )
    args = parser.parse_args(argv)
    try:
        options = SqnrOptions(
            preset=args.preset,
            num_layers=args.num_layers,
            blocks=_ints(args.blocks),
            group_sizes=tuple(parse_group_size(g) for g in args.group_sizes.split(",")),
            ranks=_ints(args.ranks),
            image_side=args.image_side,
            text_tokens=args.text_tokens,
            calibration_forwards=args.calibration_forwards,
            model_seed=args.model_seed,
            calibration_seed=args.calibration_seed,
            held_out_seed=args.held_out_seed,
        )
    except ValueError as error:
        parser.error(str(error))
    from ditq.report.provenance import git_revision

    fields_ = run(options)
    print_table(fields_["by_kind"])
    payload = {
        "command": _command(argv, args.out),
        "commit": git_revision(),
        "what": __doc__.splitlines()[0],
        **fields_,
        "device": "cpu",
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),  # Linux: KiB
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "platform": platform.machine(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out} in {fields_['seconds']['total']} s")
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
