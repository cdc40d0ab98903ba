"""Command-line layers, one module per sub-command: argument parsing over the Python API, nothing more."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ditq.runtime.options import LoadOptions

__all__ = [
    "ACCUMULATE_CHOICES",
    "ATTENTION_CHOICES",
    "COMPILE_BACKENDS",
    "KV_CACHE_CHOICES",
    "LOAD_FLAGS",
    "MAX_SEEDS",
    "PLAN_SCHEMES",
    "SCHEME_NAMES",
    "TOLERANCE_DB",
    "add_accumulate_argument",
    "add_attention_argument",
    "add_compile_argument",
    "add_kv_cache_argument",
    "add_load_arguments",
    "add_step_cache_argument",
    "add_variant_argument",
    "compile_backend",
    "load_options_from_args",
]

# What the parsers show, without importing torch (so that `ditq COMMAND --help` answers at once); each equals the
# value where it is defined, which tests/test_cli_help.py checks.
ATTENTION_CHOICES = ("int8", "fp8", "int8-fp8", "fp8-fp8")  # ditq.kernels.attention.ATTENTION_KINDS
ACCUMULATE_CHOICES = ("exact", "fast")  # ditq.kernels.registry.ACCUMULATE_MODES
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # ditq.runtime.compile.COMPILE_BACKENDS
KV_CACHE_CHOICES = ("int8", "fp8")  # ditq.runtime.kv_cache.KV_CACHE_KINDS
SCHEME_NAMES = ("w8a16", "w8a8", "fp8", "w4a16", "w4a8")  # ditq.schemes.SCHEMES
PLAN_SCHEMES = ("fp8", "w8a8", "w8a16")  # ditq.plan.planner.DEFAULT_SCHEMES: fastest first
MAX_SEEDS = 16  # ditq.judge.compare.MAX_SEEDS
TOLERANCE_DB = 1.0  # ditq.judge.compare.TOLERANCE_DB


def add_variant_argument(parser: argparse.ArgumentParser) -> None:
    """``--variant NAME``, read as ``ditq.runtime.options.LoadOptions`` reads it (the commands that load a model)."""
    parser.add_argument(
        "--variant",
        metavar="NAME",
        help="read each component's NAME variant weights (e.g. fp16: *.fp16.safetensors) where it has them, as "
        "diffusers' from_pretrained(variant=...) does (default: the variant an artifact records, else the "
        "default files)",
    )


def add_attention_argument(parser: argparse.ArgumentParser) -> None:
    """``--attention int8|fp8|int8-fp8|auto`` (default off), as ``ditq.doctor.attention.attention_chooser`` and
    ``ditq.runtime.attention.install_attention`` read it."""
    parser.add_argument(
        "--attention",
        choices=(*ATTENTION_CHOICES, "auto"),
        help="quantized attention (opt-in): 8-bit Q.K^T with smoothed keys and per-token scales, float32 "
        "softmax, P.V in the compute dtype (int8-fp8: P.V in e4m3 too, V per channel; fp8-fp8: e4m3 Q.K^T, P.V "
        "and output with one scale per tensor, cuDNN's fp8 flash attention on sm_90 with pip install "
        "'ditq[cudnn]'), through the doctor-chosen path; auto: int8, else int8-fp8, else fp8-fp8 (the more "
        "faithful first), whichever is first faster than the model's own attention at the served shapes on this "
        "device, timed at start-up (default: the model's own attention)",
    )


def add_accumulate_argument(parser: argparse.ArgumentParser) -> None:
    """``--accumulate exact|fast`` (default exact), as ``ditq.runtime.options.LoadOptions`` reads it."""
    parser.add_argument(
        "--accumulate",
        choices=ACCUMULATE_CHOICES,
        default="exact",
        help="fp8 GEMMs' accumulation: exact (full float32 accumulation), or fast (Hopper's fast accumulation, "
        "offered only where the kernel doctor measures its error within a quarter of the scheme's own "
        "quantization error at each layer's shape; never without the doctor) (default: %(default)s)",
    )


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """``--compile`` and ``--compile-backend`` (``ditq.runtime.compile``); ``compile_backend(args)`` reads them."""
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the transformer's repeated blocks, the text encoder's decoder layers and the VAE's decoder with torch.compile; a server compiles and warms up every "
        "shape it calibrates before it is ready (default: off; eager)",
    )
    parser.add_argument(
        "--compile-backend",
        choices=COMPILE_BACKENDS,
        default="inductor",
        help="torch.compile's backend with --compile (default: %(default)s; aot_eager and eager trace the model "
        "without generating code)",
    )


def compile_backend(args: argparse.Namespace) -> str | None:
    """The backend ``--compile`` asked for, or None without it."""
    return args.compile_backend if args.compile else None


def add_kv_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--kv-cache int8|fp8`` (default off), as ``ditq.runtime.kv_cache.install_kv_cache`` reads it."""
    parser.add_argument(
        "--kv-cache",
        choices=KV_CACHE_CHOICES,
        help="keep the transformer's prefix KV cache (text and reference tokens) in 8 bits with per-token, per-head "
        "scales: half its memory (opt-in; default: the model's own cache)",
    )


