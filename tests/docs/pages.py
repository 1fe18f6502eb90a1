"""The README and the docs/ pages as the docs tests read them: their fenced blocks, links and headings."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
GENERATED = ("configuration.md", "metrics.md")
GPU_MARKER = "# needs a GPU"


def pages() -> list[Path]:
    """README.md and every docs/*.md, README first."""
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@dataclass(frozen=True)
class Block:
    page: str  # "README.md", "docs/serving.md"
    language: str
    code: str

    @property
    def needs_gpu(self) -> bool:
        return self.code.lstrip().startswith(GPU_MARKER)


def blocks(languages: tuple[str, ...] = ("bash", "python")) -> list[Block]:
    """Every fenced block in those languages, page by page, in order."""
    found = []
    for path in pages():
        for language, code in re.findall(r"^```(\w+)\n(.*?)^```", path.read_text(), re.DOTALL | re.MULTILINE):
            if language in languages:
                found.append(Block(relative(path), language, code))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    return {slug(title) for title in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def links(path: Path) -> list[str]:
    """Every markdown link target on the page (outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def inline_commands(path: Path) -> list[str]:
    """Inline code spans that are `agentjax ...` commands (outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [span for span in re.findall(r"`([^`\n]+)`", text.replace("\n", " ").replace("` `", " "))
            if span.startswith("agentjax ")]
