"""The pieces of the RL loop (:func:`jaxrl_llm.trainer.run_training`), one job each.

* :mod:`~jaxrl_llm.loop.config`: :class:`RunConfig` (the run; composes the train
  config with a recipe) and the optimizer.
* :mod:`~jaxrl_llm.loop.policy`: :class:`Policy`, any model following the forward
  and decode protocols as jitted functions.
* :mod:`~jaxrl_llm.loop.batch`: one rollout turned into a train batch.
* :mod:`~jaxrl_llm.loop.evaluation`: greedy held-out accuracy.
* :mod:`~jaxrl_llm.loop.progress`: the progress line.
"""

from typing import TYPE_CHECKING

from jaxrl_llm._lazy import lazy_namespace, public_names

if TYPE_CHECKING:  # the names as static imports, for type checkers and IDEs
  from jaxrl_llm.loop.batch import build_batch, sequence_advantages
  from jaxrl_llm.loop.config import (MODELS, RESUMABLE_FIELDS, RunConfig, algos,
                                     make_optimizer, train_config_for)
  from jaxrl_llm.loop.evaluation import decode, evaluate
  from jaxrl_llm.loop.policy import Policy
  from jaxrl_llm.loop.progress import report_progress

# Module -> its public names, imported on first access (see jaxrl_llm._lazy).
_EXPORTS = {
    "jaxrl_llm.loop.config": ("RunConfig", "MODELS", "RESUMABLE_FIELDS", "algos",
                              "make_optimizer", "train_config_for"),
    "jaxrl_llm.loop.policy": ("Policy",),
    "jaxrl_llm.loop.batch": ("build_batch", "sequence_advantages"),
    "jaxrl_llm.loop.evaluation": ("evaluate", "decode"),
    "jaxrl_llm.loop.progress": ("report_progress",),
}
__all__ = public_names(_EXPORTS)

__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS, globals())
