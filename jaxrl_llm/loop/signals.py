"""Run signals that tell the truth: a warning when a run has stopped learning anything.

A group-baseline update (GRPO, RLOO, DAPO, ...) moves the policy only through groups
whose rewards differ: a step in which every group's rewards are equal (all wrong, a
reward that parses nothing, a budget too short for any answer) has all-zero
advantages, and with the KL term at its minimum (policy = reference) a zero gradient
and a bit-identical model. :class:`SignalWatch` counts such steps: a step has **no
learning signal** when no group's scores vary (for an estimator without a group
baseline, PPO's GAE or self-critical: when no score of the batch differs from the
others), or its gradient norm is exactly 0. After
:data:`NO_SIGNAL_STEPS` of them in a row (or every step of a shorter run) it returns one
warning line, once per run.

Why 10 steps: a step with ``P`` prompts whose groups of ``G`` samples each succeed with
probability ``p`` has no varying group with probability ``(p^G + (1-p)^G)^P``; at the
smallest useful setting (``P = 1``, ``G = 8``, ``p = 0.05``: 0.66 per step) ten steps in
a row happen by chance with probability 0.016, and at the defaults (``P = 32``) one step
already has probability < 1e-5: ten steps is a run that learns nothing, said early
(2.5 % of the default 400 steps). Steps whose samples are all exactly right are not
counted: a solved task has no signal either, but that is news of another kind.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import ArrayLike

# Consecutive steps without signal before the warning (see the module docstring).
NO_SIGNAL_STEPS = 10


def groups_with_signal(scores: ArrayLike, group_size: int) -> int:
  """The number of groups (``group_size`` consecutive rows of ``scores`` [B]) whose
  scores are not all equal.

  Examples:
    >>> groups_with_signal([0., 0., 1., 0., 2., 2.], 2)
    1
  """
  scores = np.asarray(scores, np.float64).reshape(-1, group_size)
  return int(np.sum(np.ptp(scores, axis=1) > 0))


@dataclasses.dataclass
class SignalWatch:
  """Counts consecutive train steps without learning signal (see the module doc).

  Args:
    window: steps in a row that make the warning (:data:`NO_SIGNAL_STEPS`).
    first_step: the run's first step here (a resumed run starts later).
    last_step: the run's last step (a run shorter than ``window`` warns at its end
      when none of its steps had signal).

  Examples:
    >>> watch = SignalWatch(window=2, first_step=1, last_step=5)
    >>> watch.update(1, [0., 0.], group_size=2, grad_norm=0.0, accuracy=0.0) is None
    True
    >>> watch.update(2, [0., 0.], group_size=2, grad_norm=0.0, accuracy=0.0)[:43]
    'warning: no learning signal in steps 1-2 of'
  """
  window: int = NO_SIGNAL_STEPS
  first_step: int = 1
  last_step: int = 1
  streak: int = 0
  warned: str | None = None

  def update(self, step: int, scores: ArrayLike, *, group_size: int,
             grad_norm: float | None, accuracy: float) -> str | None:
    """Records train step ``step`` (its scores [B] and gradient norm); returns the
    warning line the first time the streak is long enough, else None."""
    scores = np.asarray(scores, np.float64)
    flat = groups_with_signal(scores, group_size) == 0
    solved = flat and accuracy >= 1.0
    none = (flat and not solved) or (grad_norm is not None and grad_norm == 0.0)
    self.streak = self.streak + 1 if none else 0
    needed = min(self.window, self.last_step - self.first_step + 1)
    if self.warned is not None or self.streak < needed:
      return None
    start = step - self.streak + 1
    self.warned = (
        f"warning: no learning signal in steps {start}-{step} of {self.last_step}: every "
        f"group's rewards were equal (mean reward {float(np.mean(scores)):.3g}) or the "
        "gradient was 0, so the policy does not change; check that --reward parses the "
        "dataset's answers, that --max-new-tokens leaves room for one, and that the model "
        "solves some prompts")
    return self.warned


__all__ = ["NO_SIGNAL_STEPS", "SignalWatch", "groups_with_signal"]
