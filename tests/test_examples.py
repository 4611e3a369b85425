"""The scripts in ``examples/`` run as the README says (``python examples/NAME.py``, a
fresh interpreter) and do what they claim."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gloo
def test_large_sample_trains_on_blocks_like_one_device():
    """3 gloo processes write, read and train on their own rows of a 26-row field (blocks
    of 9, 9, 8 rows); float32, 2 Adam steps: parameters as one device's to 1e-6."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "large_sample.py"), "--ranks", "3", "--rows",
         "26", "--cols", "8", "--steps", "2", "--check"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"rank (\d): block \[1, 2, (\d+), 8\], loss (\S+) -> (\S+), largest "
                      r"parameter difference from one device (\S+)", out.stdout)
    assert [(r[0], r[1]) for r in rows] == [("0", "9"), ("1", "9"), ("2", "8")], out.stdout
    assert len({r[2:4] for r in rows}) == 1  # every process trained the same model
    assert all(float(r[4]) < 1e-6 for r in rows)
    assert float(rows[0][3]) < float(rows[0][2])  # and it learns
    # progress while it runs: rank 0 reports each step, with the seconds since the start
    steps = re.findall(r"^  \[ *[\d.]+ s\] step (\d)/2, loss (\S+)$", out.stdout, re.M)
    assert [s for s, _ in steps] == ["1", "2"], out.stdout
    assert float(steps[0][1]) == pytest.approx(float(rows[0][2]), rel=1e-3)


def _train_resume(*flags: str) -> tuple[str, list[tuple[str, int, float]], float]:
    """Runs ``examples/train_resume.py`` as a user would; returns its output, its progress
    lines (ranks, step, loss) and the parameter difference it reports."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_resume.py"), *flags],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = [(r, int(s), float(v)) for r, s, v in
             re.findall(r"^  (\d) ranks step +(\d+) +loss on all 96 samples (\S+)$",
                        out.stdout, re.M)]
    diff = re.search(r"largest \|parameter difference\| from one device (\S+) \(between the "
                     r"ranks (\S+)\), tolerance 1e-10: PASS$", out.stdout, re.M)
    assert diff, out.stdout
    assert float(diff[2]) == 0.0  # every rank holds the same parameters
    return out.stdout, steps, float(diff[1])


def test_train_resume_threads_resumes_on_another_mesh_like_one_device():
    """4 threads ranks train 6 steps, save, 2 ranks resume for 6 more (float64): the
    parameters are one uninterrupted device's to 1e-10 (the ranks add in another order)."""
    out, steps, diff = _train_resume("--ranks", "4", "--resume-ranks", "2", "--steps", "12",
                                     "--save-at", "6", "--every", "3")
    assert [(r, s) for r, s, _ in steps] == [("4", 3), ("4", 6), ("2", 9), ("2", 12)], out
    assert diff < 1e-10
    assert steps[-1][2] < steps[0][2]  # and it learns


@pytest.mark.gloo
def test_train_resume_gloo_resumes_on_more_processes():
    """2 gloo processes train 3 steps and save; 3 processes resume for 3 more."""
    out, steps, diff = _train_resume("--backend", "gloo", "--ranks", "2", "--resume-ranks",
                                     "3", "--steps", "6", "--save-at", "3", "--every", "3")
    assert [(r, s) for r, s, _ in steps] == [("2", 3), ("3", 6)], out
    assert diff < 1e-10
