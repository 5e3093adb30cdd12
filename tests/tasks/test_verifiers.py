"""Tests for answer extraction, comparison and the batched rewards (tasks.verifiers)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.tasks import verifiers as vf

# --------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    (r"The answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{{a}{b{c}}}", "{a}{b{c}}"),                  # nested braces
    (r"first \boxed{1} then \boxed{2}", "2"),              # the last one counts
    (r"\fbox{7}", "7"),
    (r"$\boxed 5$", "5"),                                   # brace-less form
    (r"\boxed{ 3 }", "3"),
    (r"\boxed{unclosed", None),
    (r"\boxed", None),
    (r"\boxed{}", ""),
    ("no box here", None),
])
def test_extract_boxed(text, expected):
  assert vf.extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("#### 1,000\nextra line", "1,000"),
    ("#### $18 dollars", "18"),
    ("#### 2x + 1", "2x + 1"),
    ("#### 1,000, done", "1,000"),
    ("#### 5 #### 6", "6"),
    ("####", None),
    ("#### \n", None),
    ("no marker 5", None),
])
def test_extract_hash_answer(text, expected):
  assert vf.extract_hash_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("3 apples and 4 pears: 7", "7"),
    ("costs $1,234.56 in total", "1,234.56"),
    ("the result is -3.5.", "-3.5"),
    ("ratio 3/4", "3/4"),
    ("tiny: 1e-3", "1e-3"),
    ("about .5", ".5"),
    ("none", None),
    ("", None),
])
def test_extract_last_number(text, expected):
  assert vf.extract_last_number(text) == expected


def test_extract_answer_priority_and_formats():
  text = "I think 3. #### 4 ... " + r"\boxed{5}"
  assert vf.extract_answer(text) == "5"
  assert vf.extract_answer(text, formats=("hash", "boxed")) == "4"
  assert vf.extract_answer(text, formats=("last_number",)) == "5"
  assert vf.extract_answer("nothing", formats=("boxed", "hash")) is None
  with pytest.raises(ValueError, match="formats"):
    vf.extract_answer("x", formats=("latex",))


# --------------------------------------------------------------------- comparison


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)),
    ("-7", Fraction(-7)),
    ("1,234", Fraction(1234)),
    ("1,234.5", Fraction(2469, 2)),
    ("$5", Fraction(5)),
    (r"\$5.00", Fraction(5)),
    ("-$3", Fraction(-3)),
    ("50%", Fraction(50)),
    (r"50\%", Fraction(50)),
    ("3/4", Fraction(3, 4)),
    (r"\frac{3}{4}", Fraction(3, 4)),
    (r"\dfrac{6}{8}", Fraction(3, 4)),
    (r"-\tfrac{1}{2}", Fraction(-1, 2)),
    (r"\frac34", Fraction(3, 4)),
    ("1e-3", Fraction(1, 1000)),
    ("2.", Fraction(2)),
    ("$7$", Fraction(7)),
    (r"\text{12}", Fraction(12)),
])
def test_parse_number(text, value):
  assert vf.parse_number(text) == value


@pytest.mark.parametrize("text", [
    "x + 1", "1,23", "1/0", r"\frac{1}{0}", "", "--3", "1.2.3", "1" * 200, "inf", "nan",
    "3 4", None, 5,
])
def test_parse_number_rejects(text):
  assert vf.parse_number(text) is None


@pytest.mark.parametrize("pred, ref, expected", [
    ("72", "72", True),
    ("72.0", "72", True),
    ("1,000", "1000", True),
    ("0.5", r"\frac{1}{2}", True),
    ("0.3333333", "1/3", True),
    ("0.33", "1/3", False),
    ("50%", "50", True),
    ("$18", "18", True),
    ("17", "18", False),
    ("x+1", "x+1", True),
    ("x + 1", "x+1", False),          # strings compare after whitespace collapse only
    (r"\text{(B)}", "(B)", True),
    ("Paris.", "Paris", True),
    ("paris", "Paris", False),
    (None, "3", False),
    ("", "3", False),
])
def test_answers_match(pred, ref, expected):
  assert vf.answers_match(pred, ref) is expected


def test_numbers_close_tolerances():
  assert vf.numbers_close(100.0, 100.00001)
  assert not vf.numbers_close(100.0, 100.01)
  assert vf.numbers_close(100.0, 100.01, rel_tol=1e-3)
  assert vf.numbers_close(0.0, 1e-10)
  assert not vf.numbers_close(0.0, 1e-6)
  assert vf.numbers_close(Fraction(10) ** 400, Fraction(10) ** 400)   # float overflow


# ------------------------------------------------------------------- batched rewards


def test_math_reward_fixture():
  completions = [
      r"... so \boxed{72}",                    # boxed
      "48 + 24 = 72\n#### 72",                  # gsm8k marker
      "She sold 72 clips in total.",           # last number
      "I don't know",                          # nothing to extract
      r"\boxed{71}",                           # wrong
      r"\boxed{\frac{144}{2}}",                 # equivalent fraction
      "\\boxed{",                               # malformed LaTeX
      "#### ",                                  # empty marker -> falls back to last number
      "",                                       # empty completion
      "\x00\ufffd" * 50,                        # garbage
  ]
  answers = ["72"] * 5 + ["Natalia sold 48 + 24 = 72.\n#### 72"] + ["72"] * 4
  out = vf.math_reward([""] * len(completions), completions, answers)
  assert out.dtype == np.float32 and out.shape == (10,)
  np.testing.assert_array_equal(out, [1, 1, 1, 0, 0, 1, 0, 0, 0, 0])


def test_unicode_minus_and_latex_thousands_separator():
  # U+2212 is a minus (it used to be dropped: -5 scored as 5), {,} a thousands separator.
  completions = ["The answer is \u22125.", "The answer is \u22125.", r"\boxed{10{,}000}",
                 r"\boxed{1{,}234{,}567}", "#### \u22127", "\\boxed{\u2212\\frac{3}{4}}"]
  answers = ["5", "-5", "10000", "#### 1,234,567", "-7", "-0.75"]
  out = vf.math_reward([""] * len(completions), completions, answers)
  np.testing.assert_array_equal(out, [0, 1, 1, 1, 1, 1])
  assert vf.parse_number("\u22121{,}000.5") == Fraction(-2001, 2)


def test_boxed_reward_requires_box():
  out = vf.boxed_reward(["q"] * 3, [r"\boxed{9}", "9", "#### 9"], ["9"] * 3)
  np.testing.assert_array_equal(out, [1, 0, 0])


def test_exact_reward():
  out = vf.exact_reward(["q"] * 4, ["Paris", " Paris. ", "paris", "Paris, France"],
                        ["Paris"] * 4)
  np.testing.assert_array_equal(out, [1, 1, 0, 0])


def test_reference_answer_with_markers():
  assert vf.reference_answer("blah\n#### 1,000") == "1,000"
  assert vf.reference_answer(r"so $\boxed{\frac12}$") == r"\frac12"
  assert vf.reference_answer("  plain  ") == "plain"
  out = vf.math_reward(["q"], ["it is 1000"], ["blah\n#### 1,000"])
  assert out.tolist() == [1.0]


@pytest.mark.parametrize("name", ["math", "boxed", "exact"])
def test_builtin_rewards_never_raise_on_malformed_output(name):
  bad = ["", "}", "{{{{", r"\boxed{{{", "####", "1/0", r"\frac{1}{0}", "9" * 5000,
         "\n\n\n", "\\", "$", "%", "1e999999", "-", ".", "ǅ∑𝟘"]
  out = vf.get_reward(name)(["p"] * len(bad), bad, ["3"] * len(bad))
  assert out.shape == (len(bad),) and np.all(np.isfinite(out))
  np.testing.assert_array_equal(out, np.zeros(len(bad)))


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.text(max_size=60), st.text(max_size=10))
def test_math_reward_total_on_any_text(completion, answer):
  out = vf.math_reward([""], [completion], [answer])
  assert out.shape == (1,) and out[0] in (0.0, 1.0)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.integers(-10**9, 10**9))
def test_math_reward_roundtrip_integers(n):
  formatted = [f"{n}", f"{n:,}", rf"\boxed{{{n}}}", f"#### {n}", f"so it is {n}.",
               f"{n}.0"]
  out = vf.math_reward([""] * 6, formatted, [str(n)] * 6)
  np.testing.assert_array_equal(out, np.ones(6))
  assert vf.math_reward([""], [str(n + 1)], [str(n)])[0] == 0.0


def test_batch_checks():
  with pytest.raises(ValueError, match="same length"):
    vf.math_reward(["a"], ["a", "b"], ["a", "b"])
  with pytest.raises(ValueError, match="single string"):
    vf.exact_reward(["a"], "a", ["a"])


def test_registry_and_score_checks():
  assert set(vf.REWARDS) >= {"math", "boxed", "exact"}
  assert vf.get_reward("math") is vf.math_reward
  with pytest.raises(ValueError, match="must be one of"):
    vf.get_reward("nope")
  with pytest.raises(ValueError, match="already registered"):
    vf.register_reward("math", vf.exact_reward)

  name = "_test_len_reward"

  @vf.register_reward(name)
  def length(prompts, completions, answers):
    return np.asarray([len(c) for c in completions], np.float32)

  try:
    assert vf.score(name, ["", ""], ["ab", ""], ["", ""]).tolist() == [2.0, 0.0]
    lifted = vf.per_example(lambda p, c, a: float(c == a))
    assert vf.score(lifted, ["", ""], ["x", "y"], ["x", "x"]).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"shape \(1,\) for 2"):
      vf.score(lambda p, c, a: np.ones(1), ["", ""], ["", ""], ["", ""])
    with pytest.raises(ValueError, match="non-finite value nan at index 1"):
      vf.score(lambda p, c, a: np.array([0.0, np.nan]), ["", ""], ["", ""], ["", ""])
  finally:
    del vf.REWARDS[name]
