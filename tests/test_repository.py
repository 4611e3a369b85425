"""The repository speaks of the project only: figures carry their command, date and
machine, targets are the project's own, and nothing refers to how the code came about
or to files that are not in the repository."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".ipynb", ".toml", ".yml", ".yaml", ".txt", ".cfg", ""}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist"}

# The phrases are spelled here in pieces ("from the" + " issue"), so this file passes its
# own scan and the hook's grep like any other.
HISTORY = [
    (r"\b[Ss]tops? \d+", "a development stop"),
    (r"\b[Ii]ssues? #?\d+", "an issue number"),
    (r"\b[Tt]he" + r" issue\b", "'the" + " issue'"),
    (r"\b[Ff]rom the" + r" issue\b", "'from the" + " issue'"),
    (r"\b(?:[Rr]eliability|[Rr]obustness) (?:issue|item)\b", "an item of an issue"),
    (r"\b(?:this|earlier|previous) (?:stop|session)s?\b", "a development session"),
    (r"\bshared" + r" folder\b", "a folder outside the repository"),
    (r"\bDESIGN\.md\b", "a file outside the repository (docs/design.md is ours)"),
]


def _files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
        names = [ROOT / n for n in out.stdout.splitlines()]
    except (OSError, subprocess.SubprocessError):  # not a git checkout: walk the tree
        names = [p for p in ROOT.rglob("*")
                 if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return [p for p in names if p.is_file() and p.suffix in TEXT]


def history_words(text: str) -> list[str]:
    """``"line N: <what>: <excerpt>"`` for every development-history phrase in ``text``."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in HISTORY:
            m = re.search(pattern, line)
            if m:
                found.append(f"line {n}: {what}: {m.group(0)!r}")
    return found


def test_no_development_history_words_in_the_repository():
    files = _files()
    assert any(p.name == "README.md" for p in files) and len(files) > 50, files
    bad = []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += [f"{p.relative_to(ROOT)} {hit}" for hit in history_words(text)]
    assert not bad, "development history in the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("text,hits", [
    ("measured at st" + "op 31 on 2 cores", 1),
    ("Goals (from the" + " issue): <= 30 us", 2),
    ("see DESIGN" + ".md in the shared" + " folder", 2),
    ("fixed in iss" + "ue 12 (reliability" + " item 7)", 2),
    ("Reliability" + " item 5: each process split", 1),
    ("both ranks issue the same all-reduces; a stopwatch, 2 stops", 0),
    ("docs/design.md holds the rules; a session-scoped fixture", 0),
])
def test_the_history_patterns_catch_history_and_pass_ordinary_words(text, hits):
    assert len(history_words(text)) == hits, history_words(text)
