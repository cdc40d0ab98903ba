"""``import ditq`` offers its public API by name, light until a name is used, and each name is what it says:
``ditq.quantize`` is the quantizer's function whether or not the quantize stage's package has been imported."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import ditq
import ditq.quantization

# Run in a fresh interpreter, where nothing has imported the quantize stage yet.
_FRESH = """
import inspect, json, sys
import ditq
light = "ditq.quantization" not in sys.modules
before = ditq.quantize
import ditq.quantization
import ditq.quantization.targets
from ditq import quantize
print(json.dumps({
    "light": light,
    "before": inspect.isfunction(before),
    "after": inspect.isfunction(ditq.quantize) and ditq.quantize is before is quantize,
    "module": before.__module__,
}))
"""


def test_quantize_is_a_function_before_and_after_its_stage_is_imported() -> None:
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {
        "light": True,
        "before": True,
        "after": True,
        "module": "ditq.quantization.quantizer",
    }


def test_every_public_name_is_what_dir_lists() -> None:
    # ``ditq.quantization`` is imported above: no name of the API is hidden by it.
    assert dir(ditq) == sorted(ditq.__all__)
    for name in ditq.__all__:
        value = getattr(ditq, name)
        assert isinstance(value, str) if name == "__version__" else inspect.isfunction(value), name
