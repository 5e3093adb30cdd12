"""Run signals that tell the truth: a warning when a run has stopped learning anything.

A group-baseline update (GRPO, RLOO, DAPO, ...) moves the policy only through groups
whose rewards differ: a step in which every group's rewards are equal (all wrong, a
reward that parses nothing, a budget too short for any answer) has all-zero
advantages, and with the KL term at its minimum (policy = reference) a zero gradient
and a bit-identical model. :class:`SignalWatch` counts such steps: a step has **no
learning signal** when no group's scores vary (for an estimator without a group
baseline, PPO's GAE or self-critical: when no score of the batch differs from the
others), or its gradient norm is exactly 0. After :func:`signal_window` of them in a
row (or every step of a shorter run) it returns one warning line, once per run, with
the fractions of completions cut at the budget and without a parsable answer (what
usually causes it: a budget too short, an answer format the model does not write).

How many steps: a step with ``P`` prompts whose groups of ``G`` samples each succeed
with probability ``p`` has no varying group with probability
``q = (p^G + (1-p)^G)^P``. :func:`signal_window` is the fewest steps ``k`` with
``q^k <= 1%`` at ``p = 5%`` (a task the model solves one time in twenty), kept within
[3, 10]: 3 steps at ``P = 8, G = 4`` (a real model's first run: ``q = 0.19``) and at
the defaults (``P = 32``, ``G = 8``), 10 at the smallest useful setting (``P = 1``,
``G = 8``: ``q = 0.66``, ten in a row by chance 1.6 %). Steps whose samples are all
exactly right are not counted: a solved task has no signal either, but that is news of
another kind.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

# The bounds of the steps without signal before the warning (the module docstring).
MIN_NO_SIGNAL_STEPS, NO_SIGNAL_STEPS = 3, 10


def signal_window(prompts: int, group_size: int, *, success: float = 0.05,
                  false_alarm: float = 0.01) -> int:
  """Consecutive steps without signal that make the warning: the fewest ``k`` with
  ``q^k <= false_alarm``, ``q = (s^G + (1-s)^G)^P`` the chance that a step of ``P``
  prompts in groups of ``G``, each sample right with probability ``s = success``, has
  no varying group; within [:data:`MIN_NO_SIGNAL_STEPS`, :data:`NO_SIGNAL_STEPS`]
  (``G = 1``, no group baseline: the whole batch is one group of ``P``).

  Examples:
    >>> signal_window(8, 4), signal_window(32, 8), signal_window(1, 8), signal_window(4, 8)
    (3, 3, 10, 3)
  """
  prompts, group_size = (1, prompts) if group_size <= 1 else (prompts, group_size)
  q = (success ** group_size + (1 - success) ** group_size) ** prompts
  k = math.ceil(math.log(false_alarm) / math.log(q)) if 0 < q < 1 else NO_SIGNAL_STEPS
  return min(max(k, MIN_NO_SIGNAL_STEPS), NO_SIGNAL_STEPS)


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
    window: steps in a row that make the warning (:func:`signal_window`).
    first_step: the run's first step here (a resumed run starts later).
    last_step: the run's last step (a run shorter than ``window`` warns at its end
      when none of its steps had signal).

  A resumed run continues the streak of the run it resumes: :meth:`state` is saved
  with each checkpoint (the loop's ``extra`` record) and :meth:`restore` reads it
  back, so its rows (``no_learning_signal_steps``) are the uninterrupted run's.

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
  recorded: int = 0         # the last step recorded (0: none): the state's step

  def update(self, step: int, scores: ArrayLike, *, group_size: int,
             grad_norm: float | None, accuracy: float,
             truncated: float | None = None, unparsed: float | None = None
             ) -> str | None:
    """Records train step ``step`` (its scores [B], gradient norm and, where known, the
    fractions of its completions cut at the budget and without a parsable answer);
    returns the warning line the first time the streak is long enough, else None."""
    scores = np.asarray(scores, np.float64)
    flat = groups_with_signal(scores, group_size) == 0
    solved = flat and accuracy >= 1.0
    none = (flat and not solved) or (grad_norm is not None and grad_norm == 0.0)
    self.streak = self.streak + 1 if none else 0
    self.recorded = step
    needed = min(self.window, self.last_step - self.first_step + 1)
    if self.warned is not None or self.streak < needed:
      return None
    start = step - self.streak + 1
    seen = "".join(f", {what} {value:.0%}" for what, value in (
        ("completions cut at --max-new-tokens", truncated),
        ("without a parsable answer", unparsed)) if value is not None)
    self.warned = (
        f"warning: no learning signal in steps {start}-{step} of {self.last_step}: every "
        f"group's rewards were equal (mean reward {float(np.mean(scores)):.3g}{seen}) or "
        "the gradient was 0, so the policy does not change; check that --reward parses "
        "the dataset's answers, that --max-new-tokens leaves room for one, and that the "
        "model solves some prompts")
    return self.warned

  def state(self) -> dict:
    """What a checkpoint saves (JSON): the last step recorded, the streak, the warning
    given (or None) and the run's first step.

    Examples:
      >>> SignalWatch(window=3, first_step=1, last_step=9).state()
      {'step': 0, 'streak': 0, 'warned': None, 'first_step': 1}
    """
    return {"step": self.recorded, "streak": self.streak, "warned": self.warned,
            "first_step": self.first_step}

  def restore(self, saved: Any, step: int) -> bool:
    """Continues from :meth:`state` ``saved`` of a run resumed at ``step``; returns
    whether it did. A state of another step (a Ctrl-C save of a step the watch had not
    recorded yet), or one not well formed (a checkpoint of an older version has none),
    starts afresh at ``step + 1``, as a new run would: no error, a later warning.

    Examples:
      >>> watch = SignalWatch(window=3, first_step=1, last_step=9)
      >>> watch.restore({"step": 4, "streak": 2, "warned": None, "first_step": 1}, 4)
      True
      >>> watch.streak, watch.first_step
      (2, 1)
      >>> watch.restore(None, 4), watch.streak, watch.first_step
      (False, 0, 5)
    """
    ok = (isinstance(saved, dict) and set(saved) == {"step", "streak", "warned", "first_step"}
          and all(type(saved[k]) is int for k in ("step", "streak", "first_step"))
          and saved["step"] == step and 1 <= saved["first_step"] <= step + 1
          and 0 <= saved["streak"] <= step - saved["first_step"] + 1
          and (saved["warned"] is None or isinstance(saved["warned"], str)))
    self.recorded, self.streak, self.warned, self.first_step = (
        (step, saved["streak"], saved["warned"], saved["first_step"]) if ok
        else (step, 0, None, step + 1))
    return ok


__all__ = ["MIN_NO_SIGNAL_STEPS", "NO_SIGNAL_STEPS", "SignalWatch", "groups_with_signal",
           "signal_window"]
