"""`ditq quantize`: a thin layer over ``ditq.quantization.quantizer.quantize`` (same defaults; ``--plan`` for mixed precision)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ditq.checkpoint.qconfig import CONFIG_FORMS
from ditq.devices import OFFLOAD_MODES, add_device_arguments, parse_memory_size
from ditq.errors import InputError
from ditq.probe.fixtures import parse_seeds
from ditq.quantization.defaults import (
    AUTO_MIN_SHARE,
    CALIBRATION_SEEDS,
    CALIBRATION_STEPS,
    CALIBRATIONS,
    DEFAULTS,
)
from ditq.quantization.links import COPY_MAX_BYTES
from ditq.schemes import SCHEMES, GroupSize, parse_group_size

if TYPE_CHECKING:
    from ditq.quantization.plan_file import PlanFile
    from ditq.quantization.quantizer import QuantizeResult

__all__ = ["add_arguments", "add_rounding_arguments", "memory_size_type", "run", "seeds_type"]


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SRC",
        help="diffusers model directory (model_index.json) or hub id (org/name[@revision], through the hub cache)",
    )
    parser.add_argument("output", type=Path, metavar="OUT", help="artifact directory to create")
    parser.add_argument(
        "--scheme",
        help=f"one of {', '.join(SCHEMES)} or an alias (default: {DEFAULTS['scheme']}); not with --plan",
    )
    parser.add_argument(
        "--plan",
        type=Path,
        metavar="PLAN.json",
        help="mixed precision: each Linear of the plan's component gets the scheme the plan names, or is kept "
        "(ditq plan writes it); not with --scheme, --targets, --ignore or --group-size",
    )
    parser.add_argument(
        "--components",
        type=_comma_list,
        help="comma-separated components to quantize, or auto (the default): every component whose block "
        f"Linears hold at least {AUTO_MIN_SHARE * 100:.0f}%% of the pipeline's parameters (Qwen-Image: the transformer and "
        "the text encoder); with --plan, the plan's component",
    )
    parser.add_argument(
        "--keep-unused",
        action="store_true",
        help="declare no module unused (by default a text encoder's output head, which a diffusers pipeline never "
        "reads, is declared in the manifest and neither loaded nor run)",
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        default=[],
        metavar="RE",
        help="quantize the Linears whose tensor prefix matches any RE (replaces the block rule)",
    )
    parser.add_argument(
        "--ignore", nargs="+", default=[], metavar="RE", help="keep matching Linears in source precision"
    )
    parser.add_argument(
        "--group-size",
        metavar="N|channel",
        help="one scale per N input features (w8a16, w4a16, w4a8; the 4-bit schemes' default is 128), or channel: "
        "one per output channel (the 8-bit schemes' default; w4a8's runs cuBLAS's rowwise fp8 GEMM, at some "
        "fidelity)",
    )
    parser.add_argument(
        "--config-form",
        choices=(*CONFIG_FORMS, "component", "global"),
        default=DEFAULTS["config_form"],
        help="quantization_config in the flat compressed-tensors form (default, what compressed-tensors, "
        'transformers and vLLM read) or wrapped per component ({"transformer": {...}}) for servers that '
        "expect the wrapper; 'global' and 'component' are the former names of flat and wrapped",
    )
    parser.add_argument(
        "--variant",
        help="read each quantized component's variant weights (e.g. fp16: *.fp16.safetensors) instead of the "
        "default files, as diffusers' from_pretrained(variant=...) does",
    )
    held = parser.add_mutually_exclusive_group()
    held.add_argument(
        "--link",
        action="store_true",
        help="link every entry of SRC not rewritten by its absolute path (OUT moves anywhere while SRC stays)",
    )
    held.add_argument(
        "--copy",
        action="store_true",
        help="copy every entry of SRC not rewritten (OUT moves anywhere alone). By default each is a relative link "
        "where SRC is beside OUT (within OUT's parent or grandparent folder: move them together), else a copy "
        f"up to {COPY_MAX_BYTES / 1024**3:.0f} GiB and an absolute link, with a warning, above it",
    )
    parser.add_argument(
        "--follow-links",
        action="store_true",
        help="read through symbolic links that leave SRC (refused without it); their files are in the "
        "manifest's source digest",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    add_device_arguments(parser, DEFAULTS["device"], "where to encode the weights")
    add_rounding_arguments(parser, quantize=True)
    placing = parser.add_argument_group(
        "where the source waits while --calibrate gptq runs its requests (round to nearest reads the files "
        "band by band)"
    )
    placing.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        help="as ditq serve places a model: auto streams from pinned host memory what does not fit --max-memory "
        "(the source in its dtype: Qwen-Image's transformer and text encoder are 32 GB), block streams every "
        "component, model moves each in whole (default: none, every component on the device)",
    )
    placing.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="cap the accelerator memory the calibration may use, e.g. 16GiB (CUDA only); with --offload the input "
        "Hessians are summed on the host, the device making one layer's product at a time",
    )
    parser.add_argument("--json", action="store_true", help="print the manifest's statistics as JSON")


def add_rounding_arguments(parser: argparse.ArgumentParser, quantize: bool) -> None:
    """How 4- and 8-bit int weights are rounded: ``--calibrate`` and its requests, ``--low-rank`` (``ditq quantize``
    and ``ditq plan``, which measures each layer as its plan's artifact will round it). ``quantize``: ``ditq
    quantize``'s form, with ``--fixtures`` and ``--refs`` (``ditq plan`` calibrates on the fixtures it judges) and
    the host's share of memory for ``--calibration-memory`` under its ``--offload`` (the plan has none)."""
    calibration = parser.add_argument_group("calibrated rounding (int weights: w4a16, w4a8, w8a16, w8a8)")
    calibration.add_argument(
        "--calibrate",
        choices=CALIBRATIONS,
        help="rtn: round to nearest (the default, no data); gptq: GPTQ's error feedback from each Linear's input "
        "Hessian, gathered by running the fixtures' requests through the source model on --device (with a "
        "plan: its int-weight layers; fp8 ones round to nearest). With --plan: the plan's own, recorded by "
        "ditq plan --calibrate",
    )
    if quantize:
        calibration.add_argument(
            "--fixtures",
            type=Path,
            help="--calibrate gptq: fixtures JSON (default for the bundled demo model: its own)",
        )
        calibration.add_argument(
            "--refs", type=Path, help="--calibrate gptq: reference image folder (demo: its own)"
        )
    calibration.add_argument(
        "--calibration-seeds",
        type=seeds_type,
        metavar="S[,S...]",
        help="--calibrate gptq: the seeds each fixture is run at, e.g. 0,1 or 0-3 (default 0,1: not the probe's "
        "2301-2304)",
    )
    calibration.add_argument(
        "--calibration-steps",
        type=int,
        help="--calibrate gptq: denoising steps a request (default 8)",
    )
    calibration.add_argument(
        "--calibration-memory",
        type=memory_size_type,
        metavar="SIZE",
        help="--calibrate gptq: the input Hessians held at once (default 4GiB"
        + (
            "; with --offload, which sums them on the host, half the host's available memory once the source is "
            "placed, in multiples of 4GiB"
            if quantize
            else ""
        )
        + "); more layers than fit are calibrated in further passes over the requests",
    )
    parser.add_argument(
        "--low-rank",
        type=int,
        metavar="R",
        help="w4a16, w4a8: keep each 4-bit target's R largest directions (SVDQuant's low-rank branch) in bfloat16 "
        "beside its quantized residual, stored as <prefix>.low_rank_up and .low_rank_down; R below every such "
        "target's smaller dimension (8-bit layers carry none). Readers other than ditq ignore the branch: they "
        "get the residual only. With --plan: the plan's own, recorded by ditq plan --low-rank",
    )


def memory_size_type(text: str) -> int:
    """A size (``parse_memory_size``), its error said as argparse says one, naming the flag it was given to (the
    parser's own names --max-memory, and raised in argparse's type call it ended in a traceback)."""
    try:
        return parse_memory_size(text)
    except InputError:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r} (e.g. 16GiB, 20000MiB)") from None


