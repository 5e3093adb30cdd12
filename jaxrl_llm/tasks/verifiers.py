r"""Answer verifiers and the batched reward interface for text datasets.

A *reward function* scores a batch of completions against reference answers:

.. code-block:: python

  reward_fn(prompts: Sequence[str], completions: Sequence[str],
            answers: Sequence[str]) -> np.ndarray   # float32 [n]

It is plain Python on decoded strings (it runs on the host between rollout and update,
as in TRL's ``reward_funcs`` and verl's ``compute_score``), so it may call anything;
it must not raise on malformed model output (the built-in ones give 0 there).
Built-in rewards are registered by name in :data:`REWARDS` (:func:`get_reward`):

=================  =============================================================
name               reward (1.0 or 0.0)
=================  =============================================================
``"math"``         :func:`extract_answer` of the completion (``\boxed{}``, then
                   ``#### n``, then the last number) equals the reference
                   (:func:`answers_match`: numerically within tolerance, else as
                   normalised strings)
``"boxed"``        like ``"math"``, but only a ``\boxed{}`` answer counts (the
                   format is part of the task, as in DeepSeek-R1-style training)
``"exact"``        the whole completion equals the answer after
                   :func:`normalize_text`
``"math_verify"``  Hugging Face's ``math-verify`` finds the completion's answer
                   equal to the reference (:func:`math_verify_reward`: symbolic
                   equality, sets, intervals, equations; the optional extra
                   ``jaxrl_llm[math_verify]``)
=================  =============================================================

Add your own with :func:`register_reward` (a batched function) or lift a
per-example ``f(prompt, completion, answer) -> float`` with :func:`per_example`.

Conventions (where the anchors differ):

* Reference answers go through the same extraction when they carry a marker
  (a GSM8K answer is a rationale ending in ``#### 72``; a MATH solution ends in
  ``\boxed{...}``), and are used whole otherwise.
* Numbers: thousands separators (``1,234``), a leading ``$``/``\$``, a trailing
  ``%``/``\%`` and a trailing period are dropped, so ``50%`` == ``50`` (the GSM8K
  convention of lm-eval-harness and verl's ``gsm8k`` scorer; ``50%`` is *not* 0.5).
  ``a/b``, ``\frac{a}{b}`` (``\dfrac``, ``\tfrac``), decimals and scientific notation
  parse; integers must be equal exactly, other numbers within :math:`|x - y| \le
  \max(r \cdot \max(|x|, |y|), a)` (:func:`numbers_close`; ``math.isclose`` with
  ``rel_tol=1e-6``, ``abs_tol=1e-9`` by default). Numerals longer than 100 characters
  are not numbers (no huge-int conversion on adversarial output).
* Non-numeric answers compare as strings after :func:`normalize_text` (whitespace
  collapsed, surrounding ``$`` and ``\text{}``/``\left``/``\right`` spacing macros
  removed, trailing period dropped); case is kept (``"x"`` and ``"X"`` differ).

Examples:
  >>> extract_answer(r"so the area is \boxed{\frac{1}{2}}.")
  '\\frac{1}{2}'
  >>> extract_answer("She has 3 + 4 = 7 apples.\n#### 7")
  '7'
  >>> answers_match("0.5", r"\frac{1}{2}"), answers_match("1,000", "1000")
  (True, True)
  >>> get_reward("math")(["q"] * 3, [r"\boxed{12}", "it is 12", "no idea"],
  ...                    ["12", "#### 12", "12"]).tolist()
  [1.0, 1.0, 0.0]
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol

import numpy as np

_MAX_NUMBER_CHARS = 100


class RewardFn(Protocol):
  """The batched reward protocol (see the module docstring)."""

  def __call__(self, prompts: Sequence[str], completions: Sequence[str],
               answers: Sequence[str]) -> np.ndarray:
    ...


# ------------------------------------------------------------------------ extraction


def extract_boxed(text: str) -> str | None:
  r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), nested braces allowed.

  ``\boxed 5`` (no braces, a single token up to whitespace or ``$``) also counts.
  Returns ``None`` when there is none or its braces never close.

  Examples:
    >>> extract_boxed(r"first \boxed{1}, finally \boxed{\frac{a}{b}}")
    '\\frac{a}{b}'
    >>> extract_boxed(r"\boxed{unclosed {") is None
    True
  """
  if not isinstance(text, str):
    return None
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
  if i < len(text) and text[i] == " ":
    m = re.match(r" +([^\s$]+)", text[i:])
    return m.group(1) if m else None
  if i >= len(text) or text[i] != "{":
    return None
  depth = 0
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j].strip()
  return None


