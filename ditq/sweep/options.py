"""The sweep's options, checked once, and the command lines of the servers it starts."""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ditq.checkpoint.layout import check_components_present, read_model_index
from ditq.devices import OFFLOAD_MODES
from ditq.errors import InputError
from ditq.judge.compare import MAX_SEEDS
from ditq.probe.fixtures import DEFAULT_SEEDS, load_fixtures, parse_seeds
from ditq.quantization.plan_file import PlanFile, read_plan
from ditq.runtime.lora_adapters import LoraSpec, refuse_beside_lora
from ditq.runtime.options import LoadOptions
from ditq.runtime.parallel import parse_parallel, refuse_beside_parallel
from ditq.schemes import CHANNEL, GroupSize, Scheme, get_scheme

SCHEME_STAGES = ("quantize", "verify", "doctor", "serve", "probe", "gate", "compare")
# Every answer is an interval over seeds (fidelity) or over requests (speed): one seed decides nothing.
MIN_SEEDS = 2
PLAN_CANDIDATE = "plan"  # the directory (and candidate name) of --plan's mixed-precision candidate
# ``--schemes fp8,fp8-fast``: a scheme's candidate served with ``--accumulate fast`` beside the exact one, so that one
# sweep judges both; only fp8 has fast-accumulating kernel paths (``scaled-mm-fp8-fast``)
FAST = "-fast"
FAST_SCHEMES = ("fp8",)
# ``--schemes w4a8,w4a8-gptq`` (or ``--calibrate gptq``): a scheme's candidate quantized with GPTQ's calibrated
# rounding on the sweep's fixtures (``ditq quantize --calibrate gptq``) beside the round-to-nearest one; int weights
GPTQ = "-gptq"
# ``--schemes w4a8,w4a8-channel``: a 4-bit scheme's candidate stored with one scale per output channel (``ditq
# quantize --group-size channel``) beside its groups of 128; with GPTQ, ``w4a8-channel-gptq`` (the one order). The
# 8-bit schemes are per channel already.
CHANNEL_SUFFIX = "-" + CHANNEL
SUFFIXES = (FAST, GPTQ, CHANNEL_SUFFIX)


def candidate_name(text: str, calibrate: str = "rtn") -> str:
    """A ``--schemes`` entry as its candidate's name: a scheme (``get_scheme``'s spelling), ``SCHEME-fast`` for the
    schemes that accumulate fast, ``SCHEME-gptq`` for int-weight schemes rounded by GPTQ (every int-weight
    scheme's under ``calibrate`` gptq), ``SCHEME-channel`` for a 4-bit scheme with one scale per output channel, or
    ``SCHEME-channel-gptq`` (``SCHEME-gptq-channel`` is read as it); anything else is refused in one line naming
    it."""
    text = text.strip()
    base, suffixes = text, set()
    while (suffix := next((s for s in SUFFIXES if base.endswith(s)), None)) is not None:
        if suffix in suffixes:
            raise InputError(f"--schemes {text}: {suffix.lstrip('-')} is named twice", field="schemes")
        suffixes.add(suffix)
        base = base.removesuffix(suffix)
    scheme = _suffixed_scheme(text, base)
    if FAST in suffixes and scheme.name not in FAST_SCHEMES:
        raise InputError(
            f"--schemes {text}: fast accumulation is {', '.join(FAST_SCHEMES)}'s only ({scheme.name} has no "
            f"fast-accumulating kernel path)",
            field="schemes",
        )
    if GPTQ in suffixes and scheme.weight_type != "int":
        raise InputError(
            f"--schemes {text}: GPTQ rounds int weights; {scheme.name}'s are not", field="schemes"
        )
    if CHANNEL_SUFFIX in suffixes and scheme.num_bits != 4:
        raise InputError(
            f"--schemes {text}: one scale per output channel is the 4-bit schemes' option (w4a16, w4a8); "
            f"{scheme.name}'s weights are per output channel already",
            field="schemes",
        )
    if calibrate == "gptq" and scheme.weight_type == "int":
        suffixes.add(GPTQ)
    return scheme.name + "".join(s for s in (CHANNEL_SUFFIX, GPTQ, FAST) if s in suffixes)


