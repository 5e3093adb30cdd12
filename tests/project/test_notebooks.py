"""The tutorial notebooks: saved with their outputs, in sync with their builder, and run.

``notebooks/build_notebooks.py`` writes every notebook from its cell sources and
executes it, saving the outputs (a reader on GitHub sees the plots). Here:

* the saved notebooks hold exactly the builder's cells, all executed in order, with
  no error output, plots included, an "Open in Colab" badge and a Colab setup cell;
* each notebook runs again, from its saved sources, at ``JAXRL_LLM_SMALL=1`` sizes.
"""

import importlib.util
import json
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NB_DIR = os.path.join(ROOT, "notebooks")


def _builder():
  spec = importlib.util.spec_from_file_location(
      "build_notebooks", os.path.join(NB_DIR, "build_notebooks.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


BUILD = _builder()


def _errors(nb):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
          if o.output_type == "error"]


def test_saved_notebooks_match_builder_and_hold_outputs():
  names = sorted(n for n in os.listdir(NB_DIR) if n.endswith(".ipynb"))
  assert names == list(BUILD.NOTEBOOKS)
  for name, built in BUILD.sources().items():
    path = os.path.join(NB_DIR, name)
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert [(c.cell_type, c.source) for c in nb.cells] == [
        (c.cell_type, c.source) for c in built.cells], (
            f"{name} is out of date: run `python notebooks/build_notebooks.py`")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), name
    assert not _errors(nb), (name, _errors(nb))
    text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "SMALL = False" in text, name               # saved at the notebook's sizes
    if name != BUILD.NOTEBOOKS[2]:
      pngs = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
      assert pngs, f"{name}: no plot saved"
    assert os.path.getsize(path) < 400_000, name       # small images only
    # Colab: a badge opening this very file, a clone + install cell, TPU instructions.
    url = (f"https://colab.research.google.com/github/{BUILD.REPO}/blob/{BUILD.BRANCH}"
           f"/notebooks/{name}")
    assert url in nb.cells[0].source and "colab-badge.svg" in nb.cells[0].source
    assert "Change runtime type > TPU" in nb.cells[0].source
    colab = nb.cells[1].source
    assert "google.colab" in colab and "git\", \"clone\"" in colab
    assert f"https://github.com/{BUILD.REPO}.git" in colab and "jax[tpu]" in colab
    assert nb.metadata["accelerator"] == "TPU"


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILD.NOTEBOOKS)
def test_notebook_runs_small(name):
  before = sorted(os.listdir(NB_DIR))
  nb = BUILD.sources()[name]
  # The kernel must be this interpreter (its packages): checked by a first cell.
  nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
  BUILD.execute(nb, small=True, timeout=300)
  assert not _errors(nb), json.dumps(_errors(nb), default=str)[:2000]
  assert os.path.realpath(nb.cells[0].outputs[0]["text"].strip()) == os.path.realpath(
      sys.executable)
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)
  assert "SMALL = True" in text
  # Nothing was written next to the notebooks (runs go to temporary folders).
  assert sorted(os.listdir(NB_DIR)) == before
