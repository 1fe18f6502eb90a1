"""The design pages (docs/design/*.md) name only what exists, and the overview's rooms match the code.

Every backticked span that reads as code is checked: a path (`agentjax/kv/manager.py`) must exist; a
dotted name must resolve by import and attribute lookup (`agentjax.kv.manager.KVCacheManager`,
`KVCacheManager.allocate`: a class found by name, `kernels.kimi_delta_attention`: a module by its last
name, `jax.lax.optimization_barrier`: another package's); a bare name with an underscore or a capital letter (`tail_hit`, `Engine`) must be defined
somewhere in the code. Plain words, flags, routes and quoted values are prose. The overview's room table
must cover every module, its floors must hold for every real import, and each arrow of its drawing must
be a real import.
"""
from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

from tests.docs.pages import DOCS, REPO
from tests.test_import_graph import LOWER_FLOORS, UPPER_FLOORS, import_edges, module_files

DESIGN_PAGES = sorted((DOCS / "design").glob("*.md"))
OVERVIEW = DOCS / "design" / "overview.md"
PACKAGES = ("agentjax", "pallas_kernels", "sharding", "checkpoints")
FLOOR_RANKS = {"door": 3, "driver": 2, "lower": 1, "shared": None}
IDENTIFIER = r"[A-Za-z_]\w*"


def _prose(text: str) -> str:
    """The page without its fenced blocks (the drawing is checked on its own)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


@cache
def defined_names() -> dict[str, set[str]]:
    """Every name the code defines (functions and methods, classes, module and class attributes, modules),
    each with the modules that define it at top level (empty for the others)."""
    names: dict[str, set[str]] = {}
    for module, path in module_files(REPO, (*PACKAGES, "scripts")).items():
        names.setdefault(module.rsplit(".", 1)[-1], set())
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.setdefault(node.name, set())
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Name):
                    names.setdefault(target.id, set())
                elif isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    names.setdefault(target.attr, set())  # an instance attribute
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name].add(module)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(target, ast.Name):
                        names[target.id].add(module)
    return names


def _has(value, attribute: str) -> bool:
    """An attribute, or a dataclass field without a default (declared on the class or a base)."""
    if hasattr(value, attribute):
        return True
    return isinstance(value, type) and any(attribute in vars(base).get("__annotations__", {})
                                           for base in value.__mro__)


def _resolves(module_name: str, attributes: list[str]) -> bool:
    try:
        value = importlib.import_module(module_name)
    except ImportError:
        return False
    for attribute in attributes:
        if not _has(value, attribute):
            return False
        value = getattr(value, attribute, None)
    return True


def _dotted_resolves(parts: list[str]) -> bool:
    modules = module_files(REPO, PACKAGES)
    if parts[0] in PACKAGES:
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return _resolves(".".join(parts[:end]), parts[end:])
        return False
    if parts[0][0].isupper():  # a class, by name: any module that defines it at top level
        owners = defined_names().get(parts[0], set())
        return any(_resolves(owner, parts) for owner in owners)
    owners = [module for module in modules if module.rsplit(".", 1)[-1] == parts[0]]  # a module by its last name
    if owners:
        return any(_resolves(owner, parts[1:]) for owner in owners)
    return _resolves(parts[0], parts[1:])  # another package (`jax.lax.optimization_barrier`)


def unknown_names(text: str) -> list[str]:
    """The code spans of a page that name a path or symbol the code does not have."""
    unknown = []
    for span in dict.fromkeys(code_spans(text)):
        name = span.split("(")[0].strip()
        if " " not in name and ("/" in name or re.search(r"\.(md|py|json|toml|sh)$", name)):
            if name.startswith(("/", "../", "http")):  # a route, or a file outside the repository
                continue
            if not (REPO / name).exists():
                unknown.append(span)
        elif re.fullmatch(rf"{IDENTIFIER}(\.{IDENTIFIER})+", name):
            if not _dotted_resolves(name.split(".")):
                unknown.append(span)
        elif re.fullmatch(IDENTIFIER, name) and ("_" in name.strip("_") or name != name.lower()):
            if name not in defined_names():
                unknown.append(span)
    return unknown


@pytest.mark.parametrize("page", DESIGN_PAGES, ids=lambda path: path.name)
def test_every_name_on_a_design_page_exists(page):
    unknown = unknown_names(page.read_text())
    assert not unknown, f"docs/design/{page.name} names what the code does not have: {unknown}"


def test_the_name_check_finds_what_does_not_exist():
    page = ("`agentjax/kv/manager.py` `KVCacheManager.allocate` `kernels.kimi_delta_attention` `tail_hit` "
            "`Request.num_computed_tokens` `/v1/chat/completions` `agentjax serve` `pool` "
            "`agentjax/kv/nothing.py` `KVCacheManager.nothing` `kernels.nothing` `no_such_function()` "
            "`agentjax.kv.manager.Nothing` `NoSuchClass`")
    assert unknown_names(page) == ["agentjax/kv/nothing.py", "KVCacheManager.nothing", "kernels.nothing",
                                   "no_such_function()", "agentjax.kv.manager.Nothing", "NoSuchClass"]


# ---- the overview's rooms, floors and drawing ------------------------------------------------------
def room_table(text: str) -> dict[str, tuple[str, list[tuple[str, bool]]]]:
    """room -> (floor, [(module prefix, whether only that module itself)]), from the table whose header is
    `| Room | Floor | Code |`: a folder covers its modules, a file its module, a package's `__init__.py`
    the package module alone."""
    rooms = {}
    for name, floor, code in re.findall(r"^\| *(\w+) *\| *(\w+) *\| *(`.*`) *\|$", text, re.MULTILINE):
        prefixes = []
        for path in re.findall(r"`([^`]+)`", code):
            parts = Path(path).with_suffix("").parts if path.endswith(".py") else Path(path).parts
            package_init = parts[-1] == "__init__"
            prefixes.append((".".join(parts[:-1] if package_init else parts), package_init or path.endswith(".py")))
        rooms[name] = (floor, prefixes)
    return rooms


def drawing(text: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(room -> the subgraph it is drawn in, arrows) of the page's mermaid block."""
    block = re.search(r"^```mermaid\n(.*?)^```", text, re.DOTALL | re.MULTILINE).group(1)
    placed, arrows, subgraph = {}, [], None
    for line in block.splitlines():
        line = line.strip()
        if match := re.fullmatch(r"subgraph (\w+).*", line):
            subgraph = match.group(1)
        elif line == "end":
            subgraph = None
        elif match := re.fullmatch(r"(\w+) --> (\w+)", line):
            arrows.append(match.groups())
        elif re.fullmatch(r"\w+", line) and subgraph is not None:
            placed[line] = subgraph
    return placed, arrows