def extract_hash_answer(text: str) -> str | None:
  """The answer after the last ``####`` (GSM8K's final-answer marker).

  The number right after the marker when there is one (an optional ``$`` before it;
  as lm-eval-harness' ``#### (-?[0-9.,]+)`` strict match), else the rest of the line.

  Examples:
    >>> extract_hash_answer("3 + 4 = 7\\n#### $7 apples")
    '7'
    >>> extract_hash_answer("#### x + 1\\nmore")
    'x + 1'
    >>> extract_hash_answer("####") is None
    True
  """
  if not isinstance(text, str):
    return None
  i = text.rfind("####")
  if i < 0:
    return None
  rest = _ascii_numerals(text[i + 4:]).strip().split("\n", 1)[0].strip()
  m = _HASH_NUMBER_RE.match(rest)
  if m:
    return m.group(1).rstrip(",")
  return rest or None


_HASH_NUMBER_RE = re.compile(
    r"\\?\$?\s*(-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?)(?![\w^*+(])")
_NUMBER_RE = re.compile(
    r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+(?:\.\d+)?)?"
    r"|-?\.\d+")


def _ascii_numerals(text: str) -> str:
  r"""The Unicode minus sign (U+2212) as ``-`` and LaTeX's ``{,}`` thousands separator
  as ``,``: the forms models write for ``-5`` and ``10,000``."""
  return text.replace("\u2212", "-").replace("{,}", ",")


def extract_last_number(text: str) -> str | None:
  """The last number in ``text`` (integers, ``1,234``, decimals, ``a/b``, ``1e-3``).

  Examples:
    >>> extract_last_number("in 2 hours she earns $1,250.50, or 3/4 of it")
    '3/4'
    >>> extract_last_number("no digits") is None
    True
    >>> extract_last_number("it is \u22125, not 10{,}000"), extract_last_number("\u22125")
    ('10,000', '-5')
  """
  if not isinstance(text, str):
    return None
  last = None
  for last in _NUMBER_RE.finditer(_ascii_numerals(text)):  # noqa: B007 (keeps the last)
    pass
  return None if last is None else last.group(0)


EXTRACTORS: Mapping[str, Callable[[str], str | None]] = {
    "boxed": extract_boxed,
    "hash": extract_hash_answer,
    "last_number": extract_last_number,
}


def extract_answer(text: str, formats: Sequence[str] = ("boxed", "hash", "last_number")
                   ) -> str | None:
  r"""The final answer of ``text``: the first of ``formats`` that finds one.

  Args:
    text: a completion or a reference solution.
    formats: names in :data:`EXTRACTORS`, tried in order (``"boxed"`` ->
      :func:`extract_boxed`, ``"hash"`` -> :func:`extract_hash_answer`,
      ``"last_number"`` -> :func:`extract_last_number`).

  Returns:
    The extracted string, or ``None`` if no format matches (or ``text`` is not a str).

  Examples:
    >>> extract_answer(r"#### 3 but actually \boxed{4}")
    '4'
    >>> extract_answer("the answer is 42", formats=("boxed",)) is None
    True
  """
  for name in formats:
    if name not in EXTRACTORS:
      raise ValueError(f"`formats` must name entries of {sorted(EXTRACTORS)}, got {name!r}.")
  for name in formats:
    out = EXTRACTORS[name](text)
    if out is not None:
      return out
  return None


# ----------------------------------------------------------------------- comparison


_TEXT_MACRO_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_FRAC_SHORT_RE = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")
_PLAIN_NUMBER_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")


