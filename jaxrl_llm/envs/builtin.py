"""Built-in environments a small model can learn, each deterministic in its seed.

* :class:`CalculatorEnv` (``"calculator"``): an arithmetic question; the model may
  call ``calculator(expression)`` (any number of times, in the tool-call format of
  ``parser``) and ends with ``<answer>N</answer>``, scored 1 (equal to the exact
  value) or 0.
* :class:`GuessNumberEnv` (``"guess_number"``): guess a secret integer; each wrong
  guess gets ``higher`` / ``lower``. Success on guess g earns
  :math:`\\gamma^{g-1}` (``turn_discount`` :math:`\\gamma`: fewer guesses are better);
  running out of guesses earns 0.
* :class:`CodeTestEnv` (``"code_tests"``): write a Python function; the code runs
  against unit tests in the sandbox (:func:`~jaxrl_llm.envs.sandbox.run_python`) and
  failing tests are shown for another attempt. Turn k earns :math:`p_k - p_{k-1}`
  (:math:`p_k` the fraction of tests passed by attempt k, :math:`p_0 = 0`), so an
  episode's reward, the sum, is the pass rate of its last attempt wherever it stops.

All texts are ASCII within :data:`~jaxrl_llm.envs.chat.CHAT_CHARS`, so the built-in
character tokenizer writes them.

Examples:
  >>> env = CalculatorEnv()
  >>> env.reset(3)[-1]["content"]
  'What is 811*87+181? Answer as <answer>N</answer>.'
  >>> r = env.step('<tool_call>{"name": "calculator", "arguments": '
  ...              '{"expression": "811*87+181"}}</tool_call>')
  >>> r.messages, r.done
  ([{'role': 'tool', 'name': 'calculator', 'content': '70738'}], False)
  >>> env.step("<answer>70738</answer>").reward
  1.0
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.envs.base import Message, StepResult
from jaxrl_llm.envs.sandbox import run_python
from jaxrl_llm.envs.tools import Tool, get_tool_parser, tool_messages

# ------------------------------------------------------------------------- calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPONENT = 64
_MAX_DIGITS = 100


def _evaluate(node: ast.AST) -> int | float:
  if isinstance(node, ast.Expression):
    return _evaluate(node.body)
  if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not (
      isinstance(node.value, bool)):
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_evaluate(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
      raise ValueError(f"exponents are limited to {_MAX_EXPONENT}")
    out = _BINARY[type(node.op)](left, right)
    if isinstance(out, int) and out.bit_length() > _MAX_DIGITS * 4:
      raise ValueError("the result is too large")
    return out
  raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.

  Args:
    expression: the expression, e.g. "(12+3)*4".
  """
  try:
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
  except ZeroDivisionError:
    return "Error: division by zero"
  except (SyntaxError, ValueError, TypeError) as e:
    return f"Error: cannot evaluate {expression!r}: {e}"
  if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
    value = int(value)
  return str(value)


CALCULATOR = Tool.from_function(calculator)
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)
_FORMS = ("{a}*{b}+{c}", "{a}*{b}-{c}", "({a}+{b})*{c}", "{a}*{b}*{c}")


@dataclasses.dataclass
class CalculatorEnv:
  """Arithmetic with a calculator tool (the module docstring).

  Attributes:
    parser: the tool-call format the model writes (a :data:`TOOL_PARSERS` name).
    max_value: operands are drawn in ``[2, max_value]``.
    system_prompt: the opening system message ("" for none).
  """

  parser: str = "hermes"
  max_value: int = 999
  system_prompt: str = ("Solve the problem. You may call the calculator tool. "
                        "Give the final answer as <answer>N</answer>.")
  name = "calculator"
  tools: Sequence[Tool] = (CALCULATOR,)

  def __post_init__(self) -> None:
    self._parse = get_tool_parser(self.parser)
    if not isinstance(self.max_value, int) or self.max_value < 2:
      raise ValueError(f"`max_value` must be an int >= 2, got {self.max_value!r}.")
    self.answer: int | None = None

  def question(self, seed: int) -> tuple[str, int]:
    """The expression of ``seed`` and its value."""
    rng = np.random.default_rng(seed)
    a, b, c = (int(x) for x in rng.integers(2, self.max_value + 1, size=3))
    form = _FORMS[int(rng.integers(len(_FORMS)))]
    expression = form.format(a=a, b=b, c=c)
    return expression, int(calculator(expression))

  def reset(self, seed: int) -> list[Message]:
    expression, self.answer = self.question(seed)
    opening = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    return opening + [{"role": "user",
                       "content": f"What is {expression}? Answer as <answer>N</answer>."}]

  def step(self, assistant_text: str) -> StepResult:
    turn = self._parse(assistant_text)
    if turn.has_calls:
      return StepResult(tool_messages(turn, self.tools), 0.0, False,
                        {"tool_calls": len(turn.calls), "tool_errors": len(turn.errors)})
    found = _ANSWER.findall(assistant_text)
    correct = bool(found) and re.fullmatch(r"[+-]?\d+", found[-1]) is not None and (
        int(found[-1]) == self.answer)
    return StepResult([], float(correct), True, {"answered": bool(found)})


