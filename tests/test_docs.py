"""Every relative link in the README and docs/ reaches a file or folder of the repository:
docs move, and a front page with dead links is worse than none."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PAGES = [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks are not links
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


@pytest.mark.parametrize("page", [page for page in PAGES if page.exists()],
                         ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    dead = [target for target in relative_links(page)
            if not (page.parent / target.split("#")[0]).exists()]
    assert not dead, f"{page.relative_to(ROOT)} links to missing files: {dead}"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    headline = next(number for number, line in enumerate(lines) if line.startswith("| ") and "suffix" in line)
    assert headline < 100, "the headline table belongs in the README's first 100 lines"
