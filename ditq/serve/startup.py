"""What runs before the first request, after the model is open: the doctor's record of the kernel paths it chose
while the opener loaded the model (``ditq.pipeline.open.open_pipeline``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ditq.runtime.adapter import PipelineAdapter
from ditq.serve.state import DoctorOutcome

__all__ = ["make_doctor"]

logger = logging.getLogger(__name__)


def make_doctor() -> Callable[[PipelineAdapter], DoctorOutcome]:
    """The doctor's start-up outcome: what the adapter's chooser chose while the model loaded
    (``adapter.kernel_chooser``, the opener's). Every quantized layer runs a path it verified; a geometry without one
    failed the load."""

    def record(adapter: PipelineAdapter) -> DoctorOutcome:
        chooser = adapter.kernel_chooser
        if chooser is None:
            return DoctorOutcome("skipped", "--skip-doctor given")
        from ditq.runtime.loader import pipeline_summary

        _, kernels = pipeline_summary(adapter.pipeline)
        summary = chooser.summary(sum(kernels.values()))
        logger.info("kernel doctor: %s", summary)
        return DoctorOutcome("passed", summary)

    return record
