"""scripts/gpu_check.py: its checks pass on the CPU (so they are right when a GPU runs
them), and without CUDA it skips cleanly."""
from __future__ import annotations

import importlib.util
import pathlib

import torch

PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checks_pass_on_cpu(capsys):
    assert _script().main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 4 and "FAIL" not in out


def test_runs_on_cuda_or_skips_without_it(capsys):
    assert _script().main([]) == 0
    skipped = "no CUDA device: skipped" in capsys.readouterr().out
    assert skipped == (not torch.cuda.is_available())
