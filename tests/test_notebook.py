"""examples/quickstart.ipynb runs top to bottom where fused_triplet is importable (its GPU cells
skip without a GPU)."""

import os

import pytest

from conftest import ROOT

nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install -e .[test])")
nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install -e .[test])")


def test_quickstart_notebook_runs():
    folder = os.path.join(ROOT, "examples")
    notebook = nbformat.read(os.path.join(folder, "quickstart.ipynb"), as_version=4)
    # A GPU's first cell compiles the kernels (about 30 s): a generous per-cell timeout.
    nbclient.NotebookClient(notebook, timeout=1200, kernel_name="python3",
                            resources={"metadata": {"path": folder}}).execute()
    outputs = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for out in cell.get("outputs", []))
    assert "CPU: loss and gradients match torch's" in outputs
    assert "batch_hard: loss" in outputs and "batch_all: loss" in outputs
    assert "forward + backward at 4096 x 512" in outputs or "No GPU visible: nothing to time" \
        in outputs