def _suffixed_scheme(text: str, base: str) -> Scheme:
    """The scheme ``base`` names; where it is a scheme and a misspelled suffix (``w4a8-chanel``), the suffix is what
    is refused, with the one it is closest to; anything else is ``get_scheme``'s refusal."""
    try:
        return get_scheme(base)
    except InputError as unknown:
        head, _, word = base.rpartition("-")
        try:
            get_scheme(head)
        except InputError:
            raise unknown from None  # not a scheme with a suffix: get_scheme's own refusal
        close = difflib.get_close_matches(word, [s.lstrip("-") for s in SUFFIXES], n=1)
        if not close:
            raise unknown from None
        raise InputError(
            f"--schemes {text}: unknown suffix -{word} (a candidate takes {', '.join(SUFFIXES)}); did you mean "
            f"-{close[0]}?",
            field="schemes",
        ) from None


def candidate_scheme(name: str) -> str:
    """The scheme a uniform candidate quantizes with: ``fp8`` for both ``fp8`` and ``fp8-fast``, ``w4a8`` for
    ``w4a8-gptq``, ``w4a8-channel`` and ``w4a8-channel-gptq``."""
    return name.removesuffix(FAST).removesuffix(GPTQ).removesuffix(CHANNEL_SUFFIX)


def candidate_group_size(name: str) -> GroupSize | None:
    """The ``--group-size`` a uniform candidate quantizes with: ``channel`` for ``SCHEME-channel[-gptq]``; None
    (the scheme's own) for every other."""
    return CHANNEL if name.removesuffix(GPTQ).endswith(CHANNEL_SUFFIX) else None


def shared_candidate(options: SweepOptions, name: str) -> str | None:
    """The candidate whose artifact candidate ``name`` serves rather than quantizing its own: ``fp8`` for
    ``fp8-fast`` when fp8 is swept too (the same weights; at full size an artifact is 17 GB of disk); else None."""
    base = candidate_scheme(name)
    return base if name.endswith(FAST) and base in options.schemes else None


def candidate_options(options: SweepOptions, name: str) -> SweepOptions:
    """The sweep's options as candidate ``name``'s servers open the model: a ``-fast`` candidate's with
    ``--accumulate fast``, every other one's as they are."""
    if not name.endswith(FAST) or options.load.accumulate == "fast":
        return options
    return dataclasses.replace(options, load=options.load.replace(accumulate="fast"))


# (model or artifact dir, port, sweep options, offload mode) -> the server's argv; tests swap it for a
# server that fails
ServeArgv = Callable[[Path, int, "SweepOptions", str], list[str]]


def ditq_argv(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "ditq.cli", *(str(a) for a in args)]


def default_serve_argv(model: Path, port: int, options: SweepOptions, offload: str = "none") -> list[str]:
    # A collapsed image must come back (with a warning) so the gate can judge it: a 500 instead would
    # hide the very failure the sweep exists to show.
    argv = ditq_argv("serve", model, "--host", "127.0.0.1", "--port", str(port), "--on-collapse", "warn")
    if options.parallel is not None:  # every server alike, the baseline's too: ranks take cuda:0 .. cuda:N-1
        argv += ["--parallel", options.parallel, "--device", options.load.device.partition(":")[0]]
    else:
        argv += ["--device", options.load.device]
    argv += ["--offload", offload]
    argv += ["--dtype", options.load.dtype] if options.load.dtype else []
    argv += ["--variant", options.load.variant] if options.load.variant else []
    # quantized attention is the candidates' (the baseline is the model as it ships)
    argv += (
        ["--attention", options.load.attention] if options.load.attention and model != options.model else []
    )
    argv += ["--kv-cache", options.load.kv_cache] if options.load.kv_cache and model != options.model else []
    # the step cache is the candidates' (the baseline computes every step); auto is searched setting by setting
    # (``ditq.sweep.step_cache``), each sweep's servers given one
    argv += ["--cache", options.load.cache] if options.load.cache and model != options.model else []
    argv += (
        ["--accumulate", options.load.accumulate]
        if options.load.accumulate != "exact" and model != options.model
        else []
    )
    # compiled or not, every server alike (the baseline's too): speeds compare like with like
    argv += ["--compile", "--compile-backend", options.load.compile] if options.load.compile else []
    # the largest output and the most references the fixtures ask for: each server calibrates the shapes it will
    # be sent, no larger
    argv += ["--max-pixels", str(options.max_pixels)] if options.max_pixels else []
    argv += ["--max-references", str(options.max_references)] if options.max_references is not None else []
    # the adapter every server serves with, the baseline's too: each candidate is judged against the source with it
    argv += ["--lora", options.lora.argument] if options.lora is not None else []
    return argv + (["--max-memory", options.load.max_memory] if options.load.max_memory else [])


