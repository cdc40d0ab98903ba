"""Let ``ditq.quantize(...)`` call the function even after ``import ditq.quantize`` bound the module there.

Importing a submodule binds it as an attribute of its package, replacing a
lazily exported function of the same name; a module whose class forwards
``__call__`` to that function keeps ``ditq.<step>(...)`` working either way.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["make_module_callable"]


def make_module_callable(module_name: str, function: Callable[..., Any]) -> None:
    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = _CallableModule
