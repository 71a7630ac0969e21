"""Every notebook runs top to bottom (CI executes them on the CPU)."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support import ROOT

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_NOTEBOOK_QUICK", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()
