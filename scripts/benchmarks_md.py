"""Writes one section of BENCHMARKS.md, replacing that section if it is there (benchmark scripts share it).

A section runs from its `## ` heading to the next `## ` heading or the end of the file.
"""
from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def write_section(body: str, path: Path = BENCHMARKS) -> None:
    """Put `body` (which starts with its own `## ` heading line) in place of the section of that heading."""
    heading = body.splitlines()[0]
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if heading in text:
        start = text.index(heading)
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + body.rstrip("\n") + ("\n" + text[end:] if end >= 0 else "\n")
    else:
        text = text.rstrip("\n") + "\n\n" + body.rstrip("\n") + "\n"
    path.write_text(text)


def publish(body: str, write: bool, path: Path = BENCHMARKS) -> None:
    """Print a benchmark's section, and write it to BENCHMARKS.md unless the run asked not to."""
    print(body)
    if write:
        write_section(body, path)
