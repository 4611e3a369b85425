"""The notebooks in notebooks/ run top to bottom on CPU, each draws at least one plot, and
each is stored without outputs (so diffs show code, and a stale output can't mislead)."""
from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(ROOT.glob("*.ipynb"))
ids = [p.stem for p in NOTEBOOKS]


def test_the_notebooks_exist():
    assert ids == ["01_tour", "02_domain_parallel_cnn", "03_custom_ops", "04_property_tests",
                   "05_fno_darcy", "06_attention", "07_planner"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} carry outputs; strip them with "
                       f"`jupyter nbconvert --clear-output --inplace {path.name}`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_executes_and_plots(path):
    nb = nbformat.read(path, as_version=4)
    # nbclient raises CellExecutionError naming the cell and the traceback on any error.
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    plots = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if "image/png" in o.get("data", {})]
    assert plots, f"{path.name} drew no plot"
