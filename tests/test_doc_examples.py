"""Every Python example in README.md and docs/ runs as written, so none can drift.

A page's ```python blocks run top to bottom in one namespace, as a reader would paste
them: a block with ``>>>`` prompts is a doctest (its printed output must match), any
other block is executed whole. Scripts guarded by ``if __name__ == "__main__":`` define
their functions here without launching processes; the page then runs them on a threads
mesh where it says so. ``bash`` blocks are not run.
"""
from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, source)`` of every ```python block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def count_examples(page: Path) -> int:
    """A doctest block counts its ``>>>`` examples; any other block counts as one."""
    parser = doctest.DocTestParser()
    return sum(len(parser.get_examples(src)) if ">>>" in src else 1
               for _, src in blocks(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_of_the_page_runs(page):
    torch.manual_seed(0)
    glob = {"__name__": "__docs__"}
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    parser = doctest.DocTestParser()
    name = str(page.relative_to(ROOT))
    for line, src in blocks(page):
        if ">>>" in src:
            test = parser.get_doctest(src, glob, f"{name}:{line}", str(page), line - 1)
            out: list[str] = []
            result = runner.run(test, out=out.append, clear_globs=False)
            assert not result.failed, "".join(out)
            glob.update(test.globs)  # DocTest works on a copy of the namespace
        else:
            exec(compile("\n" * (line - 1) + src, str(page), "exec"), glob)  # noqa: S102


def test_the_docs_hold_at_least_40_runnable_examples():
    counts = {p.name: count_examples(p) for p in PAGES}
    assert sum(counts.values()) >= 40, counts
    assert (ROOT / "README.md").read_text(encoding="utf-8").count("\n") < 250


def test_every_relative_link_of_the_docs_resolves():
    broken = []
    for page in PAGES:
        for m in re.finditer(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not (page.parent / m.group(1)).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {m.group(1)}")
    assert not broken, broken
