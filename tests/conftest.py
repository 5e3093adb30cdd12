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

from hypothesis import settings

settings.register_profile("jaxrl_llm", derandomize=True, database=None, deadline=None,
                          max_examples=25, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, deadline=None,
                          max_examples=200, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxrl_llm"))

collect_ignore_glob = ["*_worker.py"]


def pytest_collection_modifyitems(items):
  """Runs the ``slow`` tests first (a stable sort: otherwise in collection order).

  With two xdist workers the long tests (training loops, subprocesses, notebooks) then
  start at once and the many short ones fill in around them, instead of one long test
  starting last while the other worker idles. Tests of one ``xdist_group`` stay
  together (they are all slow or all fast), so a module fixture they share is built
  once.
  """
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
