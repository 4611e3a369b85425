"""``examples/fno_darcy.py --check`` runs as the README says (a fresh interpreter): an FNO
trained a few steps on Darcy flow over 4 threads ranks and 2 gloo processes has the
single-device losses."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gloo
def test_fno_darcy_sharded_losses_equal_one_device():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "fno_darcy.py"), "--check"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.rstrip().endswith("PASS"), out.stdout
    rows = re.findall(r"^  (.+?) +loss (\S+) -> (\S+), test (\S+), .* from one device (\S+)$",
                      out.stdout, re.M)
    assert [r[0] for r in rows] == ["one device", "4 threads ranks", "2 gloo processes"]
    assert all(float(r[4]) < 1e-6 for r in rows)
    assert float(rows[0][2]) < float(rows[0][1])  # and it learns
    # a progress line from each variant, and what each variant ran on, so times compare
    for name in ("one device", "4 threads ranks", "2 gloo processes"):
        assert re.search(rf"^    {name} step +5/5  loss \S+$", out.stdout, re.M), out.stdout
    used = re.findall(r", \S+ s on (.+?), largest", out.stdout)
    assert re.fullmatch(r"\d+ intra-op threads?", used[0]), used
    assert used[1] == "4 rank threads x 1 intra-op thread", used
    assert re.fullmatch(r"2 processes x \d+ intra-op threads?", used[2]), used
