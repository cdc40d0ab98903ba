"""What the doctor tells people: the one-line-per-path table and, for a failing path, a report directory
ready to file upstream (environment, isolation chain, a reproduction that needs no checkpoint, evidence)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ditq.fsutil import DOCTOR_REPORT, atomic_directory, atomic_write_json
from ditq.runfiles import DoctorEnvironment, DoctorPath, to_json, write_model

__all__ = ["repro_command", "table", "write_report"]


def repro_command(path_name: str) -> str:
    return f"ditq doctor --synthetic --kernels {path_name}"


def _chain_text(result: DoctorPath, env: DoctorEnvironment) -> str:
    lines = [
        f"# Kernel path {result.path} ({result.scheme}) failed on {env.gpu or result.device}",
        "",
        f"Verdict: {result.verdict} — {result.reason}",
        f"Capability over-claim: {'yes: the registry offered this path on this device' if result.capability_overclaim else 'no'}",
        f"Reproduce (needs no checkpoint): `{repro_command(result.path)}`",
        "",
        "## Isolation chain (each step checked on its own inputs)",
        "",
        "| step | geometry | weights | dtype | result | detail |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {c.step} | {c.geometry} | {c.weights} | {c.dtype} | {'pass' if c.passed else 'FAIL'} | {c.message} |"
              for c in result.checks]  # fmt: skip
    lines += ["", "## Environment", "", *[f"- {k}: {v}" for k, v in to_json(env).items()], ""]
    return "\n".join(lines)


def write_report(result: DoctorPath, env: DoctorEnvironment, root: Path) -> DoctorPath:
    """A directory ready to file upstream: environment, isolation chain, reproduction command, evidence.
    Returns ``result`` with its ``report_dir``."""
    final = Path(root) / result.path
    result = result.model_copy(update={"report_dir": str(final)})
    with atomic_directory(final, DOCTOR_REPORT, force=True) as tmp:
        write_model(tmp / "environment.json", env)
        atomic_write_json(tmp / "evidence.json", {"environment": to_json(env), **to_json(result)})
        (tmp / "chain.md").write_text(_chain_text(result, env))
        (tmp / "repro.txt").write_text(repro_command(result.path) + "\n")
    return result


def table(results: Sequence[DoctorPath]) -> str:
    """One line per path: verdict, worst rel-L2 against the bound, first failing step, over-claim."""
    head = f"{'path':<28} {'scheme':<9} {'verdict':<7} {'worst rel-L2':>12} {'bound':>6}  {'over-claim':<10} detail"
    lines = [head, "-" * len(head)]
    for r in results:
        worst = "-" if r.worst_rel_l2 is None else f"{r.worst_rel_l2:.2e}"
        checks = f"{sum(c.passed for c in r.checks)}/{len(r.checks)} checks"
        detail = r.reason if r.verdict != "PASS" else checks
        overclaim = "YES" if r.capability_overclaim else "-"
        lines.append(
            f"{r.path:<28} {r.scheme:<9} {r.verdict:<7} {worst:>12} {r.bound:>6g}  {overclaim:<10} {detail}"
        )
    return "\n".join(lines)
