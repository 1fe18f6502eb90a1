"""The import graph of the project's packages, read with `ast` (nothing is imported, so no jax): no circle
between modules, and no lower floor (sharding, kv, scheduler, models, pallas_kernels) reaching a floor that
drives them (the engine, the runner, llm, the server, the router, bench). Every import counts: module level,
inside functions, under `TYPE_CHECKING`, and `importlib.import_module` of a constant name (a module named by
a string built at run time, as the decoder block's mixer registry does, is not seen)."""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agentjax", "pallas_kernels", "sharding", "checkpoints", "scripts")
# scripts/ is no package: its files import each other by bare name, with scripts/ on sys.path.
FLAT_PACKAGES = ("scripts",)
LOWER_FLOORS = ("sharding", "agentjax.kv", "agentjax.scheduler", "agentjax.models", "pallas_kernels")
UPPER_FLOORS = ("agentjax.engine", "agentjax.engine_extras", "agentjax.llm", "agentjax.data_parallel",
                "agentjax.runner", "agentjax.server", "agentjax.router", "agentjax.bench", "agentjax.cli")
# The KV manager's own rooms: its pool (pages, slabs, eviction order, pin table), its group managers, its
# request records and its mixins. Outside agentjax/kv a module reaches the manager through
# `KVCacheManager`'s methods, never through these (specs, layout, hashing, policies, events, usage and the
# offload tiers are agentjax/kv's public modules).
KV_MANAGER_INTERNALS = tuple(f"agentjax.kv.{name}" for name in (
    "block_pool", "slab_pool", "slab_choice", "eviction", "eviction_groups", "pinned_order", "pins", "groups",
    "known_runs", "requests", "admission_undo", "turn_ends", "state_saves", "manager_lookup", "manager_reads",
    "manager_states"))


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Every module under `packages` by its dotted name (a package by its `__init__.py`)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict) -> str | None:
    """The longest prefix of a dotted name that is one of `modules` (an imported name inside it counts
    as the module that defines it)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement (or `importlib.import_module("...")` call) reaches."""
    flat = module.split(".")[0] in FLAT_PACKAGES
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module
        # `from a import b` reaches module a.b if there is one, else the name b that module a defines.
        names = [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]
    elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args
          and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        names = [node.args[0].value]
    else:
        return []
    if flat and not getattr(node, "level", 0):
        names += [f"{module.split('.')[0]}.{name}" for name in names]
    return names


def import_edges(modules: dict[str, Path], root: Path = ROOT) -> dict[str, dict[str, str]]:
    """`edges[a][b]`: where module `a` imports module `b` ("path:line", its first such import)."""
    edges: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        out = edges.setdefault(module, {})
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets = {_known(name, modules) for name in _imported_names(node, module, path.name == "__init__.py")}
            for target in sorted(targets - {None, module}):
                out.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return edges


def _path(edges: dict, start: str, reached, allowed=lambda module: True) -> list[str] | None:
    """The shortest import path from `start` (at least one import long) to a module `reached` accepts."""
    previous = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(edges.get(module, ())):
            if target in previous or not allowed(target):
                continue
            previous[target] = module
            if reached(target):
                path = [target]
                while path[-1] != start or len(path) == 1:
                    path.append(previous[path[-1]])
                return path[::-1]
            queue.append(target)
    return None