@dataclass(frozen=True)
class Calibration:
    """How a GPTQ candidate's quantize gathers its Hessians: ``ditq quantize``'s calibration options, None where
    the sweep leaves quantize's default (seeds 0,1; 8 steps a request; its --calibration-memory default, which
    depends on the candidate's --offload)."""

    seeds: str | None = None  # as --calibration-seeds reads it (0,1 or 0-3)
    steps: int | None = None
    memory: str | None = None  # a size (16GiB)

    def flags(self) -> list[str]:
        """The options given, as quantize takes them."""
        pairs = (("--calibration-seeds", self.seeds), ("--calibration-steps", self.steps),
                 ("--calibration-memory", self.memory))  # fmt: skip
        return [part for flag, value in pairs if value is not None for part in (flag, str(value))]


@dataclass(frozen=True)
class SweepOptions:
    model: Path
    schemes: tuple[str, ...]
    fixtures: Path
    refs: Path
    out: Path
    seeds: str | None = None  # as `ditq probe --seeds` reads it, or "auto"; None: the probe's default
    max_seeds: int = MAX_SEEDS  # --seeds auto: the most seeds a fixture may get
    steps: int | None = None
    cfg: float | None = None
    # how every server opens the model (``ditq serve``'s flags; the device resolved: cpu, cuda, cuda:1, ...; the
    # quantizer and the doctor run there too): its offload is the ladder's (below); attention, kv_cache and
    # accumulate are the candidates' servers' only (the baseline is the model as it ships)
    load: LoadOptions = field(default_factory=lambda: LoadOptions(device="cpu"))
    # the offload ladder: each mode serves what ran out of memory at the one before
    offload: tuple[str, ...] = ("none",)
    note: str | None = None  # said at the top of the report (e.g. that the weights are random)
    endpoint_for: dict[str, str] = field(default_factory=dict)  # scheme -> URL of a server already running
    parity_db: float | None = None  # the parity band's PSNR (a BF16 reference pair's), stated
    parity_pair: tuple[Path, Path] | None = None  # two acceptable reference runs that span the band
    # the band from the baseline and the model run in process in bfloat16 (OUT/parity-in-process)
    parity_in_process: bool = False
    objective: Literal["fit", "speed", "memory"] = "fit"  # what the report's headline verdict answers
    standard: Literal["lossless", "parity"] = "lossless"  # the fidelity standard of fit to serve
    health_timeout_s: float = 600.0
    request_timeout_s: float | None = None
    progress: bool = True
    plan: Path | None = None  # a PLAN.json (`ditq plan`): one more candidate, quantized with it
    # the PLAN.json read once, here (a bad plan is refused before anything runs); None without --plan
    plan_file: PlanFile | None = field(init=False, default=None, repr=False, compare=False)
    # the largest width * height, and the most references, a fixture asks for: every server's --max-pixels and
    # --max-references (read with the fixtures, here)
    max_pixels: int | None = field(init=False, default=None, repr=False, compare=False)
    max_references: int | None = field(init=False, default=None, repr=False, compare=False)
    parallel: str | None = None  # every server's --parallel (cp=N), the baseline's too; None: one device each
    # the key every server the sweep starts requires and every probe and baseline sends (--endpoint-for's too);
    # passed through the environment, never on a command line or in a file
    api_key: str | None = field(default=None, repr=False)
    # --lora: a LoRA adapter every server loads (ditq serve --lora), the baseline's too; its probes' requests leave
    # the request field out, so each is drawn with it at its scale
    lora: LoraSpec | None = None
    serve_argv: ServeArgv = default_serve_argv
    # the folder of an earlier sweep of the same model whose candidates' artifacts this one serves instead of
    # quantizing its own (``--cache auto``'s sweep per setting: ``ditq.sweep.step_cache``); None: its own
    artifacts_from: Path | None = None
    # ``ditq quantize``'s --calibration-seeds, --calibration-steps and --calibration-memory, as given, for every
    # candidate GPTQ rounds (None: quantize's defaults)
    calibration: Calibration = field(default_factory=Calibration)

    def __post_init__(self) -> None:
        check_seeds(self.seeds, self.max_seeds)
        if not self.schemes:
            raise InputError("--schemes: name at least one scheme (w8a16, w8a8, fp8)")
        for name in self.schemes:
            if candidate_name(name) != name:
                raise InputError(f"--schemes {name}: name it as {candidate_name(name)}", field="schemes")
        unknown = set(self.endpoint_for) - set(self.schemes)
        if unknown:
            raise InputError(f"--endpoint-for: {sorted(unknown)[0]!r} is not one of the swept schemes")
        if sum((self.parity_db is not None, self.parity_pair is not None, self.parity_in_process)) > 1:
            raise InputError("--parity-db, --parity-pair and --parity-in-process: give one of them")
        if self.seeds == "auto":
            if self.parity_pair is not None:
                raise InputError(
                    "--seeds auto: the sweep cannot add seeds to --parity-pair's runs; "
                    "use --parity-db or --parity-in-process"
                )
            if self.standard == "parity" and self.parity_db is None and not self.parity_in_process:
                raise InputError(
                    "--seeds auto --standard parity: needs a parity band to decide on (--parity-db or "
                    "--parity-in-process)"
                )
        if self.load.cache == "auto" and self.seeds == "auto":
            raise InputError(
                "--cache auto with --seeds auto: give the seeds (every setting is judged on the same ones)",
                field="cache",
            )
        if self.load.cache == "auto" and self.endpoint_for:
            raise InputError(
                "--cache auto with --endpoint-for: a server already running cannot be given a setting",
                field="cache",
            )
        unknown_modes = [m for m in self.offload if m not in OFFLOAD_MODES]
        if not self.offload or unknown_modes or len(set(self.offload)) != len(self.offload):
            raise InputError(
                f"--offload: {','.join(self.offload) or 'nothing'} is not a list of distinct modes "
                f"from {', '.join(OFFLOAD_MODES)} (e.g. none,model,block)"
            )
        if self.parallel is not None:
            refuse_beside_parallel(
                parse_parallel(self.parallel),
                ",".join(self.offload),
                self.load.max_memory,
                self.load.attention,
                self.load.compile,
                self.load.cache,
            )
        self._check_budgets()
        self._check_lora()
        for path, what in ((self.model, "model"), (self.fixtures, "--fixtures"), (self.refs, "--refs")):
            if not Path(path).exists():
                raise InputError(f"{what}: {path} does not exist")
        index = read_model_index(self.model)
        check_components_present(self.model, index)  # a model, before a server loads it
        fixtures = load_fixtures(
            self.fixtures, self.refs
        )  # every field and reference checked before a server starts
        object.__setattr__(self, "max_pixels", max(f.width * f.height for f in fixtures.values()))
        object.__setattr__(self, "max_references", max(len(f.references) for f in fixtures.values()))
        if self.plan is not None:
            object.__setattr__(self, "plan_file", read_plan(self.plan))
        self._check_steps(index)

    def _check_steps(self, index: dict[str, Any]) -> None:
        """--steps and --calibration-steps that the model's scheduler (``index``'s, made from its config once)
        cannot take (a NaN sigma: one step for Qwen-Image), before the baseline runs: every server would answer
        400, and GPTQ would calibrate on NaN image tokens."""
        from ditq.calibration import check_scheduler_steps
        from ditq.runtime.adapter import model_scheduler

        scheduler = (
            model_scheduler(self.model, index)
            if self.steps is not None or self.calibration.steps is not None
            else None
        )
        if self.steps is not None:
            check_scheduler_steps(scheduler, self.steps, "--steps")
        self._check_calibration()
        if self.calibration.steps is not None:
            check_scheduler_steps(scheduler, self.calibration.steps)

    def _check_budgets(self) -> None:
        """Steps, timeouts and --max-memory, as the servers and probes would read them, before any starts."""
        from ditq.devices import parse_memory_size  # ditq serve's parser of --max-memory

        if self.steps is not None and self.steps < 1:
            raise InputError(f"--steps: at least 1, got {self.steps}")
        for value, flag in (
            (self.health_timeout_s, "--health-timeout"),
            (self.request_timeout_s, "--timeout"),
        ):
            if value is not None and not value > 0:
                raise InputError(f"{flag}: a positive number of seconds, got {value:g}")
        if self.load.max_memory is not None:
            parse_memory_size(self.load.max_memory)
            if not self.load.device.startswith("cuda"):
                raise InputError(
                    f"--max-memory {self.load.max_memory}: caps accelerator memory; device '{self.load.device}' has none to cap"
                )

    def _check_calibration(self) -> None:
        """The calibration's options only where a candidate is rounded by GPTQ (with them, quantize's requests)."""
        given = self.calibration.flags()
        plan_gptq = self.plan_file is not None and self.plan_file.rounding.method == "gptq"
        if given and not any(name.endswith(GPTQ) for name in self.schemes) and not plan_gptq:
            raise InputError(
                f"{given[0]}: no candidate of this sweep is rounded by GPTQ (--calibrate gptq, a SCHEME-gptq "
                "scheme or a --plan rounded by GPTQ)"
            )
        if self.calibration.steps is not None and self.calibration.steps < 1:
            raise InputError(f"--calibration-steps: at least 1, got {self.calibration.steps}")
        if self.calibration.seeds is not None:  # the judged images are never the calibrated ones
            start = parse_seeds(DEFAULT_SEEDS if self.seeds in (None, "auto") else self.seeds)
            # --seeds auto numbers its seeds on from the default's highest, up to --max-seeds a fixture (seeds_to_add)
            top = max(start)
            added = (
                range(top + 1, top + 1 + self.max_seeds - len(start)) if self.seeds == "auto" else range(0)
            )
            probed = {*start, *added}
            shared = sorted(probed & set(parse_seeds(self.calibration.seeds)))
            if shared:
                raise InputError(
                    f"--calibration-seeds {self.calibration.seeds}: seed {shared[0]} is one the probes judge "
                    "(calibrate at others: the default is 0,1)"
                )

    def _check_lora(self) -> None:
        """--lora beside what would draw an image without the adapter, or serve it where ditq serve will not."""
        if self.lora is None:
            return
        refuse_beside_lora(
            "swept",
            ",".join(self.offload),
            self.load.compile,
            ("--endpoint-for", bool(self.endpoint_for)),  # a server started elsewhere, without it
            ("--parity-in-process", self.parity_in_process),  # the in-process run has no adapter
            ("--parallel", self.parallel is not None),
        )

    @property
    def candidates(self) -> tuple[str, ...]:
        """Every candidate's name (its directory): the schemes, a ``-fast`` one after the others (it may serve
        their artifact: ``shared_candidate``), then the plan's."""
        ordered = sorted(
            self.schemes, key=lambda name: name.endswith(FAST)
        )  # stable: the given order otherwise
        return (*ordered, *((PLAN_CANDIDATE,) if self.plan is not None else ()))