def seeds_type(text: str) -> tuple[int, ...]:
    """The probe's seed syntax (``parse_seeds``), its error said as argparse says one."""
    try:
        return tuple(parse_seeds(text))
    except InputError:
        raise argparse.ArgumentTypeError(f"not a list of seeds: {text!r} (e.g. 0,1 or 0-3)") from None


def _calibrated(
    args: argparse.Namespace, plan: PlanFile | None, group_size: GroupSize | None
) -> QuantizeResult:
    """--calibrate gptq (given, or a plan's): the options the in-memory path takes, the rest refused by name; a
    plan's requests are the ones it was measured with (its fixtures, seeds and steps)."""
    from ditq import demo
    from ditq.calibration import CalibrationOptions, calibrate_and_save
    from ditq.runtime.options import LoadOptions

    if plan is not None and args.scheme:
        raise InputError("--plan and --scheme are mutually exclusive: the plan names each layer's scheme")
    if plan is not None and group_size is not None:
        raise InputError(
            "--plan and --group-size are mutually exclusive: the plan names each layer, or 'keep'"
        )
    given = [flag for flag, value in (("--components", args.components),
             ("--ignore", args.ignore), ("--variant", args.variant),
             ("--link", args.link), ("--copy", args.copy), ("--follow-links", args.follow_links),
             ("--keep-unused", args.keep_unused),
             ("--config-form", args.config_form != DEFAULTS["config_form"])) if value]  # fmt: skip
    if given:
        raise InputError(f"--calibrate gptq: {given[0]} is not supported with calibration (components: auto)")
    bundled = Path(args.source).resolve() == demo.default_model_dir().resolve()
    if (args.fixtures is None or args.refs is None) and not bundled:
        raise InputError(
            "--calibrate gptq: --fixtures and --refs are needed for a model other than the demo model"
        )
    requests = None if plan is None else plan.rounding.calibration
    seeds, steps = args.calibration_seeds or CALIBRATION_SEEDS, args.calibration_steps or CALIBRATION_STEPS
    if requests is not None:
        planned = (("--calibration-seeds", args.calibration_seeds, tuple(requests.seeds), "seeds"),
                   ("--calibration-steps", args.calibration_steps, requests.steps, "steps"))  # fmt: skip
        for flag, value, measured, field in planned:
            if value is not None and value != measured:
                raise InputError(
                    f"{flag}: {args.plan} was measured with rounding.calibration.{field} {measured}; leave the "
                    "flag out to quantize it as planned"
                )
        seeds, steps = tuple(requests.seeds), requests.steps
    options = CalibrationOptions(
        fixtures=args.fixtures or demo.fixtures_path(),
        refs=args.refs or demo.references_dir(),
        seeds=seeds,
        steps=steps,
        memory_bytes=args.calibration_memory,
        act_order=True if requests is None else requests.act_order,
        load=LoadOptions(device=args.device, offload=args.offload or "none", max_memory=args.max_memory),
        only=None if requests is None else tuple(requests.fixtures),
    )
    return calibrate_and_save(
        args.source,
        args.output,
        args.plan if plan is not None else args.scheme or DEFAULTS["scheme"],
        options,
        targets=args.targets,
        force=args.force,
        low_rank=args.low_rank,
        group_size=group_size,
    )