def normalize_text(text: str) -> str:
  r"""A canonical form for string comparison.

  Drops ``\left``/``\right``, ``\!``/``\,``/``\;`` spacing, ``\text{...}`` wrappers
  (keeping their content), surrounding ``$``, a trailing period; collapses whitespace.

  Examples:
    >>> normalize_text(r" $\left( 1, \text{two} \right)$. ")
    '( 1, two )'
  """
  s = _ascii_numerals(str(text))
  for macro in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\displaystyle"):
    s = s.replace(macro, "")
  s = _TEXT_MACRO_RE.sub(r"\1", s)
  s = " ".join(s.split())
  prev = None
  while s != prev:
    prev = s
    s = s.strip().strip("$").strip().removesuffix(".")
  return s


def _parse_plain(s: str) -> Fraction | None:
  if not _PLAIN_NUMBER_RE.match(s):
    return None
  try:
    return Fraction(s)
  except (ValueError, ZeroDivisionError):
    return None


def parse_number(text: str) -> Fraction | None:
  r"""The exact value of a numeric answer, or ``None`` if it is not a number.

  Accepts the forms of the module docstring: ``-1,234.5``, ``$5``, ``50%``, ``3/4``,
  ``\frac{3}{4}``, ``\dfrac34``, ``1e-3``, ``2.``, with surrounding ``$...$`` or
  ``\text{}`` wrappers. Division by zero and numerals longer than 100 characters give
  ``None``.

  Examples:
    >>> parse_number("$1,234.50"), parse_number(r"-\frac{3}{4}"), parse_number("50\\%")
    (Fraction(2469, 2), Fraction(-3, 4), Fraction(50, 1))
    >>> parse_number("x + 1") is None
    True
  """
  if not isinstance(text, str) or len(text) > _MAX_NUMBER_CHARS:
    return None
  s = normalize_text(text)
  if re.search(r"\d\s+\d", s):
    return None
  s = s.replace(" ", "")
  s = s.replace("\\$", "").replace("\\%", "%")
  s = s.removeprefix("$")
  if s.startswith("-$"):
    s = "-" + s[2:]
  s = s.removesuffix("%").removesuffix(".")
  if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
    s = s.replace(",", "")
  if not s:
    return None
  m = _FRAC_RE.match(s) or _FRAC_SHORT_RE.match(s)
  if m:
    num, den = _parse_plain(m.group(2)), _parse_plain(m.group(3))
    if num is None or den is None or den == 0:
      return None
    value = num / den
    return -value if m.group(1) else value
  if s.count("/") == 1:
    a, b = s.split("/")
    num, den = _parse_plain(a), _parse_plain(b)
    if num is None or den is None or den == 0:
      return None
    return num / den
  return _parse_plain(s)


def numbers_close(x: Fraction | float, y: Fraction | float, *, rel_tol: float = 1e-6,
                  abs_tol: float = 1e-9) -> bool:
  r"""Exact equality, or for non-integers :math:`|x - y| \le \max(r \max(|x|, |y|), a)`.

  Two integers (``Fraction`` s with denominator 1, or integral floats) must be equal
  exactly, so ``999999`` never matches ``1000000``; when either is not an integer
  the tolerance applies (``r = rel_tol``, ``a = abs_tol``; ``math.isclose``), so a
  decimal rounding of ``1/3`` to 7 places matches.

  Examples:
    >>> numbers_close(0.3333333, Fraction(1, 3)), numbers_close(1.0, 1.01)
    (True, False)
    >>> numbers_close(999999, 1000000)
    False
  """
  if x == y:
    return True
  try:
    both_int = Fraction(x).denominator == 1 and Fraction(y).denominator == 1
  except (OverflowError, ValueError):  # inf / nan
    both_int = False
  if both_int:
    return False
  try:
    return math.isclose(float(x), float(y), rel_tol=rel_tol, abs_tol=abs_tol)
  except OverflowError:
    return x == y