# ---------------------------------------------------------------------- guess number

_INT = re.compile(r"-?\d+")


@dataclasses.dataclass
class GuessNumberEnv:
  """Guess a secret integer with higher / lower feedback (the module docstring).

  Attributes:
    low, high: the secret is uniform in ``[low, high]``.
    max_guesses: guesses before the episode ends with reward 0.
    turn_discount: :math:`\\gamma` of the success reward :math:`\\gamma^{g-1}`.
  """

  low: int = 1
  high: int = 100
  max_guesses: int = 8
  turn_discount: float = 0.9
  name = "guess_number"

  def __post_init__(self) -> None:
    if not self.low < self.high:
      raise ValueError(f"`low` must be < `high`, got {self.low} and {self.high}.")
    if not isinstance(self.max_guesses, int) or self.max_guesses < 1:
      raise ValueError(f"`max_guesses` must be an int >= 1, got {self.max_guesses!r}.")
    if not 0.0 < self.turn_discount <= 1.0:
      raise ValueError(f"`turn_discount` must be in (0, 1], got {self.turn_discount!r}.")
    self.secret: int | None = None
    self.guesses = 0

  def reset(self, seed: int) -> list[Message]:
    self.secret = int(np.random.default_rng(seed).integers(self.low, self.high + 1))
    self.guesses = 0
    return [{"role": "user", "content": (
        f"Guess my number between {self.low} and {self.high}. Reply with one number; "
        f"I will say higher or lower. You have {self.max_guesses} guesses.")}]

  def step(self, assistant_text: str) -> StepResult:
    self.guesses += 1
    found = _INT.findall(assistant_text)
    left = self.max_guesses - self.guesses
    info = {"guesses": self.guesses}
    if found and int(found[-1]) == self.secret:
      return StepResult([], self.turn_discount ** (self.guesses - 1), True, info)
    if left <= 0:
      return StepResult([{"role": "user", "content": f"Out of guesses: it was {self.secret}."}],
                        0.0, True, info)
    if not found:
      hint = f"Reply with one number between {self.low} and {self.high}."
    else:
      hint = "higher" if int(found[-1]) < self.secret else "lower"  # type: ignore[operator]
    return StepResult([{"role": "user", "content": f"{hint} ({left} left)"}], 0.0, False,
                      info)


# ------------------------------------------------------------------------ code tests


@dataclasses.dataclass(frozen=True)
class CodeProblem:
  """A function to write: its name, the task's text, and tests ``(args, expected)``."""

  function: str
  text: str
  tests: tuple[tuple[tuple[Any, ...], Any], ...]


def _affine(rng: np.random.Generator) -> CodeProblem:
  k, m = (int(x) for x in rng.integers(2, 10, size=2))
  xs = [int(x) for x in rng.integers(-20, 21, size=4)]
  return CodeProblem("f", f"Write a Python function f(x) that returns {k}*x+{m}.",
                     tuple(((x,), k * x + m) for x in xs))


def _count(rng: np.random.Generator) -> CodeProblem:
  letter = "abcde"[int(rng.integers(5))]
  words = ["".join("abcde"[int(i)] for i in rng.integers(5, size=int(rng.integers(1, 9))))
           for _ in range(4)]
  return CodeProblem("count", f"Write a Python function count(s) that returns how many "
                     f"times the letter {letter} occurs in the string s.",
                     tuple(((w,), w.count(letter)) for w in words))


def _clip(rng: np.random.Generator) -> CodeProblem:
  lo = int(rng.integers(-10, 0))
  hi = int(rng.integers(1, 11))
  xs = [int(x) for x in rng.integers(-20, 21, size=4)]
  return CodeProblem("clip", f"Write a Python function clip(x) that returns x limited to "
                     f"the range [{lo}, {hi}].", tuple(((x,), min(max(x, lo), hi)) for x in xs))


