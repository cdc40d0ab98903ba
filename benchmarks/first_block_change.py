"""What First Block Cache thresholds: how far the first transformer block's residual moves from one denoising step to
the next, on a trained model and on random weights.

    python benchmarks/first_block_change.py --out benchmarks/results/first_block_change_cpu_COMMIT.json

diffusers' First Block Cache (``--cache first-block:T``) skips the rest of the transformer at a step where
mean|r - r_prev| / mean|r_prev| is at most T, r being the first block's output hidden states less its input
(``diffusers.hooks.first_block_cache``, ``_should_compute_remaining_blocks``). This measures that number at every step
of every request, with nothing skipped, on the CPU: the bundled demo model (trained) at each fixture, and the tiny
preset of the full-size Qwen-Image-2.1 pipeline (``tools/full_size_pipeline.py --preset tiny``: random weights,
diffusers' and transformers' default initialisation, as the full-size GPU runs use) with its fixtures. A setting
skips a step only where the number is at most its threshold: where no step's number is, the setting buys nothing.
The prefix KV cache's extract call (references) is its own context and is left out, as the cache leaves it out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from result_names import result_path

from ditq.fsutil import atomic_write_json

THRESHOLDS = (0.05, 0.1, 0.2, 0.4, 0.6)  # the searched ones (ditq sweep --cache auto) and two below


class FirstBlockWatch:
    """Forward hooks on a transformer and its first block: per denoising call, the first block's residual change
    against the previous denoising call's (the extract call left out), as First Block Cache computes it."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        import ditq.diffusers  # noqa: F401 - registers the family blocks with diffusers' block registry

        blocks = next(m for m in transformer.children() if isinstance(m, torch.nn.ModuleList))
        self.metadata = TransformerBlockRegistry.get(type(blocks[0]))
        self.previous: torch.Tensor | None = None
        self.changes: list[float] = []
        self.extract = False
        self.handles = [
            transformer.register_forward_pre_hook(self._call, with_kwargs=True),
            blocks[0].register_forward_hook(self._block, with_kwargs=True),
        ]

    def begin(self) -> list[float]:
        """A new request: its changes, filled as it runs."""
        self.previous, self.changes = None, []
        return self.changes

    def _call(self, _module: torch.nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        self.extract = kwargs.get("kv_cache_mode") == "extract"

    def _block(self, _module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self.extract:
            return
        before = self.metadata._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        after = (
            output if isinstance(output, torch.Tensor) else output[self.metadata.return_hidden_states_index]
        )
        residual = (after - before).float()
        if self.previous is not None:
            change = (residual - self.previous).abs().mean() / self.previous.abs().mean()
            self.changes.append(float(change))
        self.previous = residual


def _summary(by_request: dict[str, list[float]]) -> dict[str, Any]:
    every = [c for changes in by_request.values() for c in changes]
    return {
        "steps_measured": len(every),
        "min": round(min(every), 4),
        "median": round(statistics.median(every), 4),
        "max": round(max(every), 4),
        # the share of steps each threshold would let the cache serve (the first of each request always computes)
        "at_most": {str(t): round(sum(c <= t for c in every) / len(every), 4) for t in THRESHOLDS},
        "by_request": {key: [round(c, 4) for c in changes] for key, changes in by_request.items()},
    }


def _measure(
    model: Path, fixtures: Path, references: Path, seeds: tuple[int, ...], steps: int
) -> dict[str, Any]:
    from ditq.calibration import fixture_requests
    from ditq.pipeline.open import open_pipeline
    from ditq.probe.fixtures import load_fixtures
    from ditq.runtime.options import LoadOptions, resolve_load_options

    adapter = open_pipeline(model, resolve_load_options(LoadOptions(device="cpu", skip_doctor=True)))
    watch = FirstBlockWatch(adapter.pipeline.transformer)
    by_request: dict[str, list[float]] = {}
    for fixture_id, fixture in load_fixtures(fixtures, references).items():
        for seed in seeds:
            changes = watch.begin()
            (request,) = fixture_requests({fixture_id: fixture}, (seed,), steps)
            adapter(request)
            by_request[f"{fixture_id}.s{seed}"] = list(changes)
    return _summary(by_request)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=result_path("first_block_change"))
    parser.add_argument("--seeds", default="2301,2302", help="comma list")
    parser.add_argument("--steps", type=int, default=28)
    args = parser.parse_args()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    torch.manual_seed(0)
    from ditq import demo

    result: dict[str, Any] = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "what": __doc__.split("\n\n")[2].replace("\n", " "),
        "steps": args.steps,
        "seeds": list(seeds),
        "thresholds": list(THRESHOLDS),
    }
    result["demo (trained)"] = _measure(
        demo.default_model_dir(), demo.fixtures_path(), demo.references_dir(), seeds, args.steps
    )
    print("demo:", {k: v for k, v in result["demo (trained)"].items() if k != "by_request"}, flush=True)
    import full_size_pipeline

    with tempfile.TemporaryDirectory() as scratch:
        tiny = Path(scratch) / "tiny"
        full_size_pipeline.build(tiny, "tiny")
        result["qwen-image-2.1 tiny preset (random weights)"] = _measure(
            tiny, tiny / "fixtures" / "fixtures.json", tiny / "fixtures" / "refs", seeds, args.steps
        )
    print(
        "tiny:",
        {k: v for k, v in result["qwen-image-2.1 tiny preset (random weights)"].items() if k != "by_request"},
    )
    atomic_write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
