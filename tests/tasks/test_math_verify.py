"""The math_verify reward (Hugging Face's math-verify as a registered reward)."""

import sys
import threading

import pytest

from jaxrl_llm.tasks.verifiers import REWARDS, get_reward, math_reward

pytest.importorskip("math_verify")

EQUIVALENT = [   # (completion, reference answer)
    (r"so the answer is \boxed{\frac{1}{2}}.", "0.5"),
    ("The answer is 0.5", r"\frac{1}{2}"),
    (r"\boxed{0.5}", "#### 1/2"),                         # a GSM8K-style reference
    (r"We get \boxed{\dfrac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{y = 4, x = 3}", "x = 3, y = 4"),            # equations, in any order
    ("It costs 1000 dollars, \\boxed{1000}", "1,000"),
    (r"\boxed{50\%}", r"50\%"),
    (r"\boxed{2\pi}", r"\boxed{2 \pi}"),
    (r"the interval is \boxed{[0, 1)}", r"[0,1)"),
]
DIFFERENT = [
    (r"\boxed{\frac{1}{3}}", "0.5"),
    ("The answer is 4", "3"),
    (r"\boxed{(2, 1)}", "(1, 2)"),
    (r"\boxed{[0, 1]}", r"[0,1)"),
    ("no idea", "7"),
    ("", "7"),
]


def _score(pairs):
  return get_reward("math_verify")(["q"] * len(pairs), [c for c, _ in pairs],
                                   [a for _, a in pairs]).tolist()


def test_registered_and_chosen_by_name():
  assert "math_verify" in REWARDS


def test_equivalent_answers_score_one():
  assert _score(EQUIVALENT) == [1.0] * len(EQUIVALENT)


def test_different_answers_score_zero():
  assert _score(DIFFERENT) == [0.0] * len(DIFFERENT)


def test_where_it_differs_from_the_math_verifier():
  # math compares these as text (no number parses); math-verify as math objects.
  pairs = [(r"\boxed{\dfrac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
           (r"\boxed{y = 4, x = 3}", "x = 3, y = 4")]
  assert _score(pairs) == [1.0, 1.0]
  assert math_reward(["q"] * 2, [c for c, _ in pairs], [a for _, a in pairs]).tolist() == [
      0.0, 0.0]


def test_deterministic_off_the_main_thread():
  """math-verify's own timeouts use signal.alarm (main thread only: elsewhere every call
  would fail and score 0); they are off, so a rollout thread gets the same scores."""
  out: list = []
  worker = threading.Thread(target=lambda: out.append(_score(EQUIVALENT + DIFFERENT)))
  worker.start()
  worker.join(120)
  assert out == [_score(EQUIVALENT + DIFFERENT)]
  assert out[0] == [1.0] * len(EQUIVALENT) + [0.0] * len(DIFFERENT)


def test_missing_package_is_one_line(monkeypatch, tmp_path):
  import importlib.util

  from jaxrl_llm.loop.config import RunConfig
  monkeypatch.setitem(sys.modules, "math_verify", None)     # import math_verify fails
  with pytest.raises(ImportError, match=r"pip install 'jaxrl_llm\[math_verify\]'"):
    get_reward("math_verify")(["q"], ["1"], ["2"])
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "math_verify" else real(name, *a))
  (tmp_path / "d.jsonl").write_text('{"prompt": "q", "answer": "1"}\n')
  with pytest.raises(ValueError, match=r"^--reward math_verify needs math_verify, which is "
                     r"not installed: pip install 'jaxrl_llm\[math_verify\]'$"):
    RunConfig(dataset=str(tmp_path / "d.jsonl"), reward="math_verify").validate()


def test_the_dataset_check_uses_its_parser(tmp_path):
  import json

  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.datacheck import check_dataset
  answers = [r"\frac{\sqrt{3}}{2}", "x = 3, y = 4", "7"] * 5 + ["???", "--"]
  (tmp_path / "d.jsonl").write_text("".join(
      json.dumps({"prompt": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
  run = RunConfig(dataset=str(tmp_path / "d.jsonl"), max_new_tokens=4)
  (warning,) = check_dataset(run)          # math: 12 of 17 are not numbers
  assert "--reward math cannot parse the answers of 12 of 17" in warning, warning
  (warning,) = check_dataset(RunConfig(dataset=run.dataset, max_new_tokens=4,
                                       reward="math_verify"))
  assert "--reward math_verify cannot parse the answers of 2 of 17" in warning
  assert "line 16: '???'; line 17: '--'" in warning


def test_words_are_products_of_symbols():
  """A limit to know: math-verify reads a word as a product of one-letter symbols, so an
  anagram of a text answer scores 1 (use --reward exact for text answers)."""
  assert _score([(r"\boxed{sirap}", "Paris")]) == [1.0]
  assert get_reward("exact")(["q"], ["sirap"], ["Paris"]).tolist() == [0.0]
