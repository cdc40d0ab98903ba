"""ditq's folders are the chain's stages, and no import runs back up them: a module imports only from its own stage
and the stages below it (function-level imports included). The order, from the bottom:"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ditq"
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # shared utilities: nothing that belongs to one stage
    (
        "shared",
        (
            "ditq.errors",
            "ditq.schemes",
            "ditq.numerics",
            "ditq.fsutil",
            "ditq.devices",
            "ditq.progress",
            "ditq.runfiles",
            "ditq.metrics",
            "ditq.signatures",
            "ditq.jsonfile",
            "ditq.pictures",
            "ditq.lazy",
        ),
    ),
    ("checkpoint", ("ditq.checkpoint",)),
    ("kernels", ("ditq.kernels",)),
    ("demo model", ("ditq.demo",)),  # a model's own classes: the runtime loads them
    ("runtime", ("ditq.runtime",)),
    ("doctor", ("ditq.doctor",)),
    ("quantize", ("ditq.quantization",)),
    ("serve", ("ditq.serve",)),
    ("probe", ("ditq.probe",)),
    ("judge", ("ditq.judge",)),
    ("report", ("ditq.report",)),
    ("plan", ("ditq.plan",)),
    ("sweep", ("ditq.sweep",)),
    # the command line, and the package's public faces (``import ditq``; ``import ditq.diffusers`` for diffusers)
    ("commands", ("ditq.commands", "ditq.cli", "ditq", "ditq.diffusers")),
)


def _layer(module: str) -> int:
    """The index of the layer a module belongs to: the longest prefix that names it."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(f"{prefix}.")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def test_no_import_runs_back_up_the_layers() -> None:
    upward = []
    for module, path in _modules().items():
        own = _layer(module)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if name.startswith("ditq.") and _layer(name) > own:
                    upward.append(f"{module} ({LAYERS[own][0]}) imports {name} ({LAYERS[_layer(name)][0]})")
    assert upward == []


def test_every_module_is_in_a_layer_and_the_top_level_holds_shared_utilities_only() -> None:
    modules = _modules()
    for module in modules:
        _layer(module)
    top = sorted(m for m in modules if m.count(".") == 1 and not (PACKAGE / m.split(".")[1]).is_dir())
    assert top == [
        "ditq.cli", "ditq.devices", "ditq.errors", "ditq.fsutil", "ditq.jsonfile", "ditq.lazy", "ditq.metrics",
        "ditq.numerics", "ditq.pictures", "ditq.progress", "ditq.runfiles", "ditq.schemes", "ditq.signatures",
    ]  # fmt: skip
