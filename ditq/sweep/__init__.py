"""The sweep stage: ``ditq sweep``, the main job, in the order it runs.

- ``options``: what a sweep is asked (``SweepOptions``, checked once; fixtures before any server starts) and the
  command lines of the servers it starts;
- ``health``: those servers on free loopback ports, waited on through ``/health`` and stopped;
- ``candidate``: one candidate's directory and the record of its stages (``CANDIDATE.json``);
- ``core``: each stage as its own command (skipped when complete), the baseline, the reference pair, judging;
- ``ladder``: serving through the offload ladder and probing each server;
- ``seeds``: ``--seeds auto``, more seeds for undecided fixtures;
- ``run``: a whole sweep, resumed where it stopped, and its report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ditq.lazy import lazy_names

# Public name -> module that defines it, imported on first use (``ditq sweep --help`` imports none of them).
_LAZY: dict[str, str] = {
    "PLAN_CANDIDATE": "ditq.sweep.options",
    "SCHEME_STAGES": "ditq.sweep.options",
    "SweepOptions": "ditq.sweep.options",
    "check_same_model": "ditq.sweep.run",
    "check_seeds": "ditq.sweep.options",
    "default_serve_argv": "ditq.sweep.options",
    "ditq_argv": "ditq.sweep.options",
    "model_fingerprint": "ditq.sweep.run",
    "parse_endpoint_for": "ditq.sweep.options",
    "parse_offload": "ditq.devices",
    "run_sweep": "ditq.sweep.run",
    "check_sweep_output": "ditq.sweep.run",
    "wait_healthy": "ditq.sweep.health",
}

if TYPE_CHECKING:  # the names as their modules define them, for the type checker
    from ditq.devices import parse_offload
    from ditq.sweep.health import wait_healthy
    from ditq.sweep.options import (
        PLAN_CANDIDATE,
        SCHEME_STAGES,
        SweepOptions,
        check_seeds,
        default_serve_argv,
        ditq_argv,
        parse_endpoint_for,
    )
    from ditq.sweep.run import check_same_model, check_sweep_output, model_fingerprint, run_sweep

__all__ = [
    "PLAN_CANDIDATE",
    "SCHEME_STAGES",
    "SweepOptions",
    "check_same_model",
    "check_seeds",
    "check_sweep_output",
    "default_serve_argv",
    "ditq_argv",
    "model_fingerprint",
    "parse_endpoint_for",
    "parse_offload",
    "run_sweep",
    "wait_healthy",
]


__getattr__ = lazy_names(__name__, _LAZY)
