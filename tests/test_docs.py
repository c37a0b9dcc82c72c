"""The README and the pages it links hold together: every figure the README quotes
comes from the page it cites, and every link between them resolves.

A *figure* is a measured quantity: a number, or a range of two, followed by a unit of
time, rate or ratio (``×``, ``s``, ``ms``, ``µs``, ``min``, ``GB/s``, ``MB/s``, ``req/s``,
``%``). Parameters of a measurement (``4,096-token``, ``16 KiB``) are not figures. Each
paragraph or list item of the README that quotes a figure links a page under docs/, the
figure appears in one of the pages that item links (with its unit, or as a bare number in
a table), and the README quotes it once. The checkers are tested on small texts too, so a
broken one cannot pass silently.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

_NUM = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.,/-])({_NUM}(?:[–-]{_NUM})?)\s?(GB/s|MB/s|req/s|minutes|min|ms|µs|×|%|s)(?![\w/])")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose_units(text: str) -> list[str]:
    """Paragraphs and list items outside fenced code, each joined into one line."""
    units: list[list[str]] = [[]]
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            units.append([])
            continue
        if fenced:
            continue
        if not line.strip() or line.lstrip().startswith(("- ", "| ", "#")):
            units.append([])
        if line.strip():
            units[-1].append(line.strip())
    return [" ".join(u) for u in units if u]


def figures(unit: str) -> list[tuple[str, str]]:
    """(figure as written, its number) for every figure of ``unit``."""
    return [(m.group(0), m.group(1)) for m in FIGURE.finditer(unit)]


def _flat(text: str) -> str:
    return " ".join(text.replace("*", "").split())


def _has_number(doc: str, number: str) -> bool:
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d,]|\.\d)", doc) is not None


def figure_problems(readme: str, read: dict[str, str]) -> list[str]:
    """Every figure of ``readme`` that does not come from a page it cites, or repeats.

    ``read`` maps a linked path (relative to the README, no anchor) to the page's text.
    """
    problems: list[str] = []
    seen: dict[str, int] = {}
    for unit in prose_units(readme):
        found = figures(unit)
        if not found:
            continue
        pages = [link.split("#")[0] for link in LINK.findall(unit)]
        docs = [_flat(read[p]) for p in pages if p.startswith("docs/") and p in read]
        for written, number in found:
            seen[written] = seen.get(written, 0) + 1
            if not docs:
                problems.append(f"{written!r} cites no page under docs/: {unit[:60]!r}")
            elif not any(_flat(written) in d or _has_number(d, number) for d in docs):
                problems.append(f"{written!r} is in none of {pages}")
    problems += [f"{w!r} is quoted {n} times" for w, n in seen.items() if n > 1]
    return problems


def slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    out: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            base = slug(m.group(1))
            name, n = base, 0
            while name in out:
                n += 1
                name = f"{base}-{n}"
            out.add(name)
    return out


def link_problems(page: Path) -> list[str]:
    """Every relative link of ``page`` whose file or anchor does not exist."""
    problems = []
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(
                dest.read_text(encoding="utf-8")):
            problems.append(f"{page.name}: {target} (no such heading)")
    return problems


def _linked_pages(readme: str) -> dict[str, str]:
    out = {}
    for target in LINK.findall(readme):
        path = target.split("#")[0]
        if path.endswith(".md") and (README.parent / path).exists():
            out[path] = (README.parent / path).read_text(encoding="utf-8")
    return out


def test_every_figure_of_the_readme_comes_from_the_page_it_cites() -> None:
    readme = README.read_text(encoding="utf-8")
    assert len([f for u in prose_units(readme) for f in figures(u)]) >= 8  # it quotes some
    assert figure_problems(readme, _linked_pages(readme)) == []


def test_every_link_of_the_readme_and_the_docs_resolves() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert [p for page in pages for p in link_problems(page)] == []


def test_the_readme_fits_on_a_few_screens() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 350


def test_figure_checker_on_small_texts() -> None:
    doc = "| run | 0.543 | 4.04 |\nthe hit took **0.37 s** and 0.95–1.06× of it\n"
    readme = (
        "Intro, 4,096-token prompts of 16 KiB, Python 3.10, no figure.\n\n"
        "- A hit in 0.37 s, 0.95–1.06× of it ([p](docs/a.md#x)).\n"
        "- A handshake in 0.543 ms and 9.9 ms ([p](docs/a.md)).\n\n"
        "A stray 2.5× with no link.\n\n"
        "```\n7.7× in code is not prose\n```\n"
        "Again 0.37 s ([p](docs/a.md)).\n")
    assert figures("took 0.37 s, 26 min, 1,298 passed, 0.26–0.29× and 7 GB/s") == [
        ("0.37 s", "0.37"), ("26 min", "26"), ("0.26–0.29×", "0.26–0.29"),
        ("7 GB/s", "7")]
    assert figure_problems(readme, {"docs/a.md": doc}) == [
        "'9.9 ms' is in none of ['docs/a.md']",
        "'2.5×' cites no page under docs/: 'A stray 2.5× with no link.'",
        "'0.37 s' is quoted 2 times",
    ]


def test_link_checker_on_small_texts(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Top\n## The `x`: y, z\n## Top\n```\n# not a heading\n```\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#the-x-y-z) [dup](b.md#top-1) [gone](c.md) [bad](b.md#not-a-heading)"
                    " [web](https://example.com/x#y) [self](#here)\n## Here\n")
    assert link_problems(page) == ["a.md: c.md (no such file)",
                                   "a.md: b.md#not-a-heading (no such heading)"]