def run(args: argparse.Namespace) -> int:
    from ditq.quantization.plan_file import planned_rounding, read_plan
    from ditq.quantization.quantizer import quantize

    group_size = None if args.group_size is None else parse_group_size(args.group_size)
    plan = None if args.plan is None else read_plan(args.plan)
    method = args.calibrate or "rtn"
    if plan is not None:  # the plan's rounding; flags that say otherwise are refused
        method = planned_rounding(plan, str(args.plan), args.calibrate, args.low_rank).method
    if method == "gptq":
        result = _calibrated(args, plan, group_size)
    else:
        placed = [
            flag for flag, value in (("--offload", args.offload), ("--max-memory", args.max_memory)) if value
        ]
        if placed:
            raise InputError(
                f"{placed[0]}: only with --calibrate gptq, whose requests run the source model (round to nearest "
                "reads the weight files band by band, whatever their size)"
            )
        result = quantize(
            args.source,
            args.output,
            args.scheme,
            components=args.components,
            plan=args.plan,
            targets=args.targets,
            ignore=args.ignore,
            group_size=group_size,
            config_form=args.config_form,
            variant=args.variant,
            copy=args.copy,
            link=args.link,
            follow_links=args.follow_links,
            force=args.force,
            device=args.device,
            keep_unused=args.keep_unused,
            low_rank=args.low_rank,
        )
    stats = result.manifest["statistics"]
    if args.json:
        print(json.dumps({"artifact": str(result.path), "statistics": stats}, indent=1))
    else:
        print(
            f"{result.path}: {stats['quantized_tensors']} tensors quantized ({stats['quantized_params']:,} params), "
            f"{stats['kept_params']:,} params kept; rel-L2 mean {stats['mean_rel_l2']:.4f} max {stats['max_rel_l2']:.4f}"
        )
        options = result.manifest["options"]
        rule = " (auto)" if isinstance(options["components_rule"], dict) else ""
        print(f"components: {', '.join(options['components'])}{rule}")
        for component, modules in result.manifest["unused"].items():
            for module, record in modules.items():
                print(
                    f"unused: {component}.{module} ({record['bytes'] / 2**30:.2f} GiB), neither loaded nor run"
                )
    return 0
