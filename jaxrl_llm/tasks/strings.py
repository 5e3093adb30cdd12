"""String-transformation tasks: copy, reverse and sort a short digit string.

Prompt ``"<s>="``, answer ``f(s)``, then eos. E.g. reverse: ``"384="`` -> ``"483"``.
Reward (``partial`` = p):

.. math::
  r = \\begin{cases} 1 & c = a \\\\ p \\cdot \\mathrm{match}(a, c) & \\text{otherwise}
  \\end{cases}

where ``match`` is the left-aligned `position_match` (missing or extra characters
count as wrong). ``partial=0`` gives the sparse exact-match reward. The completion is
compared as is: no stripping, so the policy must stop with eos.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from jaxrl_llm.tasks.base import Problem, Task, position_match
from jaxrl_llm.tasks.tokenizer import DIGITS


@dataclasses.dataclass(frozen=True, kw_only=True)
class StringTask(Task):
  """Base of the string tasks: a random string of ``min_len..max_len`` characters.

  Attributes:
    min_len: shortest input string.
    max_len: longest input string.
    chars: the characters strings are drawn from (must be in the tokenizer).
    partial: weight of the per-position partial credit, in [0, 1].
  """

  name = "string"
  min_len: int = 3
  max_len: int = 3
  chars: str = DIGITS
  partial: float = 0.5

  def __post_init__(self) -> None:
    super().__post_init__()
    if not 1 <= self.min_len <= self.max_len:
      raise ValueError(
          f"`min_len` and `max_len` must satisfy 1 <= min_len <= max_len, got "
          f"min_len={self.min_len}, max_len={self.max_len}.")
    if not self.chars or any(c not in self.tokenizer.chars or c == "=" for c in self.chars):
      raise ValueError(
          f"`chars` {self.chars!r} must be non-empty, exclude '=' and lie in the "
          f"tokenizer vocabulary {self.tokenizer.chars!r}.")
    if not 0.0 <= self.partial <= 1.0:
      raise ValueError(f"`partial` must be in [0, 1], got {self.partial!r}.")

  @abc.abstractmethod
  def transform(self, s: str) -> str:
    """The answer for input string ``s``."""

  @property
  def max_prompt_len(self) -> int:
    return self.max_len + 1

  @property
  def max_new_tokens(self) -> int:
    return self.max_len + 1

  @property
  def answer_chars(self) -> str:
    return self.chars

  def draw(self, rng: np.random.Generator) -> Problem:
    return self._problem(rng, int(rng.integers(self.min_len, self.max_len + 1)))

  def _problem(self, rng: np.random.Generator, n: int) -> Problem:
    """The problem of a random ``n``-character input."""
    s = "".join(self.chars[i] for i in rng.integers(0, len(self.chars), size=n))
    return Problem(prompt=s + "=", answer=self.transform(s))

  def is_correct(self, problem: Problem, completion: str) -> bool:
    return completion == problem.answer

  def reward(self, problem: Problem, completion: str) -> float:
    if self.is_correct(problem, completion):
      return 1.0
    return self.partial * position_match(problem.answer, completion)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CopyTask(StringTask):
  """Repeat the string: ``"384="`` -> ``"384"``."""

  name = "copy"

  def transform(self, s: str) -> str:
    return s


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReverseTask(StringTask):
  """Reverse the string: ``"384="`` -> ``"483"``.

  Examples:
    >>> task = ReverseTask()
    >>> p = Problem("384=", "483")
    >>> task.reward(p, "483"), task.reward(p, "489"), task.reward(p, "")
    (1.0, 0.3333333333333333, 0.0)
  """

  name = "reverse"

  def transform(self, s: str) -> str:
    return s[::-1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SortTask(StringTask):
  """Sort the characters ascending: ``"3142="`` -> ``"1234"`` (lengths 3-4 by default)."""

  name = "sort"
  min_len: int = 3
  max_len: int = 4

  def transform(self, s: str) -> str:
    return "".join(sorted(s))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepeatTask(StringTask):
  """Long response: write the string over and over, ``answer_len`` characters in all.

  ``"384="`` -> ``"384384384...38"`` (200 characters by default), then eos. Every
  answer token is a copy of the token ``len(s)`` positions back, so a tiny model can
  learn it, but the answer is long and the reward is a single number given at the
  end: what this task tests is credit assignment over a long response (PPO with GAE
  and a critic vs. group baselines), not reasoning. The reward is 1 for the exact
  answer and ``partial * position_match`` otherwise, so stopping at the right length
  matters (missing or extra characters count as wrong).

  Attributes:
    answer_len: length of the answer in characters (= generated tokens minus eos).

  Examples:
    >>> task = RepeatTask(answer_len=10)
    >>> task.transform("384"), task.max_new_tokens
    ('3843843843', 11)
    >>> p = Problem("384=", "3843843843")
    >>> task.reward(p, "3843843843"), task.reward(p, "38438438")
    (1.0, 0.4)
  """

  name = "repeat"
  min_len: int = 3
  max_len: int = 4
  answer_len: int = 200

  def __post_init__(self) -> None:
    super().__post_init__()
    if not isinstance(self.answer_len, int) or self.answer_len < self.max_len:
      raise ValueError(
          f"`answer_len` must be an int >= max_len ({self.max_len}), got "
          f"{self.answer_len!r}.")

  @property
  def max_new_tokens(self) -> int:
    return self.answer_len + 1

  def transform(self, s: str) -> str:
    return _repeat_to(s, self.answer_len)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedRepeatTask(RepeatTask):
  """:class:`RepeatTask` with heavy-tailed answer lengths: a ``max_len``-character input
  (drawn with probability ``long_share``) is repeated
  to ``answer_len`` characters, a shorter one to ``short_len``. The input's length tells
  the model which, so the lengths stay heavy-tailed as it learns (on ``repeat`` every
  trained response grows towards the cap): the workload of partial rollouts, where a
  synchronous step waits for its few long answers.

  Attributes:
    short_len: answer length of the short inputs (``min_len .. max_len - 1`` chars).
    long_share: probability that a prompt is long (``max_len`` characters).

  Examples:
    >>> task = MixedRepeatTask(answer_len=12, short_len=4)
    >>> task.transform("384"), task.transform("3841"), task.max_new_tokens
    ('3843', '384138413841', 13)
    >>> lengths = [len(p.answer) for p in task.sample_prompts(np.random.default_rng(0), 800)]
    >>> lengths.count(12), lengths.count(4)      # about 1 in 8 long
    (125, 675)
  """

  name = "repeat_mixed"
  short_len: int = 20
  long_share: float = 0.125

  def __post_init__(self) -> None:
    super().__post_init__()
    if self.min_len >= self.max_len:
      raise ValueError(f"`min_len` must be below `max_len` (short inputs are "
                       f"min_len..max_len - 1 characters), got {self.min_len}, "
                       f"{self.max_len}.")
    if not isinstance(self.short_len, int) or not 1 <= self.short_len <= self.answer_len:
      raise ValueError(f"`short_len` must be an int in [1, answer_len], got "
                       f"{self.short_len!r}.")
    if not 0.0 <= self.long_share <= 1.0:
      raise ValueError(f"`long_share` must be in [0, 1], got {self.long_share!r}.")

  def draw(self, rng: np.random.Generator) -> Problem:
    return self._problem(rng, self.max_len if rng.random() < self.long_share
                         else int(rng.integers(self.min_len, self.max_len)))

  def transform(self, s: str) -> str:
    return _repeat_to(s, self.answer_len if len(s) == self.max_len else self.short_len)


def _repeat_to(s: str, length: int) -> str:
  """``s`` written over and over, cut to ``length`` characters."""
  return (s * (-(-length // len(s))))[:length]
