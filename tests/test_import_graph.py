"""The import graph of supa_emu: acyclic, one leaf owns the process state, only entry points activate.

The graph is read from the sources with `ast`, so imports inside functions count as much as
module-level ones (a lazy import that closes a cycle still makes each module depend on the other).
An import of `a.b.c` is an edge to `a.b.c`; `from a.b import c` is an edge to `a.b.c` when that
is a module, else to `a.b`. Either import also runs the `__init__` of each parent package, so it
is an edge to each parent package too, except to the importer's own parents (already running
when it runs): a package's submodules may import each other without closing a cycle through
their package, but a module of another package that reaches into one imports its `__init__`.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = "supa_emu"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE

STATE_OWNER = "supa_emu.process_state"
LEAF_CONSTANTS = {"supa_emu.device_type", "supa_emu.switches"}  # what a leaf may still import
ENTRY_POINTS = {"supa_emu", "supa_emu.torch_supa"}  # autoload/activate(), and `import torch_supa`


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """{dotted name: file} of every module of the package in `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    """The package's modules one import statement of `module` names."""
    package = next(iter(modules)).split(".")[0]

    def known(name: str) -> str:  # the longest prefix of `name` that is a module
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    if isinstance(node, ast.Import):
        return [known(alias.name) for alias in node.names if alias.name.split(".")[0] == package]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != package:
        return []
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else known(source)
            for alias in node.names]


def _parents(module: str) -> list[str]:
    """The packages Python initialises before `module`: `a` and `a.b` for `a.b.c`."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def import_graph(root: pathlib.Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {imported module of the package: line of the first such import}}, without self-edges."""
    modules = _modules(root)
    graph = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        running = set(_parents(module))  # initialised before `module` runs
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, module, path.name == "__init__.py", modules):
                    for imported in [p for p in _parents(target) if p not in running] + [target]:
                        edges.setdefault(imported, node.lineno)
        edges.pop(module, None)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph is acyclic (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    modules = _modules(ROOT)
    return "\n".join(f"  {a} imports {b} ({modules[a].relative_to(ROOT.parent)}:{graph[a][b]})"
                     for a, b in zip(cycle, cycle[1:]))


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_graph_resolves_every_kind_of_import(tmp_path):
    files = {
        "pkg/__init__.py": "import os\nfrom .sub import helper\n",
        "pkg/leaf.py": "X = 1\n",
        "pkg/sub/__init__.py": "from . import mod\ndef helper():\n    from .. import leaf\n",
        "pkg/sub/mod.py": "from ..leaf import X\nimport pkg.sub.deep as d\nfrom pkg import other, leaf\n",
        "pkg/sub/deep.py": "def f():\n    from pkg.sub import helper\n",
        "pkg/other.py": "import json\n",
        "pkg/third/__init__.py": "",
        "pkg/third/user.py": "from pkg.sub.deep import f\nfrom ..sub import mod\n",
    }
    _write(tmp_path, files)
    assert import_graph(tmp_path / "pkg") == {
        "pkg": {"pkg.sub": 2},
        "pkg.leaf": {},
        "pkg.other": {},
        "pkg.sub": {"pkg.sub.mod": 1, "pkg.leaf": 3},  # the second inside a function
        "pkg.sub.deep": {"pkg.sub": 2},  # a function's name, so its package
        "pkg.sub.mod": {"pkg.leaf": 1, "pkg.sub.deep": 2, "pkg.other": 3},
        "pkg.third": {},
        # Reaching into another package runs its __init__: an edge to it, on the line that reaches in.
        "pkg.third.user": {"pkg.sub": 1, "pkg.sub.deep": 1, "pkg.sub.mod": 2},
    }
    assert find_cycle(import_graph(tmp_path / "pkg")) == ["pkg.sub", "pkg.sub.mod", "pkg.sub.deep", "pkg.sub"]


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    # b's __init__ imports a.x lazily, and a.x reaches into b: a cycle that only __init__ edges show.
    files = {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "",
        "pkg/a/x.py": "from pkg.b.y import Y\n",
        "pkg/b/__init__.py": "def load():\n    from pkg.a import x\n",
        "pkg/b/y.py": "Y = 1\n",
    }
    _write(tmp_path, files)
    assert find_cycle(import_graph(tmp_path / "pkg")) == ["pkg.a.x", "pkg.b", "pkg.a.x"]


def test_the_collective_layer_never_imports_the_planner():
    graph = import_graph()
    reached = {module: target for module, edges in graph.items() if module.startswith("supa_emu.distributed")
               for target in edges if target.startswith("supa_emu.plan")}
    assert not reached, f"supa_emu.distributed imports the planner: {reached}"


GLOO_TRANSPORT = "supa_emu.distributed.gloo"
ASSEMBLY = "supa_emu.distributed"  # where the default transport is registered
FACE = "supa_emu.distributed.process_group"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_only_the_package_assembly_imports_the_gloo_transport():
    # The face, the record, the seam and the planner know transports only through the seam.
    graph = import_graph()
    reached = {module: target for module, edges in graph.items()
               if module != ASSEMBLY and not _in(module, GLOO_TRANSPORT)
               for target in edges if _in(target, GLOO_TRANSPORT)}
    assert not reached, f"modules outside {GLOO_TRANSPORT} import it: {reached}"
    assert not any(_in(target, GLOO_TRANSPORT) for target in graph[FACE])


def test_transports_never_import_the_face():
    graph = import_graph()
    transports = [m for m in graph if _in(m, GLOO_TRANSPORT)] + ["supa_emu.plan.uniform_transport"]
    reached = {module: edges[FACE] for module, edges in graph.items() if module in transports and FACE in edges}
    assert not reached, f"transports import the face ({FACE}), at lines: {reached}"


def test_the_graph_covers_every_supa_emu_module():
    graph = import_graph()
    assert len(graph) == len(list(ROOT.rglob("*.py"))) and "supa_emu.supa.amp.common" in graph


def test_the_cycle_finder_reports_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 1}}) is None


def test_no_import_cycle_among_supa_emu_modules():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among supa_emu modules:\n" + _describe(cycle, graph)


def test_the_process_state_owner_is_a_leaf():
    imports = set(import_graph()[STATE_OWNER])
    assert imports <= LEAF_CONSTANTS, f"{STATE_OWNER} imports {sorted(imports - LEAF_CONSTANTS)}"


def test_only_entry_points_import_activation():
    graph = import_graph()
    importers = {module for module, edges in graph.items() if "supa_emu.activation" in edges}
    assert importers <= ENTRY_POINTS, f"activation is imported back by {sorted(importers - ENTRY_POINTS)}"
