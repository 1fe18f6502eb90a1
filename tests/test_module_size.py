"""Modules people can live in: every Python module of the project's code folders is at most 400 lines and
opens with a docstring that says its role (tests aside)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("agentjax", "pallas_kernels", "sharding", "checkpoints", "scripts")
MAX_LINES = 400


def oversized_or_undocumented(root: Path = ROOT, folders=FOLDERS) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            name = path.relative_to(root).as_posix()
            lines = len(text.splitlines())
            if lines > MAX_LINES:
                found.append(f"{name}: {lines} lines (at most {MAX_LINES}: split it along a seam)")
            if text.strip() and not ast.get_docstring(ast.parse(text)):
                found.append(f"{name}: no module docstring (2-5 lines: its role, what it must never do)")
    return found


def test_every_module_is_small_and_says_its_role():
    found = oversized_or_undocumented()
    assert not found, "\n".join(found)


def test_the_check_finds_a_long_module_and_one_without_a_docstring(tmp_path):
    (tmp_path / "agentjax").mkdir()
    (tmp_path / "agentjax" / "long.py").write_text('"""Long."""\n' + "x = 1\n" * MAX_LINES)
    (tmp_path / "agentjax" / "bare.py").write_text("x = 1\n")
    (tmp_path / "agentjax" / "empty.py").write_text("")
    (tmp_path / "agentjax" / "fine.py").write_text('"""Fine."""\n' + "x = 1\n" * (MAX_LINES - 1))
    found = oversized_or_undocumented(tmp_path, ("agentjax",))
    assert found == ["agentjax/bare.py: no module docstring (2-5 lines: its role, what it must never do)",
                     f"agentjax/long.py: {MAX_LINES + 1} lines (at most {MAX_LINES}: split it along a seam)"]