def _strongly_connected(edges: dict) -> list[set[str]]:
    """The components of two or more modules that import each other, directly or around a circle."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(root: str) -> None:  # Tarjan's algorithm, iterative (the graph is deep)
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges.get(target, ())))))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1:
                    components.append(component)

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return components


def import_circles(edges: dict) -> list[list[str]]:
    """One circle per group of modules that import each other, as a path from its first module back to it."""
    circles = []
    for component in _strongly_connected(edges):
        start = min(component)
        circles.append(_path(edges, start, lambda m: m == start, lambda m: m in component))
    return sorted(circles)


def _under(module: str, floors) -> bool:
    return any(module == floor or module.startswith(floor + ".") for floor in floors)


def upward_paths(edges: dict, lower=LOWER_FLOORS, upper=UPPER_FLOORS) -> list[list[str]]:
    """For each module of a lower floor that reaches an upper floor (directly or through other modules),
    the shortest such import path."""
    paths = []
    for module in sorted(edges):
        if _under(module, lower):
            path = _path(edges, module, lambda m: _under(m, upper))
            if path:
                paths.append(path)
    return paths


def internal_kv_imports(modules: dict[str, Path], root: Path = ROOT,
                        internals=KV_MANAGER_INTERNALS) -> list[str]:
    """"path:line name" for each import, outside agentjax/kv, of a KV manager internal module or of a name
    the `agentjax.kv` package re-exports from one (`from agentjax.kv import BlockPool`)."""
    reexported = set()
    package = modules.get("agentjax.kv")
    if package is not None:
        for node in ast.walk(ast.parse(package.read_text())):
            if isinstance(node, ast.ImportFrom) and _under(node.module or "", internals):
                reexported.update(f"agentjax.kv.{alias.asname or alias.name}" for alias in node.names)
    found = []
    for module, path in modules.items():
        if _under(module, ("agentjax.kv",)):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported_names(node, module, path.name == "__init__.py"):
                if _under(name, internals) or name in reexported:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return sorted(set(found))


def describe(path: list[str], edges: dict) -> str:
    steps = [path[0]] + [f"-> {b} ({edges[a][b]})" for a, b in zip(path, path[1:])]
    return "\n    ".join(steps)


@pytest.fixture(scope="module")
def edges():
    return import_edges(module_files(ROOT))


def test_no_module_imports_itself_around_a_circle(edges):
    circles = import_circles(edges)
    if circles:
        pytest.fail("import circles (each import with the line that makes it):\n  "
                    + "\n  ".join(describe(circle, edges) for circle in circles), pytrace=False)


def test_lower_floors_never_reach_the_floors_that_drive_them(edges):
    paths = upward_paths(edges)
    if paths:
        pytest.fail(f"{', '.join(LOWER_FLOORS)} must not import {', '.join(UPPER_FLOORS)}, directly or through "
                    "other modules:\n  " + "\n  ".join(describe(path, edges) for path in paths), pytrace=False)


def test_nothing_outside_kv_imports_the_kv_managers_internals():
    found = internal_kv_imports(module_files(ROOT))
    if found:
        pytest.fail("outside agentjax/kv, ask the KV manager (agentjax/kv/manager.py and its reads), do not import "
                    "its internals:\n  " + "\n  ".join(found), pytrace=False)


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_internals_check_finds_direct_and_reexported_imports(tmp_path):
    tree = _write_tree(tmp_path, {
        "agentjax/__init__.py": "",
        "agentjax/kv/__init__.py": "from agentjax.kv.block_pool import BlockPool\nfrom agentjax.kv.specs import KVSpec\n",
        "agentjax/kv/block_pool.py": "BlockPool = object\n",
        "agentjax/kv/specs.py": "from agentjax.kv.block_pool import BlockPool\nKVSpec = object\n",
        "agentjax/server/__init__.py": "",
        "agentjax/server/view.py": "from agentjax.kv import BlockPool, KVSpec\ndef f():\n    import agentjax.kv.block_pool\n",
    })
    assert internal_kv_imports(module_files(tree, ("agentjax",)), root=tree) == [
        "agentjax/server/view.py:1 agentjax.kv.BlockPool", "agentjax/server/view.py:3 agentjax.kv.block_pool"]
    gone = [name for name in KV_MANAGER_INTERNALS if not (ROOT / (name.replace(".", "/") + ".py")).is_file()]
    assert not gone, f"KV internal modules named here that no longer exist: {gone}"


def test_the_check_finds_circles_and_upward_imports(tmp_path):
    """The two checks above on a small tree made to break both rules, so they can fail."""
    tree = _write_tree(tmp_path, {
        "agentjax/__init__.py": "",
        "agentjax/llm.py": "from agentjax.outputs import RequestOutput\n",
        "agentjax/outputs.py": "RequestOutput = object\n",
        "agentjax/kv/__init__.py": "",
        "agentjax/kv/a.py": "def f():\n    from . import b\n",
        "agentjax/kv/b.py": "import importlib\nimportlib.import_module('agentjax.kv.c')\n",
        "agentjax/kv/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agentjax.kv.a import f\n",
        "sharding/__init__.py": "",
        "sharding/mesh.py": "from agentjax.outputs import RequestOutput\nfrom agentjax import llm\n",
        "scripts/one.py": "import two\n",
        "scripts/two.py": "from one import main\n",
    })
    edges = import_edges(module_files(tree), root=tree)
    assert import_circles(edges) == [["agentjax.kv.a", "agentjax.kv.b", "agentjax.kv.c", "agentjax.kv.a"],
                                     ["scripts.one", "scripts.two", "scripts.one"]]
    assert upward_paths(edges) == [["sharding.mesh", "agentjax.llm"]]
    assert edges["sharding.mesh"]["agentjax.llm"] == "sharding/mesh.py:2"


def test_only_the_kernels_module_of_agentjax_imports_pallas_kernels(edges):
    """`agentjax/kernels.py` picks a kernel or its reference per op; the rest of agentjax goes through it."""
    found = [f"{module} -> {target} ({where})" for module, targets in sorted(edges.items())
             if _under(module, ("agentjax",)) and module != "agentjax.kernels"
             for target, where in sorted(targets.items()) if _under(target, ("pallas_kernels",))]
    assert not found, "import kernels through agentjax.kernels:\n  " + "\n  ".join(found)
