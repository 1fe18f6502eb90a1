"""docs/configuration.md and docs/metrics.md match the code: regenerating them changes nothing, every
flag of every subcommand appears in its command's section with its default, every exported metric is
listed, and no page names a metric the exporter lacks."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

from agentjax.cli import build_parser, describe_default, subcommands
from tests.docs.pages import DOCS, REPO, pages, relative

sys.path.insert(0, str(REPO / "scripts"))
import gen_docs_reference  # noqa: E402


def test_the_generated_references_match_the_code():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_docs_reference.py"), "--check"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.MULTILINE)
    return {part.splitlines()[0].strip(): part for part in parts[1:]}


def test_every_flag_of_every_subcommand_is_listed_with_its_default():
    by_section = sections((DOCS / "configuration.md").read_text())
    for command, parser in subcommands(build_parser()).items():
        section = by_section[f"agentjax {' '.join(command)}"]
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction) or action.dest in (
                    "log_level", "quiet"):
                continue
            default = "required" if action.required else f"`{describe_default(action)}`"
            row = f"| {', '.join(f'`{name}`' for name in action.option_strings)} | {default} |"
            assert row in section, f"agentjax {' '.join(command)}: {row}"
    global_flags = by_section["Global flags"]
    assert "| `--log-level` | `INFO` |" in global_flags and "| `-q`, `--quiet` | `off` |" in global_flags


def exported_names() -> set[str]:
    metrics = gen_docs_reference.exported_metrics()
    return {metric["name"] for source in metrics.values() for metric in source}


def test_every_exported_metric_is_listed():
    text = (DOCS / "metrics.md").read_text()
    assert "agentjax:kv_offload_prefetched_pages_total" in exported_names()
    for name in exported_names():
        assert f"| `{name}` |" in text, name


def test_no_page_names_a_metric_the_exporter_lacks():
    known = exported_names()
    stems = {re.sub(r"_(bucket|sum|count)$", "", name) for name in known} | known
    for page in pages():
        for name in re.findall(r"agentjax:[a-z0-9_]+", page.read_text()):
            if name.endswith("_"):  # a family named by its prefix, `agentjax:kv_offload_*`
                continue
            assert name in stems or f"{name}_total" in known, f"{relative(page)} names {name}"
