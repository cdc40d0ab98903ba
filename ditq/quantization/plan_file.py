"""PLAN.json, typed: what ``ditq plan`` writes and ``ditq quantize --plan`` / ``ditq sweep --plan`` read.

A plan names one component (the DiT, ``transformer`` by default) and, for every Linear the quantizer's structural
rule would quantize, the scheme it gets or ``keep`` (left in the source precision). Layers the plan does not
name are left as the structural rule leaves them (kept). The sensitivity table and the verification are the
evidence for the assignment: each layer's measured error under each candidate scheme, and the final mixed
model's end-to-end PSNR against the source precision, per fixture.

Example (abridged)::

    {"format": "ditq-plan-1", "component": "transformer", "schemes": ["fp8", "w8a8"],
     "target": {"kind": "parity", "db": 49.3},
     "layers": {"blocks.0.attn.to_q": "fp8", "blocks.0.ff.net.2": "w8a8", "blocks.7.attn.to_out.0": "keep"},
     "sensitivity": [{"layer": "blocks.0.attn.to_q", "params": 65536, "proxy": {"fp8": 0.004, "w8a8": 0.002}}],
     "verification": {"psnr_db": {"edit-recolor": 49.8}, "min_db": 49.8, "meets_target": true, "seeds": [2301]}}
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ditq.errors import InputError
from ditq.fsutil import atomic_write_bytes
from ditq.jsonfile import JsonRefused, read_json
from ditq.schemes import SCHEMES

__all__ = [
    "KEEP",
    "PLAN_FILE",
    "PLAN_FORMAT",
    "LayerSensitivity",
    "PlanCalibration",
    "PlanCost",
    "PlanFile",
    "PlanRounding",
    "PlanTarget",
    "PlanVerification",
    "ProxyCalibration",
    "parse_plan",
    "plan_bytes",
    "plan_sha256",
    "planned_rounding",
    "read_plan",
    "write_plan",
]

PLAN_FORMAT: Final = "ditq-plan-1"
KEEP = "keep"  # a layer left in the source precision
# its name beside a sweep's planned candidate (what it is, the file says itself: ``format``)
PLAN_FILE = "PLAN.json"


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Finite = Annotated[float, Field(allow_inf_nan=False)]  # a target: NaN would pass or fail every comparison


class PlanTarget(_Plan):
    """The fidelity the plan must meet: the lowest per-fixture PSNR (dB) against the source precision.
    ``parity``: ``db`` is the parity band's floor (the in-process BF16 pair); ``db``: the user's ``--target-db``."""

    kind: Literal["parity", "db"]
    db: Finite
    # per fixture, the PSNR (dB) it must reach: the band's floor for that fixture (its pair's mean minus compare's
    # tolerance) under ``parity``, ``db`` for every fixture under ``db``; the search aims ``margin_db`` above it
    per_fixture_db: dict[str, Finite] = {}
    margin_db: Finite = 0.0


class LayerSensitivity(_Plan):
    """One Linear (or one block's Linears, ``unit="block"``), measured alone: only it quantized, the rest in the
    source precision. ``proxy``: the transformer output's relative L2 error over the first steps, per scheme;
    ``psnr_db``: the final image's PSNR against the source precision, per scheme, where it was measured."""

    layer: str
    unit: Literal["layer", "block", "component"] = "layer"
    params: int = Field(ge=0)
    proxy: dict[str, float]
    psnr_db: dict[str, float] = {}


class PlanVerification(_Plan):
    """The final mixed model run end to end on the fixtures: PSNR per fixture (mean over ``seeds``, and
    ``seeds_added`` where the verification added some)."""

    psnr_db: dict[str, float]
    min_db: float
    meets_target: bool
    seeds: list[int]
    # under a parity target: the seeds the verification added to a fixture it left undecided (the fixture's
    # PSNR and decision are over ``seeds`` and these)
    seeds_added: dict[str, list[int]] = {}
    # under a parity target: compare's decision per fixture (inside, outside, undecided) on its seeds
    decisions: dict[str, str] = {}
    # search-and-verify rounds run; the result above is the kept round's (the cheapest that met the target: the
    # most quantized, then the most parameters at the fastest scheme)
    rounds: int = Field(default=1, ge=1)
    artifact: bool = False  # True: run from a checkpoint `ditq quantize --plan` wrote, loaded by the runtime


class ProxyCalibration(_Plan):
    """How the proxy predicts the image: per fixture, PSNR = offset_db - 10 log10(sum of the quantized layers'
    proxy^2), fitted on the units whose images were measured; its median absolute error and the rank correlation
    of proxy and PSNR over those units (``points`` of them: unit x scheme x fixture)."""

    offset_db: dict[str, float]
    residual_db: float | None
    spearman: float | None
    points: int = Field(ge=0)
    # per fixture, the unquantized replay of the recorded calls against the run's own outputs (relative L2): what
    # replaying computes differently (a dropped cache, batching); the proxy is taken against the replay itself
    replay_vs_run: dict[str, float] = {}


class PlanCalibration(_Plan):
    """The calibration requests GPTQ's Hessians came from (``calibrated.Calibration.manifest``): the fixtures (ids
    and their digest, references included), the seeds each ran at, the denoising steps, GPTQ's damping and column
    order. ``ditq quantize --plan`` runs the same requests, so that its rounding is the one measured."""

    method: Literal["gptq"] = "gptq"
    fixtures: list[str]
    fixtures_digest: str
    seeds: list[int]
    steps: int = Field(ge=1)
    requests: int = Field(ge=1)
    damp: float = Field(gt=0, lt=1)
    act_order: bool


class PlanRounding(_Plan):
    """How the plan's layers were rounded when their sensitivity was measured, which is how ``ditq quantize
    --plan`` rounds them. ``rtn``: round to nearest; ``gptq``: every int-weight layer (w4a16, w4a8, w8a16, w8a8)
    GPTQ-rounded from the input Hessians of ``calibration``'s requests, fp8 layers to nearest. ``low_rank``: the
    rank of SVDQuant's 16-bit branch beside every 4-bit layer (8-bit layers carry none)."""

    method: Literal["rtn", "gptq"] = "rtn"
    low_rank: int | None = Field(default=None, ge=1)
    calibration: PlanCalibration | None = None

    @model_validator(mode="after")
    def _calibrated(self) -> PlanRounding:
        if (self.method == "gptq") != (self.calibration is not None):
            raise ValueError("calibration: gptq records its calibration requests, rtn none")
        return self


class PlanCost(_Plan):
    """What the search cost: wall seconds, and pipeline or transformer forwards run."""

    seconds: float = Field(ge=0)
    forwards: int = Field(ge=0)
    device: str


class PlanFile(_Plan):
    format: Literal["ditq-plan-1"] = PLAN_FORMAT
    source: str  # the model directory the plan was measured on, as given
    component: str = "transformer"
    schemes: list[str]  # the candidate schemes, fastest first
    target: PlanTarget
    layers: dict[str, str]  # Linear module name -> scheme name or "keep"
    sensitivity: list[LayerSensitivity] = []
    quantized_fraction: float = Field(ge=0.0, le=1.0)  # of the planned Linears' parameters, quantized
    verification: PlanVerification | None = None
    calibration: ProxyCalibration | None = None
    reasons: dict[str, str] = {}  # layer -> why it is not at the fastest scheme (kept or slower)
    cost: PlanCost | None = None
    command: list[str] = []
    rounding: PlanRounding = PlanRounding()  # a plan written before it was recorded: round to nearest

    @model_validator(mode="after")
    def _known_schemes(self) -> PlanFile:
        for name in self.schemes:
            if name not in SCHEMES:
                raise ValueError(f"schemes: unknown scheme {name!r} (known: {', '.join(SCHEMES)})")
        for layer, name in self.layers.items():
            if name != KEEP and name not in self.schemes:
                raise ValueError(f"layers.{layer}: {name!r} is neither 'keep' nor one of schemes")
        bits = {SCHEMES[name].num_bits for name in self.schemes}
        if self.rounding.low_rank is not None and 4 not in bits:
            raise ValueError(
                f"rounding.low_rank: goes with the 4-bit schemes; schemes are {', '.join(self.schemes)}"
            )
        if self.rounding.method == "gptq" and all(
            SCHEMES[name].weight_type != "int" for name in self.schemes
        ):
            raise ValueError(
                f"rounding.method: gptq rounds int weights; schemes are {', '.join(self.schemes)}"
            )
        return self


def planned_rounding(plan: PlanFile, where: str, method: str | None, low_rank: int | None) -> PlanRounding:
    """The plan's rounding, which ``ditq quantize --plan`` applies; ``method`` and ``low_rank`` (``--calibrate``,
    ``--low-rank``; None: not given) may only repeat it: another is a one-line InputError naming the field."""
    rounding = plan.rounding
    if method is not None and method != rounding.method:
        raise InputError(
            f"--calibrate {method}: {where} was measured with rounding.method {rounding.method}; leave the flag "
            "out to quantize it as planned, or plan again with it"
        )
    if low_rank is not None and low_rank != rounding.low_rank:
        planned = (
            "no low-rank branch" if rounding.low_rank is None else f"rounding.low_rank {rounding.low_rank}"
        )
        raise InputError(
            f"--low-rank {low_rank}: {where} was measured with {planned}; leave the flag out to quantize it as "
            "planned, or plan again with it"
        )
    return rounding


def parse_plan(raw: Any, where: str) -> PlanFile:
    """``raw`` (a PLAN.json's parsed JSON) as a PlanFile, or a one-line InputError naming ``where`` and the field."""
    try:
        return PlanFile.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(part) for part in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")  # the cross-field checks name their field
        raise InputError(f"{where}: {location}: {message}" if location else f"{where}: {message}") from None


def _no_nan(constant: str) -> float:
    """No NaN anywhere in a plan; a PSNR may be infinite (two identical images)."""
    if constant == "NaN":
        raise JsonRefused("NaN is not a number a plan can hold")
    return float(constant)


def read_plan(path: str | Path) -> PlanFile:
    """A PLAN.json, typed; a missing, unreadable or invalid file is a one-line InputError naming it and the field."""
    return parse_plan(read_json(Path(path), parse_constant=_no_nan), str(path))


def plan_bytes(plan: PlanFile) -> bytes:
    """The bytes ``write_plan`` writes: the fields that were set, as indented JSON."""
    return (json.dumps(plan.model_dump(mode="json", exclude_unset=True), indent=2) + "\n").encode()


def plan_sha256(plan: PlanFile) -> str:
    """The sha256 of ``plan_bytes``: the digest a PLAN.json written by ``write_plan`` has on disk."""
    return hashlib.sha256(plan_bytes(plan)).hexdigest()


def write_plan(path: str | Path, plan: PlanFile) -> None:
    """Write PLAN.json atomically, as ``read_plan`` reads it."""
    atomic_write_bytes(Path(path), plan_bytes(plan))