def add_step_cache_argument(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    """``--cache KIND:VALUE`` (default off), read by ``ditq.runtime.options.LoadOptions`` (``ditq.runtime.step_cache``
    parses it); ``auto`` where the command searches a setting (``ditq sweep``, ``ditq demo``)."""
    search = (
        "; auto: the candidates' servers try first-block thresholds from the smallest up, and each scheme keeps the "
        "largest whose fidelity stays inside --standard (OUT/STEP_CACHE.json)"
        if auto
        else ""
    )
    parser.add_argument(
        "--cache",
        metavar="first-block:T|taylorseer:N[:W]" + ("|auto" if auto else ""),
        help="serve denoising steps from diffusers' step cache (opt-in): first-block:T skips every block but the "
        "first where the first block's residual moved by less than T since the last computed step; "
        "taylorseer:N[:W] computes attention on the first W calls (default 3), then every Nth, and predicts it in "
        "between. The prefix KV cache's extract step is always computed; each request's skipped steps are "
        f"reported{search} (default: every step computed)",
    )
    parser.set_defaults(cache_search=auto)


# Every flag of how a pipeline is opened (``ditq.runtime.options.LoadOptions``'s fields, as the command line names
# them), in the order --help shows them. A command takes the ones it offers.
LOAD_FLAGS = (
    "device",
    "dtype",
    "offload",
    "variant",
    "attention",
    "kv_cache",
    "cache",
    "compile",
    "accumulate",
    "max_memory",
    "skip_doctor",
)
_FLAG_HELP = {
    "max_memory": "cap the accelerator memory this process may use, e.g. 24GiB (CUDA only)",
    "skip_doctor": "use kernel paths without the kernel doctor's check (warns)",
}


def add_load_arguments(
    parser: argparse.ArgumentParser,
    what: str = "where to generate",
    device: str = "auto",
    flags: Collection[str] = LOAD_FLAGS,
    helps: Mapping[str, str] | None = None,
) -> None:
    """The flags of how a pipeline is opened that a command offers (``flags``, of LOAD_FLAGS), read back by
    ``load_options_from_args``. ``what`` and ``device`` are --device's help and default; ``helps`` a command's
    own words for --max-memory or --skip-doctor."""
    from ditq.devices import add_device_arguments

    unknown = set(flags) - set(LOAD_FLAGS)
    assert not unknown, f"not load flags: {sorted(unknown)}"
    words = {**_FLAG_HELP, **(helps or {})}
    if "device" in flags:
        add_device_arguments(parser, device, what, dtype="dtype" in flags, offload="offload" in flags)
    adders = {
        "variant": add_variant_argument,
        "attention": add_attention_argument,
        "kv_cache": add_kv_cache_argument,
        "cache": add_step_cache_argument,
        "compile": add_compile_argument,
        "accumulate": add_accumulate_argument,
    }
    for flag in LOAD_FLAGS:
        if flag in flags and flag in adders:
            adders[flag](parser)
    if "max_memory" in flags:
        parser.add_argument("--max-memory", metavar="SIZE", help=words["max_memory"])
    if "skip_doctor" in flags:
        parser.add_argument("--skip-doctor", action="store_true", help=words["skip_doctor"])


def load_options_from_args(args: argparse.Namespace, **overrides: Any) -> LoadOptions:
    """The ``LoadOptions`` of a command's load flags (``add_load_arguments``); a flag the command does not offer
    keeps LoadOptions' default, and ``overrides`` are the command's own fixed choices (the baseline's bfloat16)."""
    from ditq.runtime.options import LoadOptions

    given: dict[str, Any] = {name: getattr(args, name) for name in LOAD_FLAGS if hasattr(args, name)}
    if given.get("cache") == "auto" and not getattr(args, "cache_search", False):
        from ditq.runtime.step_cache import parse_step_cache

        parse_step_cache("auto")  # refused in one line: only a sweep searches a setting
    if "compile" in given:
        given["compile"] = compile_backend(args)
    return LoadOptions(**{**given, **overrides})
