"""Full-size Qwen-Image-2.1 DiT forward: BF16 vs every ditq scheme (eager, compiled), torchao int8, and loading.

The model is diffusers' ``QwenImage21Transformer2DModel`` at its default
config with random weights (normal, std 0.02), in BF16 on one GPU. One
forward pass is timed at 1024x1024 text-to-image (4096 image tokens + 256
text tokens) and with four 1024x1024 references (5 x 4096 image tokens + 256
text tokens, the reference slots sitting in the text sequence). Quantized
variants take the Linears the quantizer would (``ditq.targets.plan_targets``)
and run the kernel path ``ditq serve`` would choose (``ditq.doctor.choose_kernel``:
the first candidate that passes the doctor's check on this device, chosen
before the repack; ``--skip-doctor``: the registry's first, unverified); the
time the choice took is reported apart. "compiled" is diffusers' regional
compilation of the repeated blocks. Peak memory is reported as if the variant
were alone on the device: its weight bytes plus the forward's peak above the
memory held before the call. The load row writes a w8a8 artifact from the
random weights and times ``ditq.load_component`` + repack onto the GPU.

    python benchmarks/dit_bench.py --out benchmarks/results/dit_bench.json [--budget-s 200]

Work runs in priority order under a wall-clock budget; whatever does not fit
is listed under "skipped" in the JSON, never silently dropped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ditq.checkpoint.codecs import codec_for  # noqa: E402
from ditq.checkpoint.qconfig import quantization_config, with_quantization_config  # noqa: E402
from ditq.doctor import VerifiedChooser, kernel_chooser  # noqa: E402
from ditq.numerics import quantize_weight, relative_l2  # noqa: E402
from ditq.runtime.loader import load_component, parameters_on_meta, prepare_quantized  # noqa: E402
from ditq.runtime.modules import linear_from_stored, quantized_linears  # noqa: E402
from ditq.schemes import get_scheme  # noqa: E402
from ditq.targets import plan_targets  # noqa: E402

# name -> (transformer config overrides, text tokens, image grid side in tokens). "tiny" is a CPU dry run.
PRESETS: dict[str, tuple[dict[str, Any], int, int]] = {
    "full": ({}, 256, 64),  # 1024 px / (VAE 16) = 64 tokens a side
    "tiny": (
        dict(
            num_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            context_in_dim=64,
            in_channels=64,
            out_channels=64,
            axes_dims_rope=(8, 12, 12),
        ),
        16,
        8,
    ),
}
# Measured on an H200 (project design notes): BF16 eager 154 / 847 ms; torchao int8 compiled 115 ms.
GOALS = {
    "w8a8_eager_vs_bf16_max": 0.80,
    "compiled_ms_below_torchao_int8_compiled": 115.0,
    "weight_bytes_vs_bf16_max": 0.53,
}
SCHEMES = ("w8a8", "fp8", "w8a16")


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    for name in ("diffusers", "triton", "torchao"):
        try:
            env[name] = __import__(name).__version__
        except Exception as error:
            env[name] = f"unavailable: {error!r}"[:200]
    try:
        env["git_commit"] = subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        # A copy of the tree without .git (a remote runner): the caller may say which commit it is.
        env["git_commit"] = os.environ.get("DITQ_SOURCE_COMMIT", "unknown")
    return env


def build_bf16(config: dict[str, Any], device: torch.device, seed: int) -> torch.nn.Module:
    """Random BF16 weights straight on the device (1-D: norms 1, biases 0; 2-D+: normal std 0.02)."""
    from diffusers import QwenImage21Transformer2DModel

    with parameters_on_meta():
        model = QwenImage21Transformer2DModel(**config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        tensor = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
        if param.ndim >= 2:
            tensor.normal_(0.0, 0.02, generator=generator)
        elif attr == "weight":
            tensor.fill_(1.0)
        else:
            tensor.zero_()
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    return model.to(device).eval()


def target_prefixes(model: torch.nn.Module) -> list[str]:
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    return sorted(plan_targets(model, "transformer", shapes).targets)


def quantized_copy(
    bf16: torch.nn.Module, config: dict[str, Any], scheme_name: str, targets: list[str]
) -> torch.nn.Module:
    """The same model with ``targets`` as ditq QuantizedLinears (quantized on the device); other tensors shared."""
    from diffusers import QwenImage21Transformer2DModel

    scheme = get_scheme(scheme_name)
    with parameters_on_meta():
        model = QwenImage21Transformer2DModel(**config)
    for prefix in targets:
        linear = bf16.get_submodule(prefix)
        assert isinstance(linear, torch.nn.Linear)
        q, scale = quantize_weight(linear.weight, scheme)
        layer = linear_from_stored(codec_for(scheme).encode(q, scale), scheme, linear.bias)
        parent, _, attr = prefix.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
    target_set = set(targets)
    for name, param in bf16.named_parameters():
        module_name, _, attr = name.rpartition(".")
        if module_name in target_set:
            continue
        model.get_submodule(module_name)._parameters[attr] = param
    device = next(bf16.parameters()).device
    return model.to(device).eval()


def _storages(tensor: torch.Tensor) -> dict[int, int]:
    """data pointer -> bytes of every storage behind ``tensor`` (tensor subclasses such as torchao's unwrapped)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        found: dict[int, int] = {}
        for name in names:
            found.update(_storages(getattr(tensor, name)))
        return found
    storage = tensor.untyped_storage()
    return {storage.data_ptr(): storage.nbytes()}


def tensor_bytes(model: torch.nn.Module) -> int:
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storages.update(_storages(tensor))
    return sum(storages.values())


def make_inputs(
    config: dict[str, Any], text: int, grid: int, references: int, device: torch.device
) -> dict[str, Any]:
    """One sample: ``references`` condition images then the target, each grid x grid latent tokens."""
    in_channels = config.get("in_channels", 64)
    context = config.get("context_in_dim", 4096)
    generator = torch.Generator(device=device).manual_seed(1)
    tokens = grid * grid
    slots = tokens // 4  # one vision-language slot per 2x2 latent tokens
    vlm_length = text + references * slots  # text tokens, then each reference's slots
    img_mask = torch.zeros(1, vlm_length + slots, dtype=torch.bool, device=device)
    img_mask[0, text:] = True
    return dict(
        hidden_states=torch.randn(
            1, (references + 1) * tokens, in_channels, generator=generator, device=device
        ).to(torch.bfloat16),
        encoder_hidden_states=torch.randn(1, vlm_length, context, generator=generator, device=device).to(
            torch.bfloat16
        ),
        timestep=torch.full((1,), 0.5, dtype=torch.bfloat16, device=device),
        img_shapes=[[(1, grid, grid)] * (references + 1)],
        img_mask=img_mask,
        return_dict=False,
    )


def time_forward(
    model: Callable[..., Any], inputs: dict[str, Any], warmup: int, iters: int
) -> tuple[float, int, torch.Tensor]:
    """(median ms, peak bytes above the memory held before, output) of model(**inputs)."""
    with torch.inference_mode():
        for _ in range(warmup):
            out = model(**inputs)[0]
        _sync()
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            out = model(**inputs)[0]
            _sync()
            times.append((time.perf_counter() - start) * 1000)
        peak = (torch.cuda.max_memory_allocated() - before) if torch.cuda.is_available() else 0
    return statistics.median(times), int(peak), out


def kernel_counts(model: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for layer in quantized_linears(model).values():
        name = layer.kernel.name if layer.kernel is not None else "unchosen"
        counts[name] = counts.get(name, 0) + 1
    return counts


def write_artifact(model: Any, targets: list[str], root: Path) -> int:
    """A one-component w8a8 artifact of ``model`` (stored tensors before any repack); returns its bytes."""
    from safetensors.torch import save_file

    folder = root / "transformer"
    folder.mkdir(parents=True)
    index = {
        "_class_name": "DiffusionPipeline",
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    }
    (root / "model_index.json").write_text(json.dumps(index))
    ignored = sorted(
        n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n not in set(targets)
    )
    full_config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    full_config["_class_name"] = "QwenImage21Transformer2DModel"
    plain = quantization_config(get_scheme("w8a8"), ignored)
    (folder / "config.json").write_text(
        json.dumps(with_quantization_config(full_config, "transformer", plain, "flat"))
    )
    shard: dict[str, torch.Tensor] = {}
    size, shards, weight_map = 0, 0, {}
    state = model.state_dict()

    def flush() -> None:
        nonlocal shard, size, shards
        if shard:
            shards += 1
            file_name = f"diffusion_pytorch_model-{shards:05d}.safetensors"
            save_file(shard, str(folder / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file_name))
        shard, size = {}, 0

    for name, tensor in state.items():
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= 2 << 30:
            flush()
    flush()
    index_doc = {"metadata": {}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index_doc))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def measure_load(
    root: Path, device: torch.device, artifact_bytes: int, chooser: VerifiedChooser | None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    _sync()
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = load_component(root, "transformer", device=device, dtype=torch.bfloat16)
    loaded = time.perf_counter() - start
    choosing = chooser.seconds if chooser is not None else 0.0
    prepare_quantized(model, device, torch.bfloat16, chooser)
    _sync()
    total = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) if torch.cuda.is_available() else 0
    component_bytes = tensor_bytes(model)
    largest = max(
        tensor_bytes(layer) for layer in [*quantized_linears(model).values(), *model.transformer_blocks]
    )
    bound = int(1.1 * (component_bytes + largest))
    return model, {
        "artifact_bytes": artifact_bytes,
        "load_seconds": round(loaded, 3),
        "load_and_repack_seconds": round(total, 3),
        # of which: the doctor's checks choosing the paths (kernel compilation included; cached after one run)
        "kernel_choice_seconds": round(chooser.seconds - choosing, 3) if chooser is not None else None,
        "peak_accelerator_bytes_while_loading": peak,
        "component_bytes_after_load": component_bytes,
        "largest_module_bytes": largest,
        "bound_bytes (component + largest module + 10%)": bound,
        "within_bound": peak <= bound if torch.cuda.is_available() else None,
        "kernels": kernel_counts(model),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--budget-s", type=float, default=200.0, help="wall-clock budget for the measurements"
    )
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dit_bench.json")
    parser.add_argument(
        "--artifact-dir", type=Path, help="where to write the load test's artifact (temp dir)"
    )
    parser.add_argument(
        "--skip-doctor", action="store_true", help="the registry's first kernel paths, unverified"
    )
    args = parser.parse_args()
    chooser = kernel_chooser(args.skip_doctor)
    budget = Budget(args.budget_s)
    device = torch.device(args.device)
    overrides, text, grid = PRESETS[args.preset]
    config = dict(overrides)  # the class defaults, but for the dry-run preset
    result: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "environment": environment(),
        "model": {
            "class": "QwenImage21Transformer2DModel",
            "config_overrides": overrides,
            "weights": "random",
        },
        "shapes": {
            "t2i": {"references": 0, "image_tokens": grid * grid, "text_tokens": text},
            "refs4": {"references": 4, "image_tokens": 5 * grid * grid, "text_tokens": text},
        },
        "rows": [],
        "skipped": [],
        "goals": GOALS,
    }
    rows: list[dict[str, Any]] = result["rows"]
    inputs = {
        name: make_inputs(config, text, grid, 4 if name == "refs4" else 0, device)
        for name in ("t2i", "refs4")
    }
    bf16 = build_bf16(config, device, seed=0)
    targets = target_prefixes(bf16)
    bf16_bytes = tensor_bytes(bf16)
    result["model"]["quantized_linears"] = len(targets)
    reference: dict[str, torch.Tensor] = {}

    def record(
        variant: str, mode: str, shape: str, model: Any, weight_bytes: int, extra: dict[str, Any]
    ) -> None:
        warmup = 2 if mode == "compiled" else 1
        try:
            ms, peak, out = time_forward(model, inputs[shape], warmup, args.iters)
        except Exception as error:  # recorded: one broken variant must not hide the others
            rows.append({"variant": variant, "mode": mode, "shape": shape, "error": repr(error)[:600]})
            print(f"{variant:>14} {mode:>8} {shape:>6}: ERROR {error!r}"[:300], flush=True)
            return
        if variant == "bf16" and mode == "eager":
            reference[shape] = out.float()
        error_vs_bf16 = relative_l2(out.float(), reference[shape]) if shape in reference else None
        row = {
            "variant": variant,
            "mode": mode,
            "shape": shape,
            "ms": round(ms, 2),
            "weight_bytes": weight_bytes,
            "peak_bytes_alone": weight_bytes + peak,
            "rel_l2_vs_bf16_eager": None if error_vs_bf16 is None else round(error_vs_bf16, 5),
            **extra,
        }
        rows.append(row)
        print(
            f"{variant:>14} {mode:>8} {shape:>6}: {ms:9.2f} ms  peak {row['peak_bytes_alone'] / 2**30:6.2f} GiB",
            flush=True,
        )

    models: dict[str, torch.nn.Module] = {}

    def eager(variant: str, shape: str) -> None:
        model = bf16 if variant == "bf16" else models[variant]
        extra = {} if variant == "bf16" else {"kernels": kernel_counts(model)}
        record(variant, "eager", shape, model, tensor_bytes(model), extra)

    def load_w8a8() -> None:
        """w8a8 through the real loader: artifact on disk -> load_component on the device -> repack."""
        artifact_root = args.artifact_dir or Path(tempfile.mkdtemp(prefix="ditq-dit-bench-"))
        try:
            staged = quantized_copy(bf16, config, "w8a8", targets)
            artifact_bytes = write_artifact(staged, targets, artifact_root / "w8a8")
            del staged
            gc.collect()
            models["w8a8"], result["load"] = measure_load(
                artifact_root / "w8a8", device, artifact_bytes, chooser
            )
        finally:
            shutil.rmtree(artifact_root, ignore_errors=True)

    def in_memory(scheme: str) -> None:
        models[scheme] = quantized_copy(bf16, config, scheme, targets)
        prepare_quantized(models[scheme], device, torch.bfloat16, chooser)

    def compiled(variant: str, shape: str) -> None:
        model = bf16 if variant.startswith("torchao") else models[variant]
        fullgraph = not variant.startswith("torchao")  # ditq's custom ops must trace without a graph break
        if not getattr(model, "_ditq_bench_compiled", False):
            model.compile_repeated_blocks(fullgraph=fullgraph)
            model._ditq_bench_compiled = True  # type: ignore[assignment]
        extra = {"fullgraph": fullgraph} | (
            {} if variant.startswith("torchao") else {"kernels": kernel_counts(model)}
        )
        start = time.perf_counter()
        record(variant, "compiled", shape, model, tensor_bytes(model), extra)
        rows[-1]["compile_and_run_seconds"] = round(time.perf_counter() - start, 1)

    def torchao_int8() -> None:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        for scheme in ("fp8", "w8a16"):
            models.pop(scheme, None)  # free the device for torchao's copies
        gc.collect()
        target_set = set(targets)
        quantize_(bf16, Int8DynamicActivationInt8WeightConfig(), filter_fn=lambda m, fqn: fqn in target_set)

    torch._dynamo.config.cache_size_limit = 64
    # (name, estimated seconds, action) in priority order; what does not fit the budget is recorded as skipped.
    plan: list[tuple[str, float, Callable[[], None]]] = [
        ("bf16 eager t2i", 5, lambda: eager("bf16", "t2i")),
        ("bf16 eager refs4", 8, lambda: eager("bf16", "refs4")),
        ("w8a8 artifact write + load", 40, load_w8a8),
        ("w8a8 eager t2i", 10, lambda: eager("w8a8", "t2i")),
        ("w8a8 eager refs4", 12, lambda: eager("w8a8", "refs4")),
        ("w8a8 compiled t2i", 45, lambda: compiled("w8a8", "t2i")),
        ("fp8 quantize", 5, lambda: in_memory("fp8")),
        ("fp8 eager t2i", 8, lambda: eager("fp8", "t2i")),
        ("fp8 eager refs4", 10, lambda: eager("fp8", "refs4")),
        ("w8a16 quantize", 5, lambda: in_memory("w8a16")),
        ("w8a16 eager t2i", 12, lambda: eager("w8a16", "t2i")),
        ("w8a16 eager refs4", 14, lambda: eager("w8a16", "refs4")),
        ("fp8 compiled t2i", 45, lambda: compiled("fp8", "t2i")),
        # torchao replaces the BF16 weights in place: every variant quantized from them comes before.
        ("torchao-int8dyn quantize (the BF16 model, in place)", 5, torchao_int8),
        ("torchao-int8dyn eager t2i", 10, lambda: eager("torchao-int8dyn", "t2i")),
        ("torchao-int8dyn compiled t2i", 45, lambda: compiled("torchao-int8dyn", "t2i")),
        ("w8a8 compiled refs4", 45, lambda: compiled("w8a8", "refs4")),
    ]
    models["torchao-int8dyn"] = bf16
    failed: set[str] = set()
    for name, estimate, action in plan:
        variant = name.split()[0]
        if variant in failed:
            result["skipped"].append(f"{name}: an earlier step of {variant} failed or was skipped")
            continue
        if budget.left() < estimate:
            result["skipped"].append(
                f"{name}: wall-clock budget ({budget.left():.0f} s left, needs ~{estimate:.0f} s)"
            )
            if "quantize" in name or "load" in name:
                failed.add(variant)  # the variant's model does not exist
            continue
        start = time.perf_counter()
        try:
            action()
        except Exception as error:  # recorded: one broken step must not hide the others
            failed.add(variant)
            result.setdefault("errors", {})[name] = repr(error)[:800]
            print(f"{name}: ERROR {error!r}"[:400], flush=True)
        result.setdefault("step_seconds", {})[name] = round(time.perf_counter() - start, 1)
        gc.collect()
        save(result, rows, bf16_bytes, args.out)  # after every step: a run cut short still leaves its numbers

    save(result, rows, bf16_bytes, args.out)
    print(json.dumps(result["summary"], indent=2))
    return 0


