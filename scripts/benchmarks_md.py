"""Writes one section of BENCHMARKS.md, replacing that section if it is there (benchmark scripts share it).

A section runs from its `## ` heading to the next `## ` heading or the end of the file.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def _span(text: str, heading: str) -> tuple[int, int] | None:
    """Where the section of `heading` starts in `text` and where it ends (-1: at the end of the text)."""
    found = re.search(rf"^{re.escape(heading)}$", text, re.MULTILINE)  # the heading as a whole line
    if found is None:
        return None
    return found.start(), text.find("\n## ", found.end())


def section_lines(heading: str, path: Path = BENCHMARKS) -> list[str]:
    """The lines of the section of `heading` as the file holds it now ([] if it has none), so a script can
    keep rows an earlier run wrote."""
    text = path.read_text() if path.exists() else ""
    span = _span(text, heading)
    if span is None:
        return []
    start, end = span
    return (text[start:] if end < 0 else text[start:end]).splitlines()


def write_section(body: str, path: Path = BENCHMARKS) -> None:
    """Put `body` (which starts with its own `## ` heading line) in place of the section of that heading."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    span = _span(text, body.splitlines()[0])
    if span is not None:
        start, end = span
        text = text[:start] + body.rstrip("\n") + ("\n" + text[end:] if end >= 0 else "\n")
    else:
        text = text.rstrip("\n") + "\n\n" + body.rstrip("\n") + "\n"
    path.write_text(text)


def publish(body: str, write: bool, path: Path = BENCHMARKS) -> None:
    """Print a benchmark's section, and write it to BENCHMARKS.md unless the run asked not to."""
    print(body)
    if write:
        write_section(body, path)


def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark script's parser: the first paragraph of its docstring as the description, and the
    `--no-write` flag every such script takes (print the section, leave BENCHMARKS.md alone)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    return parser


def run_line(command: str, load: float, note: str = "") -> str:
    """The opening a benchmark section states: the command, the machine, the date and the 1-minute load
    (`note` adds to the load's parentheses), ending in a space for the section's own text."""
    return (f"Command: `{command}`. Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, run on {datetime.date.today().isoformat()} (1-minute load "
            f"{load:.2f}{note}). ")