def check_seeds(seeds: str | None, max_seeds: int = MAX_SEEDS) -> list[int]:
    """``--seeds`` as a sweep reads it (``parse_seeds``, or ``auto``: the default seeds, then more up to
    ``max_seeds``): the seeds it starts from, refused in one line before anything runs where unreadable."""
    start = parse_seeds(DEFAULT_SEEDS if seeds in (None, "auto") else seeds)
    if seeds == "auto" and max_seeds < len(start):
        raise InputError(
            f"--max-seeds: at least {len(start)} (the seeds --seeds auto starts from), got {max_seeds}"
        )
    return start


def seeds_warning(seeds: str | None) -> str | None:
    """What a sweep says first when its seeds can decide no answer (one seed: every answer is an interval over
    seeds or requests, which needs two); None when they can. Such a sweep still measures capacity and memory."""
    start = check_seeds(seeds)
    if len(start) >= MIN_SEEDS:
        return None
    return (
        f"--seeds {seeds}: {len(start)} seed decides no fidelity or speed answer (each is an interval over seeds, "
        f"which needs at least {MIN_SEEDS}), so every one will be UNDECIDED; this sweep measures capacity and "
        f"memory. Give {MIN_SEEDS} or more (2301-2304, say) or auto to decide them."
    )


def parse_endpoint_for(values: Sequence[str]) -> dict[str, str]:
    out = {}
    for value in values:
        scheme, sep, url = value.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise InputError(f"--endpoint-for {value!r}: expected SCHEME=http://HOST:PORT")
        out[candidate_name(scheme)] = url.rstrip("/")
    return out
