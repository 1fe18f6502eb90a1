"""The KV manager has one face (agentjax/kv/manager.py and its mixins): only the scheduler drives its
request lifecycle, and nothing outside agentjax/kv reaches into it.

A static check over the source (`ast`, no import of the modules, no jax): outside agentjax/kv/ and
agentjax/scheduler/, no module calls the manager's step-path methods, and no module outside the
manager's own files reads its private members, and nothing outside agentjax/kv holds its pool or its
group managers (`kv.groups`: the public plan, `kv.plan.groups`, and the manager's group reads answer). The manager is recognised by name: an
expression ending in `kv`, `kv_manager` or `kv_cache_manager`, `manager` in a module that
imports `KVCacheManager`, or a name a `KVCacheManager(...)` constructor call is assigned to.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("agentjax", "scripts")

# What drives a request's pages through a step: the scheduler's calls.
STEP_PATH = frozenset({
    "allocate", "append", "reserve", "cache_blocks", "free", "end_turn", "take_pending_copies",
    "release_lookahead", "reserve_state_saves", "block_ids", "can_allocate", "pin", "pin_request",
    "pin_prefix", "unpin", "unpin_session", "hold_pages", "take_load_pages", "cache_loaded_page",
    "release_pages",
})
# The manager itself (its mixins and helpers read its private members by design).
MANAGER_FILES = frozenset({
    "agentjax/kv/manager.py", "agentjax/kv/manager_lookup.py", "agentjax/kv/manager_reads.py",
    "agentjax/kv/manager_states.py", "agentjax/kv/admission_undo.py", "agentjax/kv/turn_ends.py",
    "agentjax/kv/state_saves.py",
})
# Besides the scheduler, the drivers of the manager's request lifecycle: simulators that stand in for
# the scheduler to measure the manager and its policies alone.
STEP_PATH_DRIVERS = {
    "agentjax/bench/kv_sim.py": "the KV policy simulator replays traces against the manager alone",
    "scripts/bench_kv_pool_bookkeeping.py": "times the manager's own host cost per request, without a scheduler",
}
MANAGER_NAMES = frozenset({"kv", "kv_manager", "kv_cache_manager"})


def _receiver_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _offences(path: Path, relative: str) -> list[str]:
    tree = ast.parse(path.read_text(), filename=relative)
    names = set(MANAGER_NAMES)
    if "KVCacheManager" in path.read_text():
        names.add("manager")
    for node in ast.walk(tree):  # `m = KVCacheManager.full_attention(...)`: m is a manager too
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func).split(".")[0] == "KVCacheManager":
            names.update(filter(None, map(_receiver_name, node.targets)))
    inside_kv = relative.startswith("agentjax/kv/")
    may_drive = inside_kv or relative.startswith("agentjax/scheduler/") or relative in STEP_PATH_DRIVERS
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _receiver_name(node.value) in names:
            member = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _receiver_name(node.args[0]) in names
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            member = node.args[1].value  # getattr(kv, "pool", None) reaches as far as kv.pool
        else:
            continue
        where = f"{relative}:{node.lineno} {ast.unparse(node)}"
        if relative in MANAGER_FILES:
            continue
        if member.startswith("_") and not member.startswith("__"):
            found.append(f"{where} (a private member of the KV manager)")
        elif member == "pool" and not inside_kv:
            found.append(f"{where} (the manager's pool: ask the manager)")
        elif member == "groups" and not inside_kv:
            found.append(f"{where} (the manager's group managers: read kv.plan.groups or ask the manager)")
        elif member in STEP_PATH and not may_drive:
            found.append(f"{where} (a step-path call: only the scheduler drives the KV manager)")
    return found


def _modules():
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, path.relative_to(ROOT).as_posix()


def test_only_the_scheduler_drives_the_kv_manager_and_nothing_reaches_past_its_face():
    offences = [offence for path, relative in _modules() for offence in _offences(path, relative)]
    assert not offences, "modules reaching past the KV manager's face:\n" + "\n".join(offences)


def test_the_declared_drivers_exist():
    for relative in STEP_PATH_DRIVERS:
        assert (ROOT / relative).is_file(), f"{relative} is declared a KV manager driver but does not exist"


@pytest.mark.parametrize("source, expected", [
    ("def f(engine):\n    engine.kv.free('r1')\n", "a step-path call"),
    ("def f(self):\n    return self.kv._prepare([1, 2], None)\n", "a private member"),
    ("def f(kv):\n    kv.pool.release([3])\n", "the manager's pool"),
    ("def f(engine):\n    return getattr(engine.kv, 'pool', None)\n", "the manager's pool"),
    ("def f(kv):\n    return [g.tokens_per_page for g in kv.groups]\n", "the manager's group managers"),
    ("from agentjax.kv import KVCacheManager\n\ndef f(manager):\n    manager._requests.clear()\n", "a private member"),
    ("def f(KVCacheManager):\n    m = KVCacheManager.full_attention(64)\n    m.allocate('r', [1])\n", "a step-path call"),
])
def test_the_check_names_each_kind_of_offence(tmp_path, source, expected):
    path = tmp_path / "offender.py"
    path.write_text(source)
    found = _offences(path, "agentjax/server/offender.py")
    assert len(found) == 1 and expected in found[0] and "agentjax/server/offender.py:" in found[0]


def test_the_check_lets_the_scheduler_and_the_public_face_through(tmp_path):
    path = tmp_path / "ok.py"
    path.write_text("def f(self):\n    self.kv.allocate('r', [1])\n    return self.kv.stats(), self.kv.lookup([1])\n")
    assert _offences(path, "agentjax/scheduler/ok.py") == []
    assert len(_offences(path, "agentjax/engine.py")) == 1  # allocate; stats and lookup are reads


def test_the_group_reads_answer_what_callers_asked_the_group_managers():
    """`prefix_group`, `hashes_per_page`, `page_table_lengths` and `page_keys` give what the engine's warm-up,
    the KV event view, the launcher and the router simulator read from `kv.groups` before."""
    from agentjax.kv import (FullAttentionSpec, KVCacheManager, RecurrentStateSpec, SlidingWindowSpec,
                             block_hashes)

    full = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2)  # 32 bytes a token
    sliding = SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2, sliding_window=8)
    state = RecurrentStateSpec(bytes_per_state=256, checkpoint_interval=8)  # pages of 8 tokens
    kv = KVCacheManager.from_specs([sliding, state, full], 64, block_size=4, cache_on_allocate=False)
    assert [(g.spec.hit_rule, g.tokens_per_page) for g in kv.plan.groups] == [
        ("window", 8), ("checkpoint", 8), ("prefix", 8)]
    assert kv.prefix_group() is kv.plan.groups[2]
    assert [kv.hashes_per_page(g) for g in range(3)] == [2, 2, 2]
    assert KVCacheManager.from_specs([sliding, state], 64, block_size=4).prefix_group() is None

    prompt = list(range(100, 119))  # 19 tokens: 3 pages of 8, the last one partial
    assert kv.page_table_lengths(len(prompt)) == (3, 1, 3)  # a state group holds its running page
    assert kv.allocate("a", prompt, cache_salt="salt")
    assert tuple(len(pages) for pages in kv.block_ids("a")) == kv.page_table_lengths(len(prompt))

    keys = kv.page_keys(2, prompt, "salt")
    assert keys == block_hashes(prompt, 4, "salt")[1::2] and len(keys) == 2  # each full page's last hash
    kv.cache_blocks("a", len(prompt))
    index = kv.cached_index(2)
    assert all(key in index for key in keys)
    assert kv.page_keys(2, prompt) != keys  # the salt names a namespace of its own
