"""Test-suite setup: a deterministic hypothesis profile; worker scripts never imported.

The XLA options and the persistent compilation cache shared by every test, doctest and
subprocess are set in the repository's root ``conftest.py`` (loaded first).

* A deterministic hypothesis profile (``jaxrl_llm``, loaded by default): examples are
  derived from each test's name (``derandomize=True``), nothing is stored or replayed
  from a ``.hypothesis/`` example database (``database=None``), no per-example
  deadline (the first example of a jitted test includes its compilation). Every run
  of the suite tries the same inputs, so a failure reproduces and a pass is not luck.
  ``HYPOTHESIS_PROFILE=explore`` tries fresh random inputs (more of them) to hunt for
  new failures; a test's own ``@settings(max_examples=...)`` still caps its count.
* ``*_worker.py`` scripts force their own device count and XLA options when imported:
  they run only as subprocesses, so ``--doctest-modules`` must not import them here.
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("jaxrl_llm", derandomize=True, database=None, deadline=None,
                          max_examples=25, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, deadline=None,
                          max_examples=200, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxrl_llm"))

collect_ignore_glob = ["*_worker.py"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  """Runs the ``slow`` tests first, and makes ``--dist loadgroup`` group again.

  Slow first (a stable sort: otherwise in collection order): with two xdist workers
  the long tests (training loops, subprocesses, notebooks) start at once and the many
  short ones fill in around them, instead of one long test starting last while the
  other worker idles.

  xdist marks a test of an ``xdist_group`` by renaming it ``<nodeid>@<group>`` through
  ``item._nodeid``, which pytest 9 no longer reads (the id lives in ``item._id``): the
  groups were silently ignored, and a module fixture shared by a group (the 8-device
  worker subprocess of test_parallel / test_ring) ran once on each xdist worker. The
  same renaming through ``item._id``; a no-op where xdist's own works.
  """
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
  if not (getattr(config.option, "loadgroup", False)
          or config.getoption("dist", "no") == "loadgroup"):
    return
  try:
    from _pytest.nodeid import coerce_node_id
  except ImportError:       # pytest < 9: xdist's own renaming works
    return
  for item in items:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    grouped = item.nodeid.rfind("@") > item.nodeid.rfind("]")    # xdist's own test
    if names and not grouped and hasattr(item, "_id"):
      item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
