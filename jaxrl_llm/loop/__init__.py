"""The RL loop (:func:`jaxrl_llm.loop.run.run_training`) and its pieces, one job each.

* :mod:`~jaxrl_llm.loop.config`: :class:`RunConfig`, the run as plain data.
* :mod:`~jaxrl_llm.loop.recipes`: the algorithm recipes (one :class:`Recipe` each).
* :mod:`~jaxrl_llm.loop.resolve`: :func:`resolve`, the one reader of recipes: the run's
  train config, optimizer, sampling settings and critic warm-up.
* :mod:`~jaxrl_llm.loop.run`: :func:`run_training`, the loop itself.
* :mod:`~jaxrl_llm.loop.policy`: :class:`Policy`, any model following the forward
  and decode protocols as jitted functions.
* :mod:`~jaxrl_llm.loop.batch`: one rollout turned into a train batch.
* :mod:`~jaxrl_llm.loop.partial`: :class:`PartialRollouts`, groups in flight across
  steps (``--partial-rollouts``).
* :mod:`~jaxrl_llm.loop.evaluation`: greedy held-out accuracy.
* :mod:`~jaxrl_llm.loop.progress`: the progress line.
"""

from typing import TYPE_CHECKING

from jaxrl_llm._lazy import lazy_namespace, public_names

if TYPE_CHECKING:  # the names as static imports, for type checkers and IDEs
  from jaxrl_llm.loop.batch import build_batch
  from jaxrl_llm.loop.config import RESUMABLE_FIELDS, RunConfig
  from jaxrl_llm.loop.evaluation import decode, evaluate
  from jaxrl_llm.loop.partial import PartialRollouts
  from jaxrl_llm.loop.policy import Policy
  from jaxrl_llm.loop.progress import report_progress
  from jaxrl_llm.loop.recipes import RECIPES, Recipe, get_recipe, register_recipe
  from jaxrl_llm.loop.resolve import Resolved, resolve
  from jaxrl_llm.loop.run import SkippedUpdatesError, run_training

# Module -> its public names, imported on first access (see jaxrl_llm._lazy).
_EXPORTS = {
    "jaxrl_llm.loop.config": ("RunConfig", "RESUMABLE_FIELDS"),
    "jaxrl_llm.loop.recipes": ("Recipe", "RECIPES", "get_recipe", "register_recipe"),
    "jaxrl_llm.loop.resolve": ("Resolved", "resolve"),
    "jaxrl_llm.loop.run": ("run_training", "SkippedUpdatesError"),
    "jaxrl_llm.loop.policy": ("Policy",),
    "jaxrl_llm.loop.batch": ("build_batch",),
    "jaxrl_llm.loop.partial": ("PartialRollouts",),
    "jaxrl_llm.loop.evaluation": ("evaluate", "decode"),
    "jaxrl_llm.loop.progress": ("report_progress",),
}
__all__ = public_names(_EXPORTS)

__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS, globals())
