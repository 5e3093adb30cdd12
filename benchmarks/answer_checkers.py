"""Agreement of the two answer checkers: ``--reward math`` (our parser) and
``--reward math_verify`` (Hugging Face's math-verify), on generated answer/reference
pairs whose truth is known by construction.

Templates cover boxed answers, fractions, LaTeX expressions, units, percentages,
thousands separators, multiple answers, GSM8K ``#### n`` rationales and wrong answers;
each is instantiated with seeded random numbers. Prints a table per template (truth,
each checker's accuracy, their agreement) and writes every disagreement to ``--json``.

Run: ``python -m benchmarks.answer_checkers --per-template 14 --json answer_checkers.json``
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable

from jaxrl_llm.tasks.verifiers import get_reward

Pair = tuple[str, str, bool]     # (completion, reference answer, equivalent?)


def _frac(r: random.Random) -> tuple[int, int]:
  b = r.choice([2, 4, 5, 8, 10, 20, 25])
  a = r.randint(1, 3 * b)
  while math.gcd(a, b) != 1:
    a = r.randint(1, 3 * b)
  return a, b


def _templates() -> dict[str, Callable[[random.Random], Pair]]:
  t: dict[str, Callable[[random.Random], Pair]] = {}

  def add(name):
    def register(f):
      t[name] = f
      return f
    return register

  @add("boxed integer")
  def _(r):
    n = r.randint(-50, 999)
    return f"Adding up, we get \\boxed{{{n}}}.", str(n), True

  @add("last number in prose")
  def _(r):
    n = r.randint(2, 999)
    return f"First 3 apples, then more. In total she has {n} apples.", str(n), True

  @add("gsm8k #### rationale")
  def _(r):
    n = r.randint(2, 9999)
    return f"So the answer is {n}.\n#### {n}", f"She buys 3 and then {n - 1} more.\n#### {n}", True

  @add("fraction vs decimal")
  def _(r):
    a, b = _frac(r)
    return f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a / b:g}", True

  @add("decimal vs fraction")
  def _(r):
    a, b = _frac(r)
    return f"The answer is {a / b:g}", f"\\frac{{{a}}}{{{b}}}", True

  @add("a/b vs \\dfrac")
  def _(r):
    a, b = _frac(r)
    return f"\\boxed{{{a}/{b}}}", f"\\dfrac{{{a}}}{{{b}}}", True

  @add("equivalent radicals")
  def _(r):
    k = r.choice([2, 3, 5, 6, 7])
    m = r.randint(2, 5)
    return f"\\boxed{{{m}\\sqrt{{{k}}}}}", f"\\sqrt{{{m * m * k}}}", True

  @add("pi expressions")
  def _(r):
    a = r.randint(1, 9)
    return f"\\boxed{{\\frac{{{a}\\pi}}{{2}}}}", f"\\frac{{{a}}}{{2}}\\pi", True

  @add("units")
  def _(r):
    n = r.randint(2, 500)
    unit = r.choice(["cm", "meters", "dollars", "kg"])
    return f"\\boxed{{{n}\\text{{ {unit}}}}}", str(n), True

  @add("percent vs number")
  def _(r):
    n = r.randint(1, 99)
    return f"\\boxed{{{n}\\%}}", str(n), True

  @add("percent vs fraction of 1")
  def _(r):
    n = r.randint(1, 99)
    return f"\\boxed{{{n}\\%}}", f"{n / 100:g}", True

  @add("thousands separator")
  def _(r):
    n = r.randint(1000, 9_999_999)
    return f"The total is \\boxed{{{n:,}}}.", str(n), True

  @add("trailing zeros")
  def _(r):
    n = r.randint(1, 99)
    return f"\\boxed{{{n}.50}}", f"{n}.5", True

  @add("multiple answers, reordered")
  def _(r):
    a, b = r.sample(range(-9, 10), 2)
    return f"\\boxed{{{b}, {a}}}", f"{a}, {b}", True

  @add("equations, reordered")
  def _(r):
    a, b = r.randint(1, 9), r.randint(1, 9)
    return f"\\boxed{{y = {b}, x = {a}}}", f"x = {a}, y = {b}", True

  @add("wrong integer")
  def _(r):
    n = r.randint(2, 999)
    return f"\\boxed{{{n + r.choice([-1, 1, 10])}}}", str(n), False

  @add("wrong fraction")
  def _(r):
    a, b = _frac(r)
    return f"\\boxed{{\\frac{{{b}}}{{{a}}}}}", f"\\frac{{{a}}}{{{b}}}", a == b

  @add("wrong radical")
  def _(r):
    k = r.choice([2, 3, 5])
    return f"\\boxed{{\\sqrt{{{k + 1}}}}}", f"\\sqrt{{{k}}}", False

  @add("one of two answers")
  def _(r):
    a, b = r.sample(range(1, 10), 2)
    return f"\\boxed{{{a}}}", f"{a}, {b}", False

  @add("no answer")
  def _(r):
    n = r.randint(2, 99)
    return "I am not sure how to solve this.", str(n), False

  @add("text answer, wrong")
  def _(r):
    word = r.choice(["Paris", "blue", "triangle"])
    return f"\\boxed{{{word[::-1].lower()}}}", word, False

  return t


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--per-template", type=int, default=14)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None)
  args = p.parse_args()
  rng = random.Random(args.seed)
  checkers = {name: get_reward(name) for name in ("math", "math_verify")}
  rows, disagreements, times = [], [], dict.fromkeys(checkers, 0.0)
  total = {"n": 0, "agree": 0, **{k: 0 for k in checkers}}
  for name, make in _templates().items():
    pairs = [make(rng) for _ in range(args.per_template)]
    scores = {}
    for checker, fn in checkers.items():
      start = time.perf_counter()
      scores[checker] = fn(["q"] * len(pairs), [c for c, _, _ in pairs],
                           [a for _, a, _ in pairs]).tolist()
      times[checker] += time.perf_counter() - start
    right = {k: sum((s > 0) == truth for s, (_, _, truth) in zip(v, pairs))
             for k, v in scores.items()}
    agree = sum(a == b for a, b in zip(scores["math"], scores["math_verify"]))
    rows.append((name, len(pairs), right["math"], right["math_verify"], agree))
    total["n"] += len(pairs)
    total["agree"] += agree
    for k in checkers:
      total[k] += right[k]
    for (c, a, truth), x, y in zip(pairs, scores["math"], scores["math_verify"]):
      if x != y:
        disagreements.append({"template": name, "completion": c, "answer": a,
                              "equivalent": truth, "math": x, "math_verify": y})
  print("| template | pairs | math right | math_verify right | agree |")
  print("|---|---:|---:|---:|---:|")
  for name, n, a, b, agree in rows:
    print(f"| {name} | {n} | {a} | {b} | {agree} |")
  print(f"| **all** | {total['n']} | {total['math']} | {total['math_verify']} | "
        f"{total['agree']} |")
  print(f"time: math {times['math']:.2f} s, math_verify {times['math_verify']:.2f} s; "
        f"{len(disagreements)} disagreements")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows, "disagreements": disagreements}, f, indent=1)


if __name__ == "__main__":
  main()
