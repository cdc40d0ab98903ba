"""ditq's folders are the chain's stages, and no import runs back up them: a module imports only from its own stage
and the stages below it (function-level imports included). Nor does any chain of imports loop back to where it began,
within a stage either (``test_no_import_cycle_among_ditq_modules``). The order, from the bottom:"""

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
    # the one opener (``open_pipeline``) and the one-shot generate over it: it installs the doctor's choices, so
    # it stands above the doctor
    ("pipeline", ("ditq.pipeline",)),
    ("quantize", ("ditq.quantization",)),
    ("serve", ("ditq.serve",)),
    ("probe", ("ditq.probe",)),
    ("calibration", ("ditq.calibration",)),  # the fixtures' requests through the source model, for GPTQ
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


def _imported_names(path: Path) -> list[str]:
    """Every name a module's import statements take, at any depth and type-only ones too: ``import a.b`` gives
    ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a module: ``from ditq import serve``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_no_import_runs_back_up_the_layers() -> None:
    upward = []
    for module, path in _modules().items():
        own = _layer(module)
        for name in _imported_names(path):
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


def _type_checking(node: ast.If) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports for the type checker, never run."""
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` that can run: at any depth (inside functions too), less the bodies of
    ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        if isinstance(node, ast.If) and _type_checking(node):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return found


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ditq modules ``module`` imports when it runs, function-level imports included: for ``from ditq.a import
    b``, ``ditq.a.b`` where that is a module, else ``ditq.a``. A package's own ``__init__``, which Python runs before
    any of its modules, is not counted as imported by them."""
    named: set[str] = set()
    for node in _run_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}  # fmt: skip
        elif isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
    return {name for name in named if name in modules and name != module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module in ``graph`` (module -> modules it imports), each as
    one cycle through it (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_import_cycle_among_ditq_modules() -> None:
    modules = _modules()
    graph = {module: _imports(module, path, modules) for module, path in modules.items()}
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_loop_closed_through_a_function_level_import(tmp_path: Path) -> None:
    """The loop issue 45 removed (attention -> fuse -> prefill -> attention, the last import inside a function),
    rebuilt from source text: the finder names its three modules, and nothing once the last import is gone."""
    sources = {
        "ditq.x.attention": "from ditq.x.fuse import view\n",
        "ditq.x.fuse": "from ditq.x import prefill\n",
        "ditq.x.prefill": "def op():\n    from ditq.x.attention import segment\n",
        "ditq.x.other": "import ditq.x.fuse\nfrom ditq.x.typed import U\n",
        "ditq.x.typed": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ditq.x.other import T\n",
    }
    paths = {}
    for name, text in sources.items():
        paths[name] = tmp_path / f"{name}.py"
        paths[name].write_text(text)
    graph = {name: _imports(name, path, paths) for name, path in paths.items()}
    assert import_cycles(graph) == [["ditq.x.attention", "ditq.x.fuse", "ditq.x.prefill"]]
    paths["ditq.x.prefill"].write_text("def op():\n    pass\n")
    graph = {name: _imports(name, path, paths) for name, path in paths.items()}
    assert import_cycles(graph) == []


def test_only_the_serve_command_imports_the_server_package() -> None:
    """serve/ is the HTTP layer (intake, cost, worker, access): what another stage needs to open a pipeline or
    answer with an image lives below it, so nothing outside serve/ imports it but the command that starts it."""
    entry = {"ditq.commands.serve"}
    importers = []
    for module, path in _modules().items():
        if module == "ditq.serve" or module.startswith("ditq.serve.") or module in entry:
            continue
        names = _imported_names(path)
        if any(name == "ditq.serve" or name.startswith("ditq.serve.") for name in names):
            importers.append(module)
    assert importers == []
