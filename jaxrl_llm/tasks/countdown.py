"""Countdown: combine the given numbers with ``+ - *`` to reach a target.

Prompt ``"3,5,7=22"`` (numbers, then target); a solution is an expression that uses
every given number exactly once (as a multiset) and evaluates to the target, e.g.
``"3*5+7"`` or ``"7+5*3"``. Parentheses and spaces are allowed, unary minus and leading
zeros are not; the expression is parsed by a small recursive-descent parser, never by
``eval``. Every target is reachable without parentheses (it is built from a random
unparenthesised expression), so the default ``max_new_tokens`` leaves room for exactly
that form plus eos.

Reward (``partial`` = p):

.. math::
  r = \\begin{cases} 1 & \\text{solved} \\\\
  p \\cdot (\\tfrac12 [\\text{valid}] + \\tfrac12 [\\text{valid and uses the numbers}])
  & \\text{otherwise} \\end{cases}
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm.tasks.base import Problem, Task

MAX_EXPRESSION_LEN = 64


def _lex(text: str) -> list[str]:
  tokens, i = [], 0
  while i < len(text):
    c = text[i]
    if c == " ":
      i += 1
    elif c.isdigit() and c.isascii():
      j = i
      while j < len(text) and text[j].isdigit() and text[j].isascii():
        j += 1
      if text[i] == "0" and j - i > 1:
        raise ValueError(f"number with a leading zero at {i} in {text!r}")
      tokens.append(text[i:j])
      i = j
    elif c in "+-*()":
      tokens.append(c)
      i += 1
    else:
      raise ValueError(f"unexpected character {c!r} at {i} in {text!r}")
  return tokens


def parse_expression(text: str) -> tuple[int, list[int]]:
  """Value and number literals of an integer expression over ``+ - * ( )``.

  Grammar (usual precedence, left associative, no unary operators)::

    expr   := term (("+" | "-") term)*
    term   := factor ("*" factor)*
    factor := NUMBER | "(" expr ")"

  Args:
    text: the expression; spaces are ignored. At most ``MAX_EXPRESSION_LEN``
      characters, which bounds the recursion depth and the size of the integers.

  Returns:
    ``(value, literals)``: the integer value and the numbers in order of appearance.

  Raises:
    ValueError: on any syntax error, an unknown character, a leading zero, or a too
      long ``text``.

  Examples:
    >>> parse_expression("3*5+7")
    (22, [3, 5, 7])
    >>> parse_expression("(7-5)*3")
    (6, [7, 5, 3])
  """
  if not isinstance(text, str):
    raise ValueError(f"`text` must be a str, got {type(text).__name__}.")
  if len(text) > MAX_EXPRESSION_LEN:
    raise ValueError(f"`text` is {len(text)} characters, over {MAX_EXPRESSION_LEN}.")
  tokens = _lex(text)
  literals: list[int] = []
  pos = 0

  def peek():
    return tokens[pos] if pos < len(tokens) else None

  def expr() -> int:
    nonlocal pos
    v = term()
    while peek() in ("+", "-"):
      op = tokens[pos]
      pos += 1
      w = term()
      v = v + w if op == "+" else v - w
    return v

  def term() -> int:
    nonlocal pos
    v = factor()
    while peek() == "*":
      pos += 1
      v *= factor()
    return v

  def factor() -> int:
    nonlocal pos
    t = peek()
    if t is None:
      raise ValueError(f"unexpected end of {text!r}")
    if t == "(":
      pos += 1
      v = expr()
      if peek() != ")":
        raise ValueError(f"missing ')' in {text!r}")
      pos += 1
      return v
    if t.isdigit():
      pos += 1
      literals.append(int(t))
      return int(t)
    raise ValueError(f"unexpected {t!r} in {text!r}")

  value = expr()
  if pos != len(tokens):
    raise ValueError(f"unexpected {tokens[pos]!r} in {text!r}")
  return value, literals


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownTask(Task):
  """Reach ``target`` from ``n_numbers`` numbers in ``[1, max_number]`` with ``+ - *``.

  Attributes:
    n_numbers: how many numbers each problem gives.
    max_number: the largest number.
    min_target: smallest target drawn.
    max_target: largest target drawn.
    partial: weight of the format credit, in [0, 1].
    extra_new_tokens: decoding room beyond the shortest solution form (e.g. 2 for one
      pair of parentheses).

  Examples:
    >>> task = CountdownTask()
    >>> p = Problem("3,5,7=22", "3*5+7", {"numbers": (3, 5, 7), "target": 22})
    >>> [task.reward(p, c) for c in ["7+3*5", "3+5+7", "3+5", "3+5+", "3+3+5"]]
    [1.0, 0.2, 0.1, 0.0, 0.1]
  """

  name = "countdown"
  n_numbers: int = 3
  max_number: int = 9
  min_target: int = 0
  max_target: int = 99
  partial: float = 0.2
  extra_new_tokens: int = 0

  def __post_init__(self) -> None:
    super().__post_init__()
    if self.n_numbers < 2:
      raise ValueError(f"`n_numbers` must be >= 2, got {self.n_numbers}.")
    if self.max_number < 1:
      raise ValueError(f"`max_number` must be >= 1, got {self.max_number}.")
    if not 0 <= self.min_target <= self.max_target:
      raise ValueError(
          f"`min_target` and `max_target` must satisfy 0 <= min_target <= max_target, "
          f"got min_target={self.min_target}, max_target={self.max_target}.")
    if not 0.0 <= self.partial <= 1.0:
      raise ValueError(f"`partial` must be in [0, 1], got {self.partial!r}.")
    if self.extra_new_tokens < 0:
      raise ValueError(f"`extra_new_tokens` must be >= 0, got {self.extra_new_tokens}.")

  @property
  def max_prompt_len(self) -> int:
    digits = len(str(self.max_number))
    return self.n_numbers * (digits + 1) + len(str(self.max_target))

  @property
  def max_new_tokens(self) -> int:
    digits = len(str(self.max_number))
    return self.n_numbers * (digits + 1) + self.extra_new_tokens

  @property
  def answer_chars(self) -> str:
    return "0123456789+-*"

  def draw(self, rng: np.random.Generator) -> Problem:
    for _ in range(10_000):
      nums = [int(x) for x in rng.integers(1, self.max_number + 1, size=self.n_numbers)]
      ops = [("+", "-", "*")[i] for i in rng.integers(0, 3, size=self.n_numbers - 1)]
      order = rng.permutation(self.n_numbers)
      expr = str(nums[order[0]]) + "".join(
          op + str(nums[i]) for op, i in zip(ops, order[1:]))
      target, _ = parse_expression(expr)
      if self.min_target <= target <= self.max_target:
        prompt = ",".join(map(str, nums)) + "=" + str(target)
        return Problem(prompt, expr, {"numbers": tuple(nums), "target": target})
    raise ValueError(
        f"no target in [{self.min_target}, {self.max_target}] found; widen the range.")

  def _check(self, problem: Problem, completion: str) -> tuple[bool, bool, bool]:
    """(valid, uses the numbers exactly once, solved)."""
    try:
      value, literals = parse_expression(completion)
    except ValueError:
      return False, False, False
    uses = sorted(literals) == sorted(problem.info["numbers"])
    return True, uses, uses and value == problem.info["target"]

  def is_correct(self, problem: Problem, completion: str) -> bool:
    return self._check(problem, completion)[2]

  def reward(self, problem: Problem, completion: str) -> float:
    valid, uses, solved = self._check(problem, completion)
    if solved:
      return 1.0
    return self.partial * (0.5 * valid + 0.5 * uses)
