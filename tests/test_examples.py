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
