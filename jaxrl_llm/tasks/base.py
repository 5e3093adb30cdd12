"""The `Task` base class and the `Problem` record every built-in task uses.

A task draws problems (a prompt and what is needed to verify an answer) from a seeded
``np.random.Generator`` and scores completion strings. To write your own, subclass
`Task` as a ``kw_only`` frozen dataclass and implement `Task.draw`, `Task.is_correct`,
`Task.max_prompt_len` and `Task.max_new_tokens`; override `Task.reward` to add partial
credit (it defaults to exact match). See `jaxrl_llm.tasks.strings.ReverseTask` for a
complete small example.

Train/eval split. Each problem has a key (by default its prompt); a problem is
*held out* when ``crc32(key) mod 10_000 < holdout * 10_000``. `Task.sample_prompts`
rejects held-out problems and `Task.eval_problems` draws only held-out ones from a
fixed seed, so the two never share a problem while ``holdout > 0``. With
``holdout=0`` eval problems come from the fixed ``eval_seed`` stream and may also be
drawn in training.
"""

from __future__ import annotations

import abc
import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from jaxrl_llm.tasks.tokenizer import CharTokenizer

_DEFAULT_TOKENIZER = CharTokenizer()
_HASH_BUCKETS = 10_000


@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance.

  Attributes:
    prompt: the text the policy is conditioned on.
    answer: a reference answer (the unique one for string tasks; one valid solution
      for tasks with several, like countdown).
    info: whatever else the reward needs (e.g. countdown's numbers and target).
  """

  prompt: str
  answer: str
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task(abc.ABC):
  """Base class of verifiable-reward tasks.

  Attributes:
    holdout: fraction of the problem space kept for evaluation only, in [0, 1).
    eval_seed: seed of the `eval_problems` stream.
    name: registry name (a class attribute).
  """

  name: ClassVar[str] = "task"
  holdout: float = 0.1
  eval_seed: int = 1234

  def __post_init__(self) -> None:
    if not 0.0 <= self.holdout < 1.0:
      raise ValueError(f"`holdout` must be in [0, 1), got {self.holdout!r}.")

  # ---- what a subclass implements ------------------------------------------------

  @property
  @abc.abstractmethod
  def max_prompt_len(self) -> int:
    """The most tokens a prompt takes (without bos)."""

  @property
  @abc.abstractmethod
  def max_new_tokens(self) -> int:
    """Tokens to sample per completion: the longest answer plus one for eos."""

  @abc.abstractmethod
  def draw(self, rng: np.random.Generator) -> Problem:
    """One problem drawn from ``rng`` (before the train/eval split)."""

  @abc.abstractmethod
  def is_correct(self, problem: Problem, completion: str) -> bool:
    """Whether ``completion`` solves ``problem`` exactly."""

  def reward(self, problem: Problem, completion: str) -> float:
    """Reward in [0, 1]; 1.0 exactly when `is_correct`. Default: exact match only."""
    return float(self.is_correct(problem, completion))

  def parsed(self, problems: Sequence[Problem], completions: Sequence[str]
             ) -> np.ndarray | None:
    """Whether the task found an answer in each completion (bool ``[n]``), or None
    when it does not say (the default: a built-in task scores any text). The run
    reports the unparsed fraction (``unparsed_frac``) and names it when a run has no
    learning signal (:mod:`jaxrl_llm.loop.signals`)."""
    del problems, completions
    return None

  # ---- shared machinery ------------------------------------------------------------

  @property
  def tokenizer(self) -> CharTokenizer:
    """The tokenizer whose vocabulary covers every prompt and answer of the task."""
    return _DEFAULT_TOKENIZER

  @property
  def answer_chars(self) -> str:
    """The characters answers are made of (used by `random_baseline`)."""
    return "0123456789"

  @property
  def eval_on_train_rows(self) -> bool:
    """Whether evaluation problems may also be training problems: no held-out split
    (``holdout == 0``), so eval accuracy may measure memorisation.

    Examples:
      >>> from jaxrl_llm.tasks import get_task
      >>> [get_task("reverse", holdout=h).eval_on_train_rows for h in (0.1, 0.0)]
      [False, True]
    """
    return self.holdout == 0.0

  def split_key(self, problem: Problem) -> str:
    """The string hashed for the train/eval split (the prompt by default)."""
    return problem.prompt

  def is_heldout(self, problem: Problem) -> bool:
    """Whether ``problem`` belongs to the eval split."""
    h = zlib.crc32(self.split_key(problem).encode("utf-8")) % _HASH_BUCKETS
    return h < int(round(self.holdout * _HASH_BUCKETS))

  def _draw_split(self, rng: np.random.Generator, n: int, heldout: bool) -> list[Problem]:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
      raise ValueError(f"`n` must be a non-negative int, got {n!r}.")
    if heldout and self.holdout == 0.0:
      return [self.draw(rng) for _ in range(n)]
    out: list[Problem] = []
    tries, max_tries = 0, 1000 * max(n, 1)
    while len(out) < n:
      p = self.draw(rng)
      if self.is_heldout(p) == heldout:
        out.append(p)
      tries += 1
      if tries > max_tries and len(out) < n:
        raise ValueError(
            f"could not draw {n} {'eval' if heldout else 'train'} problems of task "
            f"{self.name!r} in {max_tries} tries; change `holdout`={self.holdout}.")
    return out

  def sample_prompts(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` training problems from ``rng`` (never held-out ones).

    Examples:
      >>> from jaxrl_llm.tasks import get_task
      >>> task = get_task("reverse")
      >>> probs = task.sample_prompts(np.random.default_rng(0), 2)
      >>> [(p.prompt, p.answer) for p in probs]
      [('865=', '568'), ('230=', '032')]
    """
    return self._draw_split(rng, n, heldout=False)

  def eval_problems(self, n: int = 256) -> list[Problem]:
    """``n`` held-out problems, the same on every call (drawn from ``eval_seed``).

    Small problem spaces repeat problems once ``n`` exceeds the held-out count.
    """
    return self._draw_split(np.random.default_rng(self.eval_seed), n, heldout=True)

  def _check_pairs(self, problems, completions):
    if isinstance(completions, str):
      raise ValueError("`completions` must be a sequence of strings, got a single string.")
    if len(problems) != len(completions):
      raise ValueError(
          f"`completions` must have one entry per problem: got {len(completions)} "
          f"completions for {len(problems)} `problems`.")

  def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> np.ndarray:
    """`reward` of each (problem, completion) pair, as float32 [n].

    Examples:
      >>> from jaxrl_llm.tasks import get_task
      >>> task = get_task("reverse")
      >>> p = Problem("123=", "321")
      >>> task.score([p, p, p], ["321", "391", "xyz"]).tolist()
      [1.0, 0.3333333432674408, 0.0]
    """
    self._check_pairs(problems, completions)
    return np.asarray(
        [self.reward(p, c) for p, c in zip(problems, completions)], np.float32)

  def exact(self, problems: Sequence[Problem], completions: Sequence[str]) -> np.ndarray:
    """`is_correct` of each pair, as bool [n]."""
    self._check_pairs(problems, completions)
    return np.asarray(
        [bool(self.is_correct(p, c)) for p, c in zip(problems, completions)], bool)


class PoolTask(Task):
  """A task over two fixed tuples of problems: ``self._train`` (what
  :meth:`sample_prompts` and :meth:`draw` draw from, uniformly with replacement) and
  ``self._eval`` (whose first ``n`` :meth:`eval_problems` returns, the same on every
  call); a subclass builds both (a file's rows, a generator's entries)."""

  _train: tuple[Problem, ...]
  _eval: tuple[Problem, ...]

  @property
  def problems(self) -> tuple[Problem, ...]:
    """The training problems, in the order the subclass built them."""
    return self._train

  def draw(self, rng: np.random.Generator) -> Problem:
    return self._train[int(rng.integers(len(self._train)))]

  def sample_prompts(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` training problems drawn uniformly with replacement from ``rng``."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
      raise ValueError(f"`n` must be a non-negative int, got {n!r}.")
    return [self._train[int(i)] for i in rng.integers(len(self._train), size=n)]

  def eval_problems(self, n: int = 256) -> list[Problem]:
    """The first ``min(n, len(evaluation split))`` evaluation problems, in order."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
      raise ValueError(f"`n` must be a non-negative int, got {n!r}.")
    return list(self._eval[:n])


def position_match(answer: str, completion: str, *, align: str = "left") -> float:
  """Fraction of aligned positions where ``completion`` equals ``answer``.

  .. math::
    \\mathrm{match} = \\frac{\\#\\{i : a_i = c_i\\}}{\\max(|a|, |c|)}

  with positions counted from the left (``align="left"``) or from the right
  (``align="right"``, for numbers). Missing and extra characters count as wrong, so it
  is 1 exactly when the strings are equal, and 0 for an empty completion.

  Examples:
    >>> position_match("321", "324")
    0.6666666666666666
    >>> position_match("321", "3210")  # a trailing character costs a position
    0.75
    >>> position_match("132", "32", align="right")
    0.6666666666666666
  """
  if align not in ("left", "right"):
    raise ValueError(f"`align` must be one of ['left', 'right'], got {align!r}.")
  n = max(len(answer), len(completion))
  if n == 0:
    return 1.0
  if align == "right":
    answer, completion = answer[::-1], completion[::-1]
  return sum(a == c for a, c in zip(answer, completion)) / n


def random_baseline(task: Task, n: int = 2000, seed: int = 0) -> dict[str, float]:
  """Exact-match rate and mean reward of uniformly random answers.

  Each completion is a uniform random string over ``task.answer_chars`` with the
  length of the problem's reference answer, on ``n`` eval problems. This is the floor
  a learned policy must beat (a freshly initialised model, sampling over the whole
  vocabulary and free to stop anywhere, usually scores lower still).

  Returns:
    ``{"exact": rate, "reward": mean reward}``.
  """
  rng = np.random.default_rng(seed)
  problems = task.eval_problems(n)
  chars = np.array(list(task.answer_chars))
  completions = ["".join(rng.choice(chars, size=len(p.answer))) for p in problems]
  return {"exact": float(task.exact(problems, completions).mean()),
          "reward": float(task.score(problems, completions).mean())}
