"""How the library's packages may import each other, read from the source (AST; no imports run).

- The checkpoint package has one public API: nothing outside ``megatron_recipes/checkpoint/`` imports its
  private modules (``_files``, ``_mcore``...). Tests may, to test those units directly.
- No import cycle between the top-level packages of ``megatron_recipes``, counting imports inside
  functions: a function-local import that only hides a cycle is still a cycle. An edge that closes a
  cycle and belongs to another piece of work may be listed in ``KNOWN_UPWARD`` (empty today); each listed
  edge must still exist (remove it once it is gone), and without them the graph must have no cycle.
- The bottom of the library is layered (``LAYERS``): ``config`` (schema, composition, derived values)
  imports no other package, the cost model ``estimate`` only ``config``, the rule table ``validation``
  only those two; commands (``plan``, ``train``, ``slurm``, ``check``...) build on top.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "megatron_recipes"
PRIVATE_API_PACKAGES = ("megatron_recipes.checkpoint",)  # packages whose submodules are all private
# Outside the library, code that users run from the checkout also goes through the public API.
SCANNED_OUTSIDE = ("benchmarks", "conversion", "launch")

# (importing package, imported package): the edge that closes a cycle, with the work that removes it.
KNOWN_UPWARD: Dict[Tuple[str, str], str] = {}
# The bottom layers, lowest first: each imports only the library packages listed before it.
LAYERS = ("config", "families", "estimate", "validation")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, at any depth (functions included).

    ``from package import name`` yields ``package.name`` too, since ``name`` may be a submodule."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield node.lineno, source
            for alias in node.names:
                yield node.lineno, f"{source}.{alias.name}"


def _python_files(*folders: Path) -> List[Path]:
    return sorted(f for folder in folders if folder.is_dir() for f in folder.rglob("*.py"))


def test_nothing_outside_the_checkpoint_package_imports_its_private_modules():
    found = []
    for path in _python_files(LIBRARY, *(REPO / name for name in SCANNED_OUTSIDE)):
        for owner in PRIVATE_API_PACKAGES:
            if path.is_relative_to(REPO.joinpath(*owner.split("."))):
                continue
            for line, name in _imports(path):
                rest = name[len(owner) + 1 :] if name.startswith(owner + ".") else ""
                if rest.startswith("_"):
                    found.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not found, "use the public API (`from megatron_recipes import checkpoint`):\n" + "\n".join(found)


def package_graph() -> Dict[Tuple[str, str], List[str]]:
    """(importer, imported) top-level package of ``megatron_recipes`` -> where (file:line), every depth."""
    edges: Dict[Tuple[str, str], List[str]] = defaultdict(list)
    for path in _python_files(LIBRARY):
        parts = path.relative_to(LIBRARY).parts
        if parts == ("__init__.py",):
            continue  # the root package: every import of megatron_recipes.* runs it anyway
        source = parts[0].removesuffix(".py")
        for line, name in _imports(path):
            target = name.split(".")
            if len(target) > 1 and target[0] == "megatron_recipes" and target[1] != source:
                if (LIBRARY / target[1]).is_dir() or (LIBRARY / f"{target[1]}.py").is_file():
                    where = f"{path.relative_to(REPO)}:{line}"
                    if where not in edges[(source, target[1])]:
                        edges[(source, target[1])].append(where)
    return edges


def cycles(edges) -> List[List[str]]:
    """The strongly connected components with more than one package (Tarjan)."""
    graph: Dict[str, Set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(graph) | {b for _, b in edges}):
        if node not in index:
            visit(node)
    return found


def _describe(component: List[str], edges) -> str:
    inside = [(a, b) for (a, b) in edges if a in component and b in component]
    return " <-> ".join(component) + ":\n" + "\n".join(f"  {a} -> {b}: {', '.join(edges[(a, b)][:3])}" for a, b in sorted(inside))


def test_no_import_cycle_between_packages():
    edges = package_graph()
    gone = sorted(edge for edge in KNOWN_UPWARD if edge not in edges)
    assert not gone, f"these known cycle edges are gone: remove them from KNOWN_UPWARD: {gone}"
    remaining = {edge: where for edge, where in edges.items() if edge not in KNOWN_UPWARD}
    found = cycles(remaining)
    assert not found, "import cycles between packages (function-local imports count):\n" + "\n".join(
        _describe(c, remaining) for c in found
    )


def test_the_cycle_finder_finds_a_cycle():
    """The check above can fail: a two-package and a three-package cycle are found, a chain is not."""
    assert cycles({("a", "b"): [], ("b", "a"): []}) == [["a", "b"]]
    assert cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}) == [["a", "b", "c"]]
    assert cycles({("a", "b"): [], ("b", "c"): []}) == []


def test_the_bottom_layers_import_only_the_layers_below():
    assert all((LIBRARY / name).is_dir() for name in LAYERS), f"a package in LAYERS is gone: {LAYERS}"
    upward = [
        f"{a} -> {b}: {', '.join(where[:3])}"
        for (a, b), where in sorted(package_graph().items())
        if a in LAYERS and b not in LAYERS[: LAYERS.index(a)]
    ]
    assert not upward, "a bottom layer imports a package above it (see LAYERS):\n" + "\n".join(upward)