def save(result: dict[str, Any], rows: list[dict[str, Any]], bf16_bytes: int, out: Path) -> None:
    result["summary"] = summarize(rows, bf16_bytes, result.get("load", {}))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(out)


def summarize(rows: list[dict[str, Any]], bf16_bytes: int, load: dict[str, Any]) -> dict[str, Any]:
    def ms(variant: str, mode: str, shape: str) -> float | None:
        for row in rows:
            if (row["variant"], row["mode"], row["shape"]) == (variant, mode, shape) and "ms" in row:
                return float(row["ms"])
        return None

    def weight(variant: str) -> int | None:
        for row in rows:
            if row["variant"] == variant and "weight_bytes" in row:
                return int(row["weight_bytes"])
        return None

    summary: dict[str, Any] = {}
    for shape in ("t2i", "refs4"):
        base = ms("bf16", "eager", shape)
        w8a8 = ms("w8a8", "eager", shape)
        if base and w8a8:
            ratio = w8a8 / base
            summary[f"w8a8_eager_vs_bf16_{shape}"] = {
                "ratio": round(ratio, 3),
                "goal_max": GOALS["w8a8_eager_vs_bf16_max"],
                "met": ratio <= GOALS["w8a8_eager_vs_bf16_max"],
            }
    torchao = ms("torchao-int8dyn", "compiled", "t2i")
    for scheme in ("w8a8", "fp8"):
        value = ms(scheme, "compiled", "t2i")
        if value is not None:
            bar = torchao if torchao is not None else GOALS["compiled_ms_below_torchao_int8_compiled"]
            summary[f"{scheme}_compiled_t2i_ms"] = {
                "ms": value,
                "torchao_int8_compiled_ms": torchao,
                "bar_ms": bar,
                "met": value < bar,
            }
    for scheme in SCHEMES:
        value = weight(scheme)
        if value is not None:
            ratio = value / bf16_bytes
            summary[f"{scheme}_weight_bytes_vs_bf16"] = {
                "ratio": round(ratio, 3),
                "goal_max": GOALS["weight_bytes_vs_bf16_max"],
                "met": ratio <= GOALS["weight_bytes_vs_bf16_max"],
            }
    if load:
        summary["load_within_accelerator_bound"] = load.get("within_bound")
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