def answers_match(predicted: str | None, reference: str, *, rel_tol: float = 1e-6,
                  abs_tol: float = 1e-9) -> bool:
  r"""Whether an extracted answer equals a reference answer.

  Numerically (:func:`parse_number` both, then :func:`numbers_close`) when both are
  numbers; as :func:`normalize_text` strings otherwise. ``None`` (nothing extracted)
  never matches.

  Examples:
    >>> answers_match("1/2", "0.5"), answers_match(r"\text{(B)}", "(B)")
    (True, True)
    >>> answers_match(None, "3"), answers_match("3", "three")
    (False, False)
  """
  if predicted is None or not isinstance(predicted, str):
    return False
  p, r = parse_number(predicted), parse_number(str(reference))
  if p is not None and r is not None:
    return numbers_close(p, r, rel_tol=rel_tol, abs_tol=abs_tol)
  return normalize_text(predicted) == normalize_text(str(reference))


def reference_answer(answer: str) -> str:
  r"""The final answer inside a reference solution: its ``\boxed{}`` or ``#### n``
  when it has one, else the whole (stripped) string.

  Examples:
    >>> reference_answer("4 + 3 = 7\n#### 7"), reference_answer(" 12 ")
    ('7', '12')
  """
  answer = str(answer)
  found = extract_answer(answer, formats=("boxed", "hash"))
  return answer.strip() if found is None else found


# ----------------------------------------------------------------- batched rewards


def _check_batch(prompts, completions, answers) -> int:
  for name, seq in (("prompts", prompts), ("completions", completions),
                    ("answers", answers)):
    if isinstance(seq, str):
      raise ValueError(f"`{name}` must be a sequence of strings, got a single string.")
  n = len(completions)
  if len(prompts) != n or len(answers) != n:
    raise ValueError(
        f"`prompts`, `completions` and `answers` must have the same length, got "
        f"{len(prompts)}, {n} and {len(answers)}.")
  return n


