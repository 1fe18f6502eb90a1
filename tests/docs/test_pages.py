"""The README is a front page of at most 200 lines that links every docs/ page, and every link in the
README and docs/ leads to a file and heading that exist."""
from __future__ import annotations

from tests.docs.pages import DOCS, REPO, anchors, links, pages, relative

MAX_README_LINES = 200


def test_the_readme_fits_two_screens():
    assert len((REPO / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_the_readme_links_every_docs_page():
    linked = {target.split("#")[0] for target in links(REPO / "README.md")}
    missing = [relative(path) for path in sorted(DOCS.glob("*.md")) if relative(path) not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_every_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in pages():
        for target in links(page):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file_part, _, anchor = target.partition("#")
            destination = (page.parent / file_part).resolve() if file_part else page
            if not destination.exists():
                broken.append(f"{relative(page)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{relative(page)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_no_page_names_a_machine_path():
    for page in pages():
        text = page.read_text()
        assert "/work/" not in text and "/root/" not in text, relative(page)
