"""Mixed-precision plans: measured per-layer sensitivity and the scheme each Linear gets (``ditq plan``), read by
``ditq quantize --plan`` and ``ditq sweep --plan``. The file: ``ditq.quantization.plan_file.PlanFile``."""

from ditq.quantization.plan_file import (
    KEEP,
    PLAN_FILE,
    PLAN_FORMAT,
    LayerSensitivity,
    PlanCalibration,
    PlanCost,
    PlanFile,
    PlanRounding,
    PlanTarget,
    PlanVerification,
    ProxyCalibration,
    parse_plan,
    plan_bytes,
    plan_sha256,
    read_plan,
    write_plan,
)

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
    "read_plan",
    "write_plan",
]
