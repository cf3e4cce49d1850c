"""The docs are reference pages, not a diary: no "this session", no issue numbers, no commit hashes standing
for dates, a benchmark page a reader can take in, links that lead somewhere, and docstrings that state
behaviour rather than one machine's figures. Each check is a function of a tree's root, so it can be
pointed at any checkout; the ``*_flags_*`` tests feed each one the kind of text it exists to refuse."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK_LINES = 600

DIARY = re.compile(r"this session|issue [0-9]+", re.IGNORECASE)
# 7 to 40 hex digits, a whole word, with at least one digit and one letter (so neither "deadbeef"-like words
# nor plain numbers count); a 64-digit sha256 is not a whole word of 7-40 and passes.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
MACHINE_FIGURE = re.compile(r"\b\d+-core machine\b|\bthis machine's\b|\bloaded machine\b", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED_PATH = re.compile(r"`(slimtune/[A-Za-z0-9_./-]+)`")


def _pages(root: Path) -> list[Path]:
    """The prose a reader meets: README, CHANGELOG and every page under docs/."""
    return [p for p in [root / "README.md", root / "CHANGELOG.md"] if p.exists()] + sorted((root / "docs").glob("*.md"))


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def _hits(paths: list[Path], pattern: re.Pattern[str], root: Path) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in pattern.finditer(line):
                found.append(f"{path.relative_to(root)}:{number}: {match.group(0)!r}")
    return found


def diary_hits(root: Path) -> list[str]:
    """Lines of the docs, README, CHANGELOG or the package that read like a lab notebook."""
    return _hits(_pages(root) + sorted((root / "slimtune").rglob("*.py")), DIARY, root)


def commit_hits(root: Path) -> list[str]:
    """Commit hashes in the docs, README or CHANGELOG: a version or a date says when, a hash does not."""
    return _hits(_pages(root), COMMIT, root)


def machine_figure_hits(root: Path) -> list[str]:
    """Figures of one machine in the package's source: they belong on the benchmark page."""
    return _hits(sorted((root / "slimtune").rglob("*.py")), MACHINE_FIGURE, root)


def benchmark_lines(root: Path) -> int:
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (root / "docs").glob("benchmarks*.md"))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, outside code blocks; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in _prose(text):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(root: Path) -> list[str]:
    """Relative links in the docs whose file, or whose heading anchor in a markdown file, does not exist."""
    broken = []
    for page in _pages(root):
        text = page.read_text(encoding="utf-8")
        for number, line in _prose(text):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                name, _, anchor = target.partition("#")
                dest = (page.parent / name).resolve() if name else page
                where = f"{page.relative_to(root)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                    broken.append(f"{where} (no such heading)")
    return broken


def missing_cited_paths(root: Path) -> list[str]:
    """`slimtune/...` paths quoted in the docs that are not in the tree (only paths spelled from slimtune/)."""
    missing = []
    for page in _pages(root):
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for cited in CITED_PATH.findall(line):
                if not (root / cited.rstrip("/.")).exists():
                    missing.append(f"{page.relative_to(root)}:{number}: {cited}")
    return missing


def test_docs_readme_and_package_hold_no_diary_words():
    assert diary_hits(ROOT) == []


def test_docs_hold_no_commit_hashes():
    assert commit_hits(ROOT) == []


def test_benchmark_pages_stay_under_600_lines():
    lines = benchmark_lines(ROOT)
    assert 0 < lines <= BENCHMARK_LINES, lines


def test_relative_links_in_the_docs_resolve():
    assert broken_links(ROOT) == []


def test_slimtune_paths_cited_in_the_docs_exist():
    assert missing_cited_paths(ROOT) == []


def test_package_source_quotes_no_machine_figures():
    assert machine_figure_hits(ROOT) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "slimtune").mkdir(exist_ok=True)
    (tmp_path / "docs").mkdir(exist_ok=True)
    return tmp_path


def test_diary_and_commit_checks_flag_notebook_text(tmp_path):
    root = _tree(
        tmp_path,
        {
            "docs/benchmarks.md": "## This session (2026-12-03, fourth): the merge (issue 29 item 4), at a008316\n"
            "sha256 `832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e`, 16,074,231,603 bytes, deadbeef\n",
            "slimtune/x.py": '"""Issue 25: faster."""\n',
        },
    )
    assert len(diary_hits(root)) == 3
    assert [hit.split(": ")[-1] for hit in commit_hits(root)] == ["'a008316'"]


def test_machine_figure_check_flags_a_docstring_measured_on_one_machine(tmp_path):
    root = _tree(
        tmp_path,
        {
            "slimtune/pool.py": '"""On this 2-core machine two threads gave Q4_K 1.3x."""\n',
            "slimtune/runtime.py": '"""Threads divided among the ranks on this machine (LOCAL_WORLD_SIZE)."""\n',
        },
    )
    assert [hit.split(":")[0] for hit in machine_figure_hits(root)] == ["slimtune/pool.py"]


def test_link_check_flags_missing_files_and_headings(tmp_path):
    root = _tree(
        tmp_path,
        {
            "README.md": "[ok](docs/a.md#two-words) [gone](docs/b.md) [no heading](docs/a.md#gpu-issue-17) [web](https://x.org/y)\n",
            "docs/a.md": "# A\n\n## Two words\n\n```\n# not a heading\n```\n[self](#a) [code](#not-a-heading)\n",
        },
    )
    assert [hit.split(": ")[1] for hit in broken_links(root)] == [
        "docs/b.md (no such file)",
        "docs/a.md#gpu-issue-17 (no such heading)",
        "#not-a-heading (no such heading)",
    ]


def test_cited_path_check_flags_a_renamed_module(tmp_path):
    root = _tree(tmp_path, {"docs/a.md": "`slimtune/step.py` and `slimtune/cli.py` and `checkpoint/writer.py`\n", "slimtune/cli.py": ""})
    assert [hit.split(": ")[-1] for hit in missing_cited_paths(root)] == ["slimtune/step.py"]


def test_benchmark_line_count_counts_every_benchmark_page(tmp_path):
    root = _tree(tmp_path, {"docs/benchmarks.md": "a\n" * 400, "docs/benchmarks-gguf.md": "b\n" * 300, "docs/other.md": "c\n" * 900})
    assert benchmark_lines(root) == 700