def room_of(module: str, rooms: dict) -> str | None:
    """The room whose longest prefix covers `module`."""
    best = None
    for name, (_, prefixes) in rooms.items():
        for prefix, exact in prefixes:
            covers = module == prefix or not exact and module.startswith(prefix + ".")
            if covers and (best is None or len(prefix) > best[1]):
                best = (name, len(prefix))
    return best[0] if best else None


@pytest.fixture(scope="module")
def overview():
    text = OVERVIEW.read_text()
    rooms = room_table(text)
    modules = module_files(REPO, (*PACKAGES, "scripts"))
    edges = import_edges(modules, REPO)
    room_edges: dict[tuple[str, str], str] = {}
    for source, targets in edges.items():
        for target, where in targets.items():
            pair = (room_of(source, rooms), room_of(target, rooms))
            if pair[0] != pair[1]:
                room_edges.setdefault(pair, f"{source} -> {target} ({where})")
    return text, rooms, modules, room_edges


def test_the_room_table_covers_every_module(overview):
    _, rooms, modules, _ = overview
    assert set(rooms) and {floor for floor, _ in rooms.values()} <= set(FLOOR_RANKS)
    unplaced = [module for module in modules if room_of(module, rooms) is None]
    assert not unplaced, f"modules in no room of the overview's table: {unplaced}"


def floor_violations(rooms: dict, room_edges: dict) -> list[str]:
    """The imports that go up a floor, or from a shared room above the lower floor."""
    rank = {name: FLOOR_RANKS[floor] for name, (floor, _) in rooms.items()}
    wrong = []
    for (source, target), example in sorted(room_edges.items()):
        if rank[source] is None:  # shared rooms import only shared rooms and the lower floor
            if rank[target] is not None and rank[target] > 1:
                wrong.append(example)
        elif rank[target] is not None and rank[target] > rank[source]:
            wrong.append(example)
    return wrong


def test_every_import_respects_the_floors(overview):
    _, rooms, _, room_edges = overview
    wrong = floor_violations(rooms, room_edges)
    assert not wrong, "imports against the overview's floors:\n  " + "\n  ".join(wrong)


def test_the_room_checks_find_a_misplaced_module_and_an_upward_import():
    page = """| Room | Floor | Code |
|------|-------|------|
| engine | driver | `agentjax/engine.py` |
| kv | lower | `agentjax/kv/` |
| types | shared | `agentjax/__init__.py` `agentjax/errors.py` |
"""
    rooms = room_table(page)
    assert rooms["types"] == ("shared", [("agentjax", True), ("agentjax.errors", True)])
    assert [room_of(m, rooms) for m in ("agentjax.kv.offload.host", "agentjax", "agentjax.engine_kv")] == \
        ["kv", "types", None]
    edges = {("kv", "engine"): "kv up to engine", ("engine", "kv"): "engine down to kv",
             ("types", "kv"): "types to the lower floor", ("types", "engine"): "types up to engine"}
    assert floor_violations(rooms, edges) == ["kv up to engine", "types up to engine"]


def test_the_floors_agree_with_the_import_graph_test(overview):
    _, rooms, modules, _ = overview
    misplaced = []
    for module in modules:
        floor = rooms[room_of(module, rooms)][0]
        if any(module == p or module.startswith(p + ".") for p in LOWER_FLOORS) and floor != "lower":
            misplaced.append(f"{module}: a lower floor in tests/test_import_graph.py, '{floor}' here")
        if any(module == p or module.startswith(p + ".") for p in UPPER_FLOORS) and floor not in ("door", "driver"):
            misplaced.append(f"{module}: an upper floor in tests/test_import_graph.py, '{floor}' here")
    assert not misplaced, "\n".join(misplaced)


def test_the_drawing_places_every_room_and_draws_only_real_imports(overview):
    text, rooms, _, room_edges = overview
    placed, arrows = drawing(text)
    assert placed == {name: floor for name, (floor, _) in rooms.items()}, "the drawing's rooms and floors differ " \
                                                                          "from the table's"
    assert arrows, "the drawing has no arrows"
    invented = [f"{a} --> {b}" for a, b in arrows if (a, b) not in room_edges]
    assert not invented, f"arrows with no import behind them: {invented}"
