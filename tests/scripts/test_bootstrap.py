"""scripts/bootstrap.sh: its usage line names every agentjax subcommand and the two test commands
(test, quick), a wrong command fails before any set-up, and its messages about the Mooncake library
speak of tests only to the test commands."""
from __future__ import annotations

import re
import subprocess

from agentjax.cli import build_parser
from tests.e2e.conftest import REPO

SCRIPT = REPO / "scripts" / "bootstrap.sh"


def top_level_commands() -> set[str]:
    (subparsers,) = [a for a in build_parser()._actions if a.choices and a.dest == "command"]
    return set(subparsers.choices)


def test_usage_names_every_subcommand_and_the_test_commands():
    result = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    named = set(re.search(r"\{(.*?)\}", result.stdout).group(1).split("|"))
    assert named == top_level_commands() | {"test", "quick"}


def test_an_unknown_command_fails_at_once_with_the_usage(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "serv"], capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "AGENTJAX_VENV": str(tmp_path / "venv")})
    assert result.returncode == 2 and "usage:" in result.stderr
    assert not (tmp_path / "venv").exists()  # nothing was set up


def test_every_subcommand_reaches_agentjax():
    text = SCRIPT.read_text()
    dispatched = re.search(r"\n\s+([a-z |]+)\)\n\s+exec \"\$VENV/bin/agentjax\"", text).group(1)
    assert {name.strip() for name in dispatched.split("|")} == top_level_commands()


def test_the_mooncake_library_message_mentions_tests_only_for_the_test_commands():
    text = SCRIPT.read_text()
    tests_note = [line for line in text.splitlines() if "tests are skipped" in line]
    assert tests_note and all('[ "$cmd" = test ]' in line for line in tests_note)
