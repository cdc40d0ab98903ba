"""`ditq sweep PATH --schemes ... --fixtures F --refs DIR --out DIR`: the whole chain, every scheme, one report."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ditq.checkpoint.hub import resolve_model
from ditq.commands import (
    ATTENTION_CHOICES,
    KV_CACHE_CHOICES,
    MAX_SEEDS,
    add_load_arguments,
    add_step_cache_argument,
    load_options_from_args,
)
from ditq.commands.probe import add_api_key_argument
from ditq.commands.quantize import memory_size_type, seeds_type
from ditq.commands.report import add_objective_argument, print_summary
from ditq.devices import DTYPE_CHOICES, parse_offload, resolve_device
from ditq.quantization.defaults import CALIBRATIONS

if TYPE_CHECKING:
    from ditq.report import ReportResult

__all__ = ["add_arguments", "add_sweep_arguments", "print_verdicts", "run", "stop_on_sigterm"]


def add_sweep_arguments(parser: argparse.ArgumentParser, device: str) -> None:
    """What `ditq sweep` and `ditq demo` share; ``device`` is the --device default."""
    parser.add_argument(
        "--seeds",
        help="e.g. 2301-2304 or 1,2,5 (default: the probe's, 2301-2304); auto: start from the default and "
        "add seeds to each fixture whose parity decision is undecided, up to --max-seeds",
    )
    parser.add_argument(
        "--max-seeds",
        type=int,
        default=MAX_SEEDS,
        help=f"with --seeds auto: the most seeds a fixture gets (default {MAX_SEEDS})",
    )
    parser.add_argument("--steps", type=int, help="num_inference_steps (default: the probe's, 20)")
    parser.add_argument("--cfg", type=float, help="true_cfg_scale (default: the probe's, 1.0)")
    parser.add_argument(
        "--max-memory", metavar="SIZE", help="accelerator memory every server may use, e.g. 24GiB (recorded)"
    )
    parser.add_argument(
        "--parity-db",
        type=float,
        help="PSNR of a BF16 reference pair: the parity band, in dB (passed to compare)",
    )
    parser.add_argument(
        "--parity-pair",
        nargs=2,
        type=Path,
        metavar=("RUN_A", "RUN_B"),
        help="two acceptable reference runs (e.g. two BF16 implementations) whose PSNR is the band",
    )
    parser.add_argument(
        "--parity-in-process",
        action="store_true",
        help="the parity band from the baseline and the model run in process in bfloat16 (a second baseline, "
        "OUT/parity-in-process), seed by seed",
    )
    add_objective_argument(parser)
    add_load_arguments(
        parser, "device of the quantizer, every server and the doctor", device, flags=("device",)
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="the servers' compute dtype (default: ditq serve's, float32 on cpu and bfloat16 on cuda)",
    )
    parser.add_argument(
        "--offload",
        type=parse_offload,
        default=("none",),
        metavar="MODE[,MODE...]|auto",
        help="offload of every server; a comma list is a ladder: requests that run out of accelerator memory "
        "(or a model that does not load) go to a server at the next mode; auto = auto,block: each server "
        "placed by how often a request runs each component, then block offload (default: none)",
    )
    parser.add_argument(
        "--plan",
        type=Path,
        metavar="PLAN.json",
        help="one more candidate, OUT/plan: the model quantized with this plan (`ditq plan`; quantize --plan), "
        "through the same chain beside the uniform schemes",
    )
    # --compile: every server, the baseline's too; --accumulate: the candidates' servers (the baseline has no fp8 GEMM)
    add_load_arguments(parser, flags=("compile", "accumulate"))
    add_step_cache_argument(parser, auto=True)  # the candidates' servers (the baseline computes every step)
    parser.add_argument("--health-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="PATH",
        help="the unquantized diffusers model directory or hub id (org/name[@revision], through the hub cache)",
    )
    parser.add_argument(
        "--schemes",
        default="w8a16,w8a8,fp8",
        help="comma list; fp8-fast is fp8's candidate served with --accumulate fast, judged beside fp8 (exact) "
        "in the same sweep and serving fp8's artifact; SCHEME-gptq (w4a16, w4a8, w8a16, w8a8) is the scheme "
        "quantized with --calibrate gptq on the sweep's fixtures; SCHEME-channel (w4a16, w4a8) is the scheme "
        "quantized with --group-size channel, one scale per output channel (w4a8-channel-gptq: both) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--calibrate",
        choices=CALIBRATIONS,
        default="rtn",
        help="gptq: every int-weight scheme of --schemes is its SCHEME-gptq candidate (w4a8-channel: "
        "w4a8-channel-gptq; fp8 rounds to nearest)",
    )
    calibration = parser.add_argument_group(
        "GPTQ's requests (each candidate rounded by GPTQ; ditq quantize's options of the same names)"
    )
    calibration.add_argument(
        "--calibration-seeds",
        type=_as_given(seeds_type),
        metavar="S[,S...]",
        help="the seeds each fixture is run at, e.g. 0,1 or 0-3 (default: quantize's, 0,1)",
    )
    calibration.add_argument(
        "--calibration-steps",
        type=int,
        metavar="N",
        help="denoising steps a request (default: quantize's, 8)",
    )
    calibration.add_argument(
        "--calibration-memory",
        type=_as_given(memory_size_type),
        metavar="SIZE",
        help="the input Hessians held at once, e.g. 16GiB (default: quantize's)",
    )
    parser.add_argument("--fixtures", type=Path, required=True, help="fixtures JSON")
    parser.add_argument("--refs", type=Path, required=True, help="directory of reference images, REF.png")
    parser.add_argument("--out", type=Path, required=True, help="sweep directory (rerun to resume)")
    parser.add_argument(
        "--endpoint-for",
        action="append",
        default=[],
        metavar="SCHEME=URL",
        help="probe this scheme through a server already running (e.g. vLLM-Omni) instead of starting one",
    )
    parser.add_argument(
        "--note", help="a sentence for the top of the report (e.g. that the weights are random)"
    )
    parser.add_argument(
        "--variant",
        metavar="NAME",
        help="the model's NAME variant weights (e.g. fp16: *.fp16.safetensors), as diffusers' "
        "from_pretrained(variant=...) reads them: the baseline's server, the in-process pair, quantize and "
        "the candidates' servers all read it (default: the default files)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        help="the candidates' servers run quantized attention (ditq serve --attention); the baseline keeps the "
        "model's own, so the report judges the two together (default: the model's own attention)",
    )
    parser.add_argument(
        "--parallel",
        metavar="cp=N",
        help="every server the sweep starts, the baseline's too, serves over N devices (ditq serve --parallel); "
        "the report compares device-seconds where a run's device count differs from its baseline's (default: one "
        "device each)",
    )
    parser.add_argument(
        "--kv-cache",
        choices=KV_CACHE_CHOICES,
        help="the candidates' servers keep the prefix KV cache in 8 bits (ditq serve --kv-cache); the baseline "
        "keeps the model's own (default: the model's own cache)",
    )
    parser.add_argument(
        "--lora",
        metavar="PATH[:SCALE]",
        help="a LoRA adapter (a .safetensors file or a folder holding one) every server loads at SCALE (default 1), "
        "the baseline's too: each candidate with it is judged against the source with it (ditq serve --lora)",
    )
    add_api_key_argument(
        parser,
        "the key every server the sweep starts requires and every probe and baseline sends, --endpoint-for "
        "servers too; without it the sweep's servers require none, whatever DITQ_API_KEY says",
    )
    add_sweep_arguments(parser, device="auto")


def _as_given(read: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that keeps the text as given, once ``read`` (the type ``ditq quantize`` gives the option of
    the same name) has taken it: quantize is handed the same words, refused here first."""

    def checked(text: str) -> str:
        read(text)
        return text

    return checked