def math_reward(prompts: Sequence[str], completions: Sequence[str],
                answers: Sequence[str], *,
                formats: Sequence[str] = ("boxed", "hash", "last_number"),
                rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> np.ndarray:
  r"""1.0 where the completion's final answer matches the reference, else 0.0.

  The completion's answer is :func:`extract_answer` with ``formats``; the reference is
  :func:`reference_answer`; they are compared with :func:`answers_match`.

  Returns:
    float32 ``[n]``.

  Examples:
    >>> math_reward(["q", "q"], ["#### 1,000", r"\boxed{"], ["1000", "7"]).tolist()
    [1.0, 0.0]
  """
  n = _check_batch(prompts, completions, answers)
  out = np.zeros((n,), np.float32)
  for i, (c, a) in enumerate(zip(completions, answers)):
    pred = extract_answer(c, formats) if isinstance(c, str) else None
    out[i] = float(answers_match(pred, reference_answer(a), rel_tol=rel_tol,
                                 abs_tol=abs_tol))
  return out


def boxed_reward(prompts: Sequence[str], completions: Sequence[str],
                 answers: Sequence[str]) -> np.ndarray:
  r""":func:`math_reward` counting only ``\boxed{}`` answers.

  Examples:
    >>> boxed_reward(["q", "q"], [r"\boxed{5}", "5"], ["5", "5"]).tolist()
    [1.0, 0.0]
  """
  return math_reward(prompts, completions, answers, formats=("boxed",))


def exact_reward(prompts: Sequence[str], completions: Sequence[str],
                 answers: Sequence[str]) -> np.ndarray:
  """1.0 where :func:`normalize_text` of the completion equals that of the answer.

  Examples:
    >>> exact_reward(["q", "q"], [" Paris. ", "paris"], ["Paris", "Paris"]).tolist()
    [1.0, 0.0]
  """
  n = _check_batch(prompts, completions, answers)
  return np.asarray(
      [float(isinstance(c, str) and normalize_text(c) == normalize_text(str(a)))
       for c, a in zip(completions, answers)], np.float32).reshape(n)


def per_example(fn: Callable[[str, str, str], float]) -> RewardFn:
  """Lifts ``fn(prompt, completion, answer) -> float`` to a batched reward function.

  Examples:
    >>> length = per_example(lambda p, c, a: min(len(c), 4) / 4)
    >>> length(["", ""], ["ab", "abcde"], ["", ""]).tolist()
    [0.5, 1.0]
  """

  def batched(prompts, completions, answers):
    _check_batch(prompts, completions, answers)
    return np.asarray([float(fn(p, c, a)) for p, c, a in zip(prompts, completions, answers)],
                      np.float32).reshape(len(completions))

  batched.__name__ = getattr(fn, "__name__", "per_example")
  batched.__doc__ = fn.__doc__
  return batched


# The characters of a completion math-verify reads (its end, where the answer is): a
# bound on the work of one parse, since the timeouts are off (see math_verify_reward).
MATH_VERIFY_MAX_CHARS = 2000
MATH_VERIFY_EXTRA = "pip install 'jaxrl_llm[math_verify]'"


def _math_verify() -> Any:
  try:
    import math_verify
  except ImportError:
    raise ImportError("the math_verify reward needs Hugging Face's math-verify package, "
                      f"which is not installed: {MATH_VERIFY_EXTRA}") from None
  # Timeouts are off (below); its one-time note that they are is not news here.
  for module in ("parser", "grader"):
    mod = getattr(math_verify, module, None)
    if mod is not None and hasattr(mod, "TIMEOUT_WARNING_SHOWN"):
      mod.TIMEOUT_WARNING_SHOWN = True
  return math_verify


@functools.lru_cache(maxsize=65536)
def _math_verify_gold(answer: str) -> tuple:
  """The parsed reference (cached: a group's samples share it)."""
  mv = _math_verify()
  return tuple(mv.parse(f"\\boxed{{{reference_answer(answer)}}}", parsing_timeout=None))


def math_verify_reward(prompts: Sequence[str], completions: Sequence[str],
                       answers: Sequence[str]) -> np.ndarray:
  r"""1.0 where Hugging Face's ``math-verify`` finds the completion's answer equal to the
  reference, else 0.0 (``pip install 'jaxrl_llm[math_verify]'``).

  The reference is :func:`reference_answer` (the ``oxed{}`` / ``#### n`` of a
  rationale, else the whole answer) parsed as ``oxed{reference}``; the completion's
  last :data:`MATH_VERIFY_MAX_CHARS` characters are parsed with math-verify's default
  extraction (LaTeX, ``oxed{}`` first, then plain expressions) and compared with
  ``math_verify.verify`` (symbolic and numeric equality, sets, intervals, equations).

  Its timeouts are off: math-verify times out with ``signal.alarm``, which works only in
  the main thread (elsewhere, as in the ``--async`` rollout thread, every call would
  fail and score 0) and makes a result depend on the machine's speed. Without them the
  reward is deterministic in any thread; the length bound keeps each parse small.

  A limit to know: math-verify reads a word as a product of one-letter symbols (case
  folded), so ``\boxed{sirap}`` equals ``Paris``; use ``"exact"`` for text answers.

  Examples:
    >>> math_verify_reward(["q"] * 3, [r"so oxed{rac{1}{2}}", "it is 0.5", "3/4"],
    ...                    ["0.5", "#### 1/2", "1/2"]).tolist()   # doctest: +SKIP
    [1.0, 1.0, 0.0]
  """
  n = _check_batch(prompts, completions, answers)
  mv = _math_verify()
  out = np.zeros((n,), np.float32)
  for i, (c, a) in enumerate(zip(completions, answers)):
    gold = _math_verify_gold(str(a))
    if not isinstance(c, str) or not gold:
      continue
    pred = mv.parse(c[-MATH_VERIFY_MAX_CHARS:], parsing_timeout=None)
    out[i] = float(bool(pred) and mv.verify(list(gold), pred, timeout_seconds=None))
  return out


def _math_verify_parses(answer: str) -> bool:
  """Whether math-verify parses ``answer`` into a math object (not only its text)."""
  return any(not isinstance(x, str) for x in _math_verify_gold(str(answer)))


REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "boxed": boxed_reward,
    "exact": exact_reward,
    "math_verify": math_verify_reward,
}


def _parses_as_number(answer: str) -> bool:
  return parse_number(reference_answer(answer)) is not None


