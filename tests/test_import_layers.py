"""The Python packages' imports point one way, and no module imports itself back.

Every module under python/tokenspeed and python/tokenspeed_kernels is read with `ast` (nothing is
imported): every import counts, at the top of a file, inside a function (a lazy import) or under
`if TYPE_CHECKING:`, since each is a dependency a reader must follow. The layers, top to bottom:

    launch -> bench -> worker -> models -> layers -> distributed, diagnostics -> config -> kernels

A module imports its own package or a layer below it; `tokenspeed` itself (the version) and
`tokenspeed._core` (the Rust extension) sit under every layer. A new module goes into one of
these packages, never beside them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "python"

# Top to bottom; packages on one line are peers and may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("tokenspeed.offline",),  # the in-process API: LLM, AsyncLLM (on launch's start_workers)
    ("tokenspeed.launch",),  # the `tokenspeed` command, `serve`'s launch, supervisor, relay
    ("tokenspeed.bench",),  # `tokenspeed bench`
    ("tokenspeed.worker",),  # the worker process: loop, runner, sampler, graphs, plan codec
    ("tokenspeed.models",),  # model families, their configs and checkpoints
    ("tokenspeed.layers",),  # building blocks: linear, attention, MoE, KV cache, quantization
    ("tokenspeed.distributed", "tokenspeed.diagnostics"),  # process groups; step traces
    ("tokenspeed.config",),  # the declared configuration
    ("tokenspeed", "tokenspeed._core"),  # the version; the Rust extension
    ("tokenspeed_kernels",),  # Triton kernels
]


# The root package re-exports the offline API on first use (`from tokenspeed import LLM`, as
# vLLM's users write it; `tokenspeed.__getattr__`): the one edge that points up, and a lazy one.
LAZY_REEXPORTS = {("tokenspeed", "tokenspeed.offline")}
# The Rust extension is a module, though no .py file holds it.
EXTENSION = "tokenspeed._core"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("tokenspeed", "tokenspeed_kernels"):
        for path in sorted((SOURCE / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()
OURS = ("tokenspeed", "tokenspeed_kernels")


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module of ours, line) for every import in the file, wherever it sits."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                # `from package import module` imports the module; `from module import name`
                # the module.
                sub = f"{base}.{alias.name}"
                yield (sub if sub in MODULES or sub == EXTENSION else base), node.lineno


def _graph() -> dict[str, dict[str, int]]:
    """module -> {module of ours it imports: first line}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        edges = graph.setdefault(name, {})
        for target, line in _imports(name, path):
            if target.split(".")[0] in OURS and target != name \
                    and (name, target) not in LAZY_REEXPORTS:
                edges.setdefault(target, line)
    return graph


def _layer(module: str) -> tuple[int, str] | None:
    """(rank, package) of the layer a module belongs to: the longest package that holds it."""
    best: tuple[int, str] | None = None
    for rank, packages in enumerate(LAYERS):
        for package in packages:
            exact = package in ("tokenspeed", "tokenspeed._core")
            inside = module == package or (not exact and module.startswith(package + "."))
            if inside and (best is None or len(package) > len(best[1])):
                best = (rank, package)
    return best


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_packages_are_found() -> None:
    assert "tokenspeed.config" in MODULES and "tokenspeed_kernels" in MODULES, SOURCE


def test_every_module_sits_in_a_layer() -> None:
    loose = [m for m in MODULES if _layer(m) is None]
    assert not loose, f"modules outside the layers' packages (move them into one): {loose}"


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    described = []
    for component in cycles:
        inside = set(component)
        edges = [f"{a}:{line} -> {b}" for a in component for b, line in graph[a].items()
                 if b in inside]
        described.append(f"{len(component)} modules: " + "; ".join(edges))
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_imports_point_down_the_layers() -> None:
    upward = []
    for module, edges in _graph().items():
        mine = _layer(module)
        if mine is None:
            continue  # test_every_module_sits_in_a_layer names it
        for target, line in edges.items():
            theirs = _layer(target)
            if theirs is None or theirs[1] == mine[1]:
                continue
            if theirs[0] <= mine[0]:
                upward.append(f"{MODULES[module].relative_to(SOURCE)}:{line} imports {target} "
                              f"({theirs[1]} is not below {mine[1]})")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)
