"""The pieces of the RL loop (:func:`jaxrl_llm.trainer.run_training`), one job each.

* :mod:`~jaxrl_llm.loop.config`: :class:`RunConfig` (the run; composes the train
  config with a recipe) and the optimizer.
* :mod:`~jaxrl_llm.loop.policy`: :class:`Policy`, any model following the forward
  and decode protocols as jitted functions.
* :mod:`~jaxrl_llm.loop.batch`: one rollout turned into a train batch.
* :mod:`~jaxrl_llm.loop.evaluation`: greedy held-out accuracy.
* :mod:`~jaxrl_llm.loop.progress`: the progress line.
"""

from jaxrl_llm.loop.batch import build_batch, sequence_advantages
from jaxrl_llm.loop.config import (MODELS, RESUMABLE_FIELDS, RunConfig, algos,
                                   make_optimizer, train_config_for)
from jaxrl_llm.loop.evaluation import decode, evaluate
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.loop.progress import report_progress

__all__ = ["RunConfig", "MODELS", "RESUMABLE_FIELDS", "algos", "make_optimizer",
           "train_config_for", "Policy", "build_batch", "sequence_advantages", "evaluate",
           "decode", "report_progress"]
