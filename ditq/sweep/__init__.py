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

from ditq.sweep.health import wait_healthy
from ditq.sweep.options import (
    PLAN_CANDIDATE,
    SCHEME_STAGES,
    SweepOptions,
    check_seeds,
    default_serve_argv,
    ditq_argv,
    parse_endpoint_for,
    parse_offload,
)
from ditq.sweep.run import check_same_model, model_fingerprint, run_sweep

__all__ = [
    "PLAN_CANDIDATE",
    "SCHEME_STAGES",
    "SweepOptions",
    "check_same_model",
    "check_seeds",
    "default_serve_argv",
    "ditq_argv",
    "model_fingerprint",
    "parse_endpoint_for",
    "parse_offload",
    "run_sweep",
    "wait_healthy",
]
