"""What the quantize stage assumes unless told, in one light module: ``ditq quantize`` and ``ditq verify`` read their
defaults from here for ``--help`` without importing torch, and the quantizer and the verifier read the same values.
"""

from __future__ import annotations

from typing import Any

from ditq.quantization.links import COPY_MAX_BYTES

__all__ = [
    "AUTO",
    "AUTO_MIN_SHARE",
    "CALIBRATIONS",
    "CALIBRATION_MEMORY",
    "CALIBRATION_SEEDS",
    "CALIBRATION_STEPS",
    "DEFAULTS",
    "REL_L2_BOUNDS",
]

CALIBRATIONS = ("rtn", "gptq")  # --calibrate: round to nearest (no data), or GPTQ on calibration requests
# --calibrate gptq's requests: each fixture at these seeds (apart from the probe's 2301-2304: the judged images are
# not the calibrated ones), this many denoising steps; the input Hessians held at once
CALIBRATION_SEEDS = (0, 1)
CALIBRATION_STEPS = 8
CALIBRATION_MEMORY = 4 * 2**30

# `--components auto`: a component is quantized when its target Linears hold at least this share of the pipeline's
# parameters (Qwen-Image-2.1: transformer 43 %, text encoder 45 %, VAE 0 %; the demo's text encoder 2 %).
AUTO_MIN_SHARE = 0.05

# The CLI takes its defaults from here, so `ditq quantize` and `ditq.quantize` agree. Without a plan, no scheme
# means "w8a8" and no components "auto" (every component whose blocks hold a real share of the pipeline's
# weights: ``AUTO_MIN_SHARE``); with one, its schemes and its component.
AUTO = "auto"
DEFAULTS: dict[str, Any] = {
    "scheme": "w8a8",
    "components": AUTO,
    "config_form": "flat",
    "device": "auto",
    "max_shard_bytes": 5 * 1024**3,
    "band_bytes": 1024**2,  # source bytes per band of rows: a band's float32 working set stays in cache
    "copy_max_bytes": COPY_MAX_BYTES,  # an entry not rewritten is copied up to this size where not linked relatively
}

# Largest relative L2 error (||w_q - w|| / ||w||) accepted per quantized tensor, by scheme. Per-channel
# int8 of a BF16 weight typically lands near 0.01 and e4m3 near 0.025; the bounds leave room for
# heavy-tailed rows while still catching a wrong scale, layout or transpose (errors of order 1).
# 4 bits: about 0.11 on Gaussian weights in groups of 128 (an int4 step is a seventh of the group's largest
# value), more per channel and where a weight has outliers; the bound catches a broken quantization, the fidelity
# judge decides whether it serves.
REL_L2_BOUNDS: dict[str, float] = {"w8a16": 0.05, "w8a8": 0.05, "fp8": 0.08, "w4a16": 0.3, "w4a8": 0.3}
