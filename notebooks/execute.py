"""Run the notebooks top to bottom on this machine and save them with their outputs, as the
repository shows them: `python notebooks/execute.py [NOTEBOOK ...]` (all of them by default).
The tests execute them too, in memory, without writing."""

import glob
import os
import sys

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))

for path in sys.argv[1:] or sorted(glob.glob(os.path.join(HERE, "*.ipynb"))):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timestamps: noise in every diff
    nbformat.write(nb, path)
    print("executed", os.path.relpath(path))