# How a registered reward reads a reference answer: ``name -> parses(answer) -> bool``.
# The command's up-front dataset check (:mod:`jaxrl_llm.loop.datacheck`) warns when a
# reward parses too few of a dataset's answers ("math" and "boxed" compare other answers
# as normalised text only, so a completion must write them exactly). A reward without
# an entry is checked by scoring the answer itself as a completion.
ANSWER_PARSERS: dict[str, Callable[[str], bool]] = {
    "math": _parses_as_number,
    "boxed": _parses_as_number,
    "exact": lambda answer: True,
    "math_verify": _math_verify_parses,
}


# How a registered reward finds an answer in a completion: ``name -> found(completion)
# -> bool`` (a run's ``unparsed_frac``, :meth:`jaxrl_llm.tasks.JsonlTask.parsed`); a
# reward without an entry does not say.
COMPLETION_PARSERS: dict[str, Callable[[str], bool]] = {
    "math": lambda completion: extract_answer(completion) is not None,
    "boxed": lambda completion: extract_boxed(completion) is not None,
}


def register_reward(name: str,
                    fn: RewardFn | None = None) -> RewardFn | Callable[[RewardFn], RewardFn]:
  """Registers a batched reward under ``name`` (usable as a decorator).

  Raises:
    ValueError: if ``name`` is taken (names are never silently replaced).

  Examples:
    >>> @register_reward("nonempty_doc")
    ... def nonempty(prompts, completions, answers):
    ...   return np.asarray([float(bool(c.strip())) for c in completions], np.float32)
    >>> get_reward("nonempty_doc")(["q"], [" x"], ["a"]).tolist()
    [1.0]
    >>> del REWARDS["nonempty_doc"]
  """

  def register(f: RewardFn) -> RewardFn:
    if not isinstance(name, str) or not name:
      raise ValueError(f"`name` must be a non-empty string, got {name!r}.")
    if name in REWARDS:
      raise ValueError(f"reward {name!r} is already registered.")
    if not callable(f):
      raise ValueError(f"`fn` must be callable, got {f!r}.")
    REWARDS[name] = f
    return f

  return register if fn is None else register(fn)


def get_reward(reward: str | RewardFn) -> RewardFn:
  """The registered reward ``reward`` (a name), or ``reward`` itself if callable.

  Raises:
    ValueError: for an unknown name (listing the registered ones).
  """
  if callable(reward):
    return reward
  if reward not in REWARDS:
    raise ValueError(f"`reward` must be one of {sorted(REWARDS)} or a callable, "
                     f"got {reward!r}.")
  return REWARDS[reward]


def score(reward: str | RewardFn, prompts: Sequence[str], completions: Sequence[str],
          answers: Sequence[str]) -> np.ndarray:
  """Calls a reward and checks its output: float32 ``[n]``, finite.

  Raises:
    ValueError: if the reward returns another shape or a non-finite value (naming
      the reward and the first bad index).

  Examples:
    >>> score("exact", ["q"], ["a"], ["a"]).tolist()
    [1.0]
  """
  fn = get_reward(reward)
  n = _check_batch(prompts, completions, answers)
  out = np.asarray(fn(prompts, completions, answers), np.float32)
  name = getattr(fn, "__name__", repr(fn))
  if out.shape != (n,):
    raise ValueError(f"reward {name!r} returned shape {out.shape} for {n} completions; "
                     f"expected ({n},).")
  bad = np.flatnonzero(~np.isfinite(out))
  if bad.size:
    raise ValueError(f"reward {name!r} returned a non-finite value {out[bad[0]]} at "
                     f"index {int(bad[0])}.")
  return out


__all__ = [
    "ANSWER_PARSERS", "COMPLETION_PARSERS", "EXTRACTORS", "REWARDS", "RewardFn",
    "answers_match", "boxed_reward", "exact_reward", "math_verify_reward",
    "extract_answer", "extract_boxed", "extract_hash_answer", "extract_last_number",
    "get_reward", "math_reward", "normalize_text", "numbers_close", "parse_number",
    "per_example", "reference_answer", "register_reward", "score",
]
