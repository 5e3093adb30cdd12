"""Addition of two small non-negative integers: ``"47+85="`` -> ``"132"``.

Reward (``partial`` = p):

.. math::
  r = \\begin{cases} 1 & c = a \\\\ p \\cdot \\mathrm{match}_{\\text{right}}(a, c)
  & \\text{otherwise} \\end{cases}

where ``match_right`` is `position_match` aligned on the last digit (units with units),
so ``"32"`` for ``"132"`` earns 2/3 of the partial credit. The answer is written
without leading zeros; ``"0132"`` is not exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm.tasks.base import Problem, Task, position_match


@dataclasses.dataclass(frozen=True, kw_only=True)
class AddTask(Task):
  """``a+b=`` with ``a, b`` uniform in ``[min_value, max_value]``; answer ``a + b``.

  Attributes:
    min_value: smallest operand (>= 0).
    max_value: largest operand.
    partial: weight of the per-digit partial credit, in [0, 1].

  Examples:
    >>> task = AddTask()
    >>> p = Problem("47+85=", "132")
    >>> task.reward(p, "132"), task.reward(p, "32"), task.reward(p, "13")
    (1.0, 0.3333333333333333, 0.0)
  """

  name = "add"
  min_value: int = 0
  max_value: int = 99
  partial: float = 0.5

  def __post_init__(self) -> None:
    super().__post_init__()
    if not 0 <= self.min_value <= self.max_value:
      raise ValueError(
          f"`min_value` and `max_value` must satisfy 0 <= min_value <= max_value, got "
          f"min_value={self.min_value}, max_value={self.max_value}.")
    if not 0.0 <= self.partial <= 1.0:
      raise ValueError(f"`partial` must be in [0, 1], got {self.partial!r}.")

  @property
  def max_prompt_len(self) -> int:
    return 2 * len(str(self.max_value)) + 2

  @property
  def max_new_tokens(self) -> int:
    return len(str(2 * self.max_value)) + 1

  def draw(self, rng: np.random.Generator) -> Problem:
    a, b = (int(x) for x in rng.integers(self.min_value, self.max_value + 1, size=2))
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

  def is_correct(self, problem: Problem, completion: str) -> bool:
    return completion == problem.answer

  def reward(self, problem: Problem, completion: str) -> float:
    if self.is_correct(problem, completion):
      return 1.0
    return self.partial * position_match(problem.answer, completion, align="right")