def print_verdicts(result: ReportResult) -> None:
    print_summary(result.data.document)
    print(f"report: {result.html}")


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the servers the sweep started are stopped on the way out."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def run(args: argparse.Namespace) -> int:
    from ditq.runtime.lora_adapters import LoraSpec
    from ditq.sweep import SweepOptions, check_seeds, parse_endpoint_for, run_sweep
    from ditq.sweep.options import Calibration, candidate_name

    check_seeds(args.seeds, args.max_seeds)  # before the model is looked for (on the hub, say)
    schemes = tuple(
        dict.fromkeys(candidate_name(s, args.calibrate) for s in args.schemes.split(",") if s.strip())
    )
    options = SweepOptions(
        model=resolve_model(args.model, args.variant),
        schemes=schemes,
        fixtures=args.fixtures,
        refs=args.refs,
        out=args.out,
        seeds=args.seeds,
        max_seeds=args.max_seeds,
        steps=args.steps,
        cfg=args.cfg,
        load=load_options_from_args(
            args,
            device=str(resolve_device(args.device)),
            offload="none",  # the ladder is the sweep's own
        ),
        offload=args.offload,
        note=args.note,
        endpoint_for=parse_endpoint_for(args.endpoint_for),
        parity_db=args.parity_db,
        parity_pair=tuple(args.parity_pair) if args.parity_pair else None,
        parity_in_process=args.parity_in_process,
        objective=args.objective,
        standard=args.standard,
        health_timeout_s=args.health_timeout,
        progress=not args.no_progress,
        plan=args.plan,
        parallel=args.parallel,
        api_key=args.api_key,
        lora=None if args.lora is None else LoraSpec.of_path(args.lora, "adapter"),
        calibration=Calibration(args.calibration_seeds, args.calibration_steps, args.calibration_memory),
    )
    stop_on_sigterm()
    print_verdicts(run_sweep(options))
    return 0