def _largest(rng: np.random.Generator) -> CodeProblem:
  lists = [[int(x) for x in rng.integers(-50, 51, size=int(rng.integers(1, 6)))]
           for _ in range(4)]
  return CodeProblem("second", "Write a Python function second(xs) that returns the "
                     "second largest element of the list xs, or None if it has fewer "
                     "than 2 elements.",
                     tuple(((xs,), sorted(xs)[-2] if len(xs) >= 2 else None) for xs in lists))


CODE_PROBLEMS: tuple[Callable[[np.random.Generator], CodeProblem], ...] = (
    _affine, _count, _clip, _largest)
"""The families :class:`CodeTestEnv` draws from (a seeded generator -> a problem)."""

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)

# Runs the model's code, then each test; prints one line per test and a summary
# stamped with a nonce the model's code cannot know.
_HARNESS = """
__tests = {tests!r}
__ns = {{"__name__": "solution"}}
exec(compile({code!r}, "solution.py", "exec"), __ns)
__passed = 0
for __args, __want in __tests:
  try:
    __got = __ns[{function!r}](*__args)
    __ok = __got == __want
  except Exception as __e:
    __got, __ok = f"{{type(__e).__name__}}: {{__e}}", False
  __passed += __ok
  if not __ok:
    print(f"FAILED {function}{{tuple(__args)!r}}: got {{__got!r}}, expected {{__want!r}}")
print("{nonce}", __passed)
"""


def extract_code(text: str) -> str:
  """The code of a model's turn: its last fenced block (```python ... ```), else the
  whole text.

  >>> extract_code("Here:\\n```python\\ndef f(x):\\n  return x\\n```")
  'def f(x):\\n  return x\\n'
  """
  blocks = _CODE_BLOCK.findall(text)
  return blocks[-1] if blocks else text


@dataclasses.dataclass
class CodeTestEnv:
  """Write a function that passes unit tests (the module docstring).

  Attributes:
    max_attempts: submissions before the episode ends.
    timeout_s: the sandbox's wall-clock limit per submission.
    memory_mb: the sandbox's memory limit.
  """

  max_attempts: int = 3
  timeout_s: float = 5.0
  memory_mb: int = 256
  name = "code_tests"

  def __post_init__(self) -> None:
    if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
      raise ValueError(f"`max_attempts` must be an int >= 1, got {self.max_attempts!r}.")
    self.problem: CodeProblem | None = None
    self.attempts = 0
    self.passed = 0.0

  def reset(self, seed: int) -> list[Message]:
    rng = np.random.default_rng(seed)
    self.problem = CODE_PROBLEMS[int(rng.integers(len(CODE_PROBLEMS)))](rng)
    self.attempts, self.passed = 0, 0.0
    return [{"role": "user", "content": self.problem.text + " Reply with the code in a "
             "```python block."}]

  def run_tests(self, code: str) -> tuple[float, str]:
    """``(fraction of tests passed, feedback text)`` of ``code`` on the problem."""
    assert self.problem is not None, "reset() first"
    nonce = "RESULT-" + secrets.token_hex(8)
    harness = _HARNESS.format(tests=[(list(a), w) for a, w in self.problem.tests],
                              code=code, function=self.problem.function, nonce=nonce)
    result = run_python(harness, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
    lines = result.output.splitlines()
    summary = [ln for ln in lines if ln.startswith(nonce + " ")]
    total = len(self.problem.tests)
    if not result.ok or not summary:
      return 0.0, result.observation().replace(nonce, "RESULT")
    passed = int(summary[-1].split()[1])
    failures = [ln for ln in lines if ln.startswith("FAILED ")]
    return passed / total, "\n".join([f"{passed}/{total} tests passed.", *failures[:3]])

  def step(self, assistant_text: str) -> StepResult:
    self.attempts += 1
    rate, feedback = self.run_tests(extract_code(assistant_text))
    reward, self.passed = rate - self.passed, rate
    done = rate == 1.0 or self.attempts >= self.max_attempts
    return StepResult([] if done else [{"role": "user", "content": feedback}], reward, done,
                      {"pass_rate": rate, "attempts": self.attempts})


__all__ = ["CALCULATOR", "CODE_PROBLEMS", "CalculatorEnv", "CodeProblem", "CodeTestEnv",
           "GuessNumberEnv", "calculator", "extract_code"]
