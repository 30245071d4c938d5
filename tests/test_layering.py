"""The layering of ARCHITECTURE.md holds in the imports: a module imports only modules of its own layer or below,
at module level and inside functions alike (``if TYPE_CHECKING:`` blocks excepted), and no modules import each other
in a loop.

Layers, bottom up (ARCHITECTURE.md, plus where each helper module sits and why):

0. values: ``patterns``, ``registry`` (score and schedule names, so ``config`` needs neither module), ``_version``;
1. ``config`` (a validated recipe of patterns and registered names);
2. masks and scores: ``masks``, ``obs``, ``scoring``, and ``formats.bitpack`` (pure bit packing, used by the
   pruner's saved state as well as by the format);
3. ``schedules``;
4. the pruner: ``pruner`` and the helpers it drives, ``modeling`` (target layers), ``distributed``, ``dynamic``;
5. the format: ``formats``;
6. ``ops``;
7. modules: ``nn``;
8. trainer integration: ``callback``, ``trainer``, ``compaction`` (the switch), ``compact_fallback`` (timing compact
   against dense), ``serialization`` (saving), ``distillation``, ``hub``, ``metrics``;
9. loading: ``integrations``; ``inspect`` reads checkpoints as the loader does;
10. the entry points: ``cli``, ``demo`` and the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_sparse"

LAYERS: list[tuple[str, ...]] = [
    ("hf_sparse.patterns", "hf_sparse.registry", "hf_sparse._version"),
    ("hf_sparse.config",),
    ("hf_sparse.masks", "hf_sparse.obs", "hf_sparse.sparsegpt", "hf_sparse.scoring", "hf_sparse.formats.bitpack"),
    ("hf_sparse.schedules",),
    (
        "hf_sparse.pruner",
        "hf_sparse.modeling",
        "hf_sparse.calibration",
        "hf_sparse.distributed",
        "hf_sparse.dynamic",
        "hf_sparse.oneshot",
    ),
    ("hf_sparse.formats",),
    ("hf_sparse.ops",),
    ("hf_sparse.nn",),
    (
        "hf_sparse.callback",
        "hf_sparse.trainer",
        "hf_sparse.compaction",
        "hf_sparse.compact_fallback",
        "hf_sparse.serialization",
        "hf_sparse.distillation",
        "hf_sparse.hub",
        "hf_sparse.metrics",
    ),
    ("hf_sparse.integrations", "hf_sparse.inspect"),
    ("hf_sparse.cli", "hf_sparse.demo", "hf_sparse.calibration_data", "hf_sparse"),
]


def layer_of(module: str) -> int:
    """The layer of a module: the one whose entry is the longest prefix of its dotted name."""
    best, found = -1, None
    for rank, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best:
                best, found = len(entry), rank
    if found is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py: add it where it belongs")
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST):
    """Every node, leaving out the bodies of ``if TYPE_CHECKING:`` (imports for annotations only)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def imports_of(path: Path) -> set[str]:
    """The hf_sparse modules ``path`` imports (``from . import x`` counts as importing ``x`` where ``x`` is a module,
    else the package it is taken from)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "hf_sparse")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "hf_sparse":
                continue
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").is_file() or (
                    PACKAGE.parent / Path(*candidate.split(".")) / "__init__.py"
                ).is_file()
                found.add(candidate if is_module else source)
    found.discard(name)
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "data" not in p.relative_to(PACKAGE).parts}


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_reaches_a_higher_layer(name):
    own = layer_of(name)
    upward = sorted(f"{dep} (layer {layer_of(dep)})" for dep in imports_of(MODULES[name]) if layer_of(dep) > own)
    assert not upward, f"{name} (layer {own}) imports from above: {upward}"


def test_no_import_cycles():
    graph = {name: {dep for dep in imports_of(path) if dep in MODULES} for name, path in MODULES.items()}
    graph["hf_sparse"] = set()  # the package face imports everything and is imported for nothing but re-exports
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The test can fail: a lazy upward import inside a function is found."""
    source = "def f():\n    from .nn.compact import kernel_pattern\n"
    path = PACKAGE / "pruner.py"
    tree = ast.parse(source)
    found = {
        ".".join(["hf_sparse", *(n.module or "").split(".")])
        for n in _walk(tree)
        if isinstance(n, ast.ImportFrom) and n.level == 1
    }
    assert found == {"hf_sparse.nn.compact"}
    assert layer_of("hf_sparse.nn.compact") > layer_of(module_name(path))
