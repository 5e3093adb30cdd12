"""Executes every tutorial notebook (SMALL sizes) and fails on any cell error."""

import glob
import json
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_notebooks_exist_and_are_stripped():
  names = [os.path.basename(p) for p in NOTEBOOKS]
  assert names == ["01_advantages_and_losses.ipynb", "02_ppo_vs_grpo.ipynb",
                   "03_sharded_long_sequence_ppo.ipynb"]
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
      if cell.cell_type == "code":
        assert cell.outputs == [] and cell.execution_count is None, path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  # The kernel inherits this environment: SMALL sizes, this interpreter's packages.
  before = sorted(os.listdir(os.path.dirname(path)))
  monkeypatch.setenv("JAXRL_LLM_SMALL", "1")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  nb = nbformat.read(path, as_version=4)
  # kernel "python3" is ipykernel's spec; jupyter_client launches its `python` argv
  # with the running interpreter. Checked by the first cell.
  nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors, json.dumps(errors, default=str)[:2000]
  assert os.path.realpath(nb.cells[0].outputs[0]["text"].strip()) == os.path.realpath(
      sys.executable)
  # Nothing was written next to the notebooks (runs go to temporary folders).
  assert sorted(os.listdir(os.path.dirname(path))) == before
