"""Tests of jaxrl_llm.tasks: tokenizer, task sampling/splits and reward functions."""

from __future__ import annotations

import dataclasses
import doctest

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxrl_llm.tasks as tasks_pkg
from jaxrl_llm.tasks import (
  DEFAULT_TASK,
  LONG_TASKS,
  TASKS,
  AddTask,
  CharTokenizer,
  CountdownTask,
  Problem,
  ReverseTask,
  SortTask,
  Task,
  arithmetic,
  base,
  countdown,
  get_task,
  parse_expression,
  position_match,
  random_baseline,
  strings,
  tokenizer,
)
from jaxrl_llm.tasks.tokenizer import DEFAULT_CHARS, DIGITS, LETTERS, SYMBOLS, UNKNOWN_CHAR

ALL = sorted(TASKS)


# ---- tokenizer ------------------------------------------------------------------


def test_tokenizer_layout():
  tok = CharTokenizer()
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 3 + len(DEFAULT_CHARS) == 21
  assert tok.encode("0") == [3] and tok.encode(" ") == [20]
  assert [tok.id_to_token(i) for i in range(3)] == ["<pad>", "<bos>", "<eos>"]
  assert tok.id_to_token(tok.vocab_size) == UNKNOWN_CHAR


def test_tokenizer_round_trip_and_specials():
  tok = CharTokenizer()
  assert tok.decode(tok.encode(DEFAULT_CHARS)) == DEFAULT_CHARS
  ids = tok.encode("12+3=", add_bos=True, add_eos=True)
  assert ids == [1, 4, 5, 13, 6, 16, 2]
  assert tok.decode(ids) == "12+3="
  # stops at the first eos, skips pad and bos anywhere.
  assert tok.decode([0, 0, 1, 4, 0, 5, 2, 6, 2]) == "12"
  assert tok.decode([2, 4]) == ""
  assert tok.decode([]) == ""
  # ids outside the vocabulary never raise and never form a valid answer.
  assert tok.decode([4, 99, -1, 5]) == "1" + UNKNOWN_CHAR * 2 + "2"
  assert tok.decode(np.array([[4, 5], [6, 2]])) == "123"


def test_tokenizer_custom_chars():
  tok = CharTokenizer(DIGITS + SYMBOLS + LETTERS)
  assert tok.vocab_size == 47
  assert tok.decode(tok.encode("abc+12")) == "abc+12"
  with pytest.raises(ValueError, match="chars"):
    CharTokenizer("aab")
  with pytest.raises(ValueError, match="chars"):
    CharTokenizer("")


def test_tokenizer_unknown_char():
  with pytest.raises(ValueError, match=r"text.*'x'"):
    CharTokenizer().encode("12x")


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet=DEFAULT_CHARS, max_size=12))
def test_tokenizer_round_trip_property(s):
  tok = CharTokenizer()
  assert tok.decode(tok.encode(s, add_bos=True, add_eos=True)) == s
  assert len(tok.encode(s)) == len(s)


def test_encode_batch_padding():
  tok = CharTokenizer()
  tokens, mask = tok.encode_batch(["1+2=", "10+20=", ""], length=6)
  assert tokens.dtype == np.int32 and mask.dtype == np.int32
  assert tokens.shape == mask.shape == (3, 6)
  np.testing.assert_array_equal(tokens[0], [0, 0, 4, 13, 5, 16])
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1], [1] * 6, [0] * 6])
  assert (tokens[mask == 0] == tok.pad_id).all()
  right, rmask = tok.encode_batch(["1+2="], length=6, left_pad=False)
  np.testing.assert_array_equal(right, [[4, 13, 5, 16, 0, 0]])
  np.testing.assert_array_equal(rmask, [[1, 1, 1, 1, 0, 0]])
  bos, bmask = tok.encode_batch(["12"], length=4, add_bos=True)
  np.testing.assert_array_equal(bos, [[0, 1, 4, 5]])
  np.testing.assert_array_equal(bmask, [[0, 1, 1, 1]])
  empty, emask = tok.encode_batch([], length=3)
  assert empty.shape == emask.shape == (0, 3)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.text(alphabet=DEFAULT_CHARS, max_size=8), min_size=1, max_size=5),
       st.booleans())
def test_encode_decode_batch_property(prompts, left_pad):
  tok = CharTokenizer()
  tokens, mask = tok.encode_batch(prompts, 8, left_pad)
  assert tok.decode_batch(tokens, mask) == prompts
  assert tok.decode_batch(tokens) == prompts  # pad is skipped anyway
  np.testing.assert_array_equal(mask.sum(1), [len(p) for p in prompts])


def test_encode_batch_errors():
  tok = CharTokenizer()
  with pytest.raises(ValueError, match=r"prompts.*\[1\].*5 tokens.*length.*4"):
    tok.encode_batch(["12=", "123+4"], length=4)
  with pytest.raises(ValueError, match="prompts"):
    tok.encode_batch(["12"], length=2, add_bos=True)
  with pytest.raises(ValueError, match="prompts"):
    tok.encode_batch("12", length=4)
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="length"):
      tok.encode_batch(["1"], length=bad)


def test_decode_batch_mask_and_errors():
  tok = CharTokenizer()
  ids = np.array([[4, 5, 2, 6], [7, 8, 9, 10]])
  assert tok.decode_batch(ids) == ["12", "4567"]
  assert tok.decode_batch(ids, np.array([[1, 1, 1, 1], [1, 0, 1, 0]])) == ["12", "46"]
  with pytest.raises(ValueError, match="ids"):
    tok.decode_batch(np.array([4, 5]))
  with pytest.raises(ValueError, match="mask"):
    tok.decode_batch(ids, np.ones((2, 3)))


# ---- shared task behaviour -------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_sampling_seeded_and_within_limits(name):
  task = get_task(name)
  a = task.sample_prompts(np.random.default_rng(7), 200)
  b = task.sample_prompts(np.random.default_rng(7), 200)
  c = task.sample_prompts(np.random.default_rng(8), 200)
  assert a == b
  assert a != c
  assert len(a) == 200 and all(isinstance(p, Problem) for p in a)
  # short by default, so a tiny model can learn on CPU; long tasks have long answers.
  assert task.max_prompt_len <= 16
  if name in LONG_TASKS:
    assert task.max_new_tokens > 200
  else:
    assert task.max_new_tokens <= 6
  tok = task.tokenizer
  tok.encode_batch([p.prompt for p in a], task.max_prompt_len)  # raises if too long
  for p in a:
    assert len(tok.encode(p.answer)) + 1 <= task.max_new_tokens
    assert set(p.answer) <= set(task.answer_chars)
    assert task.reward(p, p.answer) == 1.0 and task.is_correct(p, p.answer)
    assert not task.is_heldout(p)


@pytest.mark.parametrize("name", ALL)
def test_eval_split_deterministic_and_disjoint(name):
  task = get_task(name)
  ev = task.eval_problems(64)
  assert ev == task.eval_problems(64) == get_task(name).eval_problems(64)
  assert len(ev) == 64 and all(task.is_heldout(p) for p in ev)
  train = task.sample_prompts(np.random.default_rng(0), 500)
  assert not {p.prompt for p in ev} & {p.prompt for p in train}
  # about `holdout` of the problem space is held out.
  rng = np.random.default_rng(1)
  frac = np.mean([task.is_heldout(task.draw(rng)) for _ in range(2000)])
  assert 0.05 < frac < 0.15
  # a different eval seed gives another (still held-out) draw.
  other = dataclasses.replace(task, eval_seed=99).eval_problems(64)
  assert other != ev and all(task.is_heldout(p) for p in other)


def test_holdout_zero_and_validation():
  task = get_task("reverse", holdout=0.0)
  assert not any(task.is_heldout(p) for p in task.eval_problems(50))
  assert task.eval_problems(50) == task.eval_problems(50)
  for bad in (-0.1, 1.0):
    with pytest.raises(ValueError, match="holdout"):
      get_task("reverse", holdout=bad)
  with pytest.raises(ValueError, match="`n`"):
    task.sample_prompts(np.random.default_rng(0), -1)
  assert task.sample_prompts(np.random.default_rng(0), 0) == []


def test_split_that_cannot_be_drawn_raises():
  # a single-instance problem space that is entirely in the train split.
  task = get_task("copy", min_len=1, max_len=1, chars="7")
  assert not task.is_heldout(task.draw(np.random.default_rng(0)))
  with pytest.raises(ValueError, match="holdout"):
    task.eval_problems(1)


@pytest.mark.parametrize("name", ALL)
def test_score_and_exact_vectorised(name):
  task = get_task(name)
  probs = task.eval_problems(6)
  comps = [p.answer for p in probs[:3]] + ["", "garbage!", probs[5].answer + "0"]
  s, e = task.score(probs, comps), task.exact(probs, comps)
  assert s.dtype == np.float32 and s.shape == (6,)
  assert e.dtype == bool and e.tolist() == [True] * 3 + [False] * 3
  np.testing.assert_array_equal(s[:3], 1.0)
  assert (s[3:] < 1.0).all() and (s[3:5] == 0.0).all()
  with pytest.raises(ValueError, match="completions"):
    task.score(probs, comps[:5])
  with pytest.raises(ValueError, match="completions"):
    task.exact(probs[:1], "abc")
  assert task.score([], []).shape == (0,)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(comp=st.text(alphabet=DEFAULT_CHARS + "abc\ufffd", max_size=10), seed=st.integers(0, 99))
def test_reward_bounded_and_one_iff_correct(name, comp, seed):
  task = get_task(name)
  p = task.sample_prompts(np.random.default_rng(seed), 1)[0]
  r = task.reward(p, comp)
  assert 0.0 <= r <= 1.0
  assert (r == 1.0) == task.is_correct(p, comp)


def test_get_task_registry():
  assert DEFAULT_TASK in TASKS
  assert isinstance(get_task(), ReverseTask)
  assert set(ALL) >= {"sort", "reverse", "add", "countdown"}
  assert get_task("sort", max_len=5).max_new_tokens == 6
  with pytest.raises(ValueError, match="name") as err:
    get_task("sorting")
  for n in ALL:
    assert repr(n) in str(err.value)


def test_random_baseline_default_task():
  r = random_baseline(get_task(DEFAULT_TASK), n=1000)
  # uniform random digits: exact = 1e-3, mean reward = 0.5 * 0.1 (+ exact hits).
  assert r["exact"] < 0.02
  assert 0.03 < r["reward"] < 0.08


@pytest.mark.parametrize("name", ALL)
def test_random_baseline_all_tasks(name):
  task = get_task(name)
  r = random_baseline(task, n=300)
  assert r["exact"] < 0.1
  assert 0.0 < r["reward"] < task.partial + 0.1


def test_custom_task_minimal():
  """The smallest user task: `draw`, `is_correct` and the two lengths."""

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Double(Task):
    name = "double"

    @property
    def max_prompt_len(self):
      return 2

    @property
    def max_new_tokens(self):
      return 3

    def draw(self, rng):
      a = int(rng.integers(0, 10))
      return Problem(f"{a}=", str(2 * a))

    def is_correct(self, problem, completion):
      return completion == problem.answer

  with pytest.raises(TypeError):
    Task()  # abstract: draw, is_correct and the lengths are required
  task = Double(holdout=0.2)
  probs = task.sample_prompts(np.random.default_rng(0), 20)
  ev = task.eval_problems(5)
  assert not {p.prompt for p in probs} & {p.prompt for p in ev}
  np.testing.assert_array_equal(task.score(ev, [p.answer for p in ev]), 1.0)
  assert task.reward(ev[0], "x") == 0.0


# ---- per-task rewards ---------------------------------------------------------------


def test_position_match():
  assert position_match("321", "321") == 1.0
  assert position_match("321", "") == 0.0
  assert position_match("", "") == 1.0
  assert position_match("321", "32") == pytest.approx(2 / 3)
  assert position_match("321", "3214") == pytest.approx(3 / 4)
  assert position_match("321", "x21") == pytest.approx(2 / 3)
  assert position_match("132", "32", align="right") == pytest.approx(2 / 3)
  assert position_match("132", "32") == 0.0
  with pytest.raises(ValueError, match="align"):
    position_match("1", "1", align="center")


def test_reverse_copy_rewards():
  rev, cp = get_task("reverse"), get_task("copy")
  p = Problem("384=", "483")
  cases = {"483": 1.0, "489": 0.5 * 2 / 3, "384": 0.5 * 1 / 3, "": 0.0, "4": 0.5 / 3,
           "4830": 0.5 * 3 / 4, "483 ": 0.5 * 3 / 4, " 483": 0.0, "+*=": 0.0,
           "48" + UNKNOWN_CHAR: 0.5 * 2 / 3}
  for comp, want in cases.items():
    assert rev.reward(p, comp) == pytest.approx(want), comp
  assert rev.sample_prompts(np.random.default_rng(0), 1)[0].answer == "568"
  q = cp.sample_prompts(np.random.default_rng(0), 1)[0]
  assert q.answer + "=" == q.prompt
  assert get_task("reverse", partial=0.0).reward(p, "489") == 0.0


def test_sort_rewards():
  task = SortTask()
  p = Problem("3142=", "1234")
  assert task.reward(p, "1234") == 1.0
  assert task.reward(p, "1243") == pytest.approx(0.5 * 0.5)
  assert task.reward(p, "123") == pytest.approx(0.5 * 0.75)
  assert task.reward(p, "12345") == pytest.approx(0.5 * 0.8)
  assert task.reward(p, "") == 0.0
  assert task.reward(p, "abcd") == 0.0
  probs = task.sample_prompts(np.random.default_rng(3), 300)
  assert {len(p.answer) for p in probs} == {3, 4}
  for q in probs:
    assert q.answer == "".join(sorted(q.prompt[:-1]))


def test_string_task_validation():
  for kw in ({"min_len": 0}, {"min_len": 4, "max_len": 3}):
    with pytest.raises(ValueError, match="min_len"):
      get_task("reverse", **kw)
  for chars in ("", "ab", "1="):
    with pytest.raises(ValueError, match="chars"):
      get_task("reverse", chars=chars)
  with pytest.raises(ValueError, match="partial"):
    get_task("sort", partial=1.5)


def test_add_rewards():
  task = AddTask()
  p = Problem("47+85=", "132")
  assert task.reward(p, "132") == 1.0
  assert task.reward(p, "32") == pytest.approx(0.5 * 2 / 3)   # units and tens right
  assert task.reward(p, "122") == pytest.approx(0.5 * 2 / 3)
  assert task.reward(p, "0132") == pytest.approx(0.5 * 3 / 4)  # leading zero: not exact
  assert task.reward(p, "1320") == 0.0                       # shifted digits
  assert task.reward(p, "") == 0.0 and task.reward(p, "--") == 0.0
  for q in task.sample_prompts(np.random.default_rng(0), 200):
    a, b = q.prompt[:-1].split("+")
    assert q.answer == str(int(a) + int(b))
  small = get_task("add", max_value=9)
  assert (small.max_prompt_len, small.max_new_tokens) == (4, 3)
  with pytest.raises(ValueError, match="min_value"):
    get_task("add", min_value=5, max_value=4)


def test_parse_expression_valid():
  assert parse_expression("3*5+7") == (22, [3, 5, 7])
  assert parse_expression("7+5*3") == (22, [7, 5, 3])
  assert parse_expression("7-5-1") == (1, [7, 5, 1])   # left associative
  assert parse_expression("(3+5)*7") == (56, [3, 5, 7])
  assert parse_expression(" 3 * ( 5 - 7 ) ") == (-6, [3, 5, 7])
  assert parse_expression("((12))") == (12, [12])
  assert parse_expression("0*9") == (0, [0, 9])


@pytest.mark.parametrize("bad", [
    "", " ", "3++5", "3+", "+3", "-3+5", "(3+5", "3+5)", "()", "3 5", "3(5)", "07+5",
    "3/5", "3**5", "3^5", "__import__('os').system('true')", "3+5\n", "1e3", "３+5",
    "2" * 65, "9*" * 40 + "9",
])
def test_parse_expression_rejects(bad):
  with pytest.raises(ValueError):
    parse_expression(bad)


def test_parse_expression_depth_and_size_bounded():
  value, _ = parse_expression("(" * 31 + "9" + ")" * 31)
  assert value == 9
  value, _ = parse_expression("*".join(["99"] * 21))  # 62 chars: big but fine
  assert value == 99 ** 21


def test_countdown_rewards():
  task = CountdownTask()
  p = Problem("3,5,7=22", "3*5+7", {"numbers": (3, 5, 7), "target": 22})
  assert task.reward(p, "3*5+7") == 1.0
  assert task.reward(p, "7+5*3") == 1.0
  assert task.reward(p, "(3*5)+7") == 1.0          # parentheses are fine
  assert task.reward(p, "3+5+7") == pytest.approx(0.2)   # right numbers, wrong value
  assert task.reward(p, "3*5+7+0") == pytest.approx(0.1)  # extra number
  assert task.reward(p, "3*7+1") == pytest.approx(0.1)    # 22, but a foreign number
  assert task.reward(p, "3*3+13") == pytest.approx(0.1)   # 22, reuses 3
  assert task.reward(p, "15+7") == pytest.approx(0.1)     # 22, merges 3*5
  assert task.reward(p, "35+7") == pytest.approx(0.1)     # digits glued together
  assert task.reward(p, "3*5+") == 0.0
  assert task.reward(p, "") == 0.0
  assert task.reward(p, "3*5+7=22") == 0.0               # trailing characters
  assert task.reward(p, "x") == 0.0
  dup = Problem("3,3,5=18", "3+3*5", {"numbers": (3, 3, 5), "target": 18})
  assert task.is_correct(dup, "3+3*5") and task.is_correct(dup, "3*5+3")
  assert not task.is_correct(dup, "3*5+3+0")
  assert get_task("countdown", partial=0.0).reward(p, "3+5+7") == 0.0


def test_countdown_problems():
  task = CountdownTask()
  probs = task.sample_prompts(np.random.default_rng(0), 300)
  for p in probs:
    nums, target = p.prompt.split("=")
    assert tuple(int(x) for x in nums.split(",")) == p.info["numbers"]
    assert int(target) == p.info["target"] and 0 <= p.info["target"] <= 99
    assert task.is_correct(p, p.answer)
  assert len({p.info["target"] for p in probs}) > 30
  wide = get_task("countdown", extra_new_tokens=2)
  assert wide.max_new_tokens == task.max_new_tokens + 2 == 8
  big = get_task("countdown", n_numbers=4, max_number=20, max_target=200)
  for p in big.sample_prompts(np.random.default_rng(0), 50):
    assert big.is_correct(p, p.answer) and len(p.prompt) <= big.max_prompt_len
  with pytest.raises(ValueError, match="n_numbers"):
    get_task("countdown", n_numbers=1)
  with pytest.raises(ValueError, match="min_target"):
    get_task("countdown", min_target=10, max_target=5)


def test_repeat_task_long_answer_and_rewards():
  task = get_task("repeat")
  for p in task.sample_prompts(np.random.default_rng(3), 50):
    s = p.prompt[:-1]
    assert len(p.answer) == 200 and p.answer.startswith(s * 3)
    assert all(p.answer[i] == s[i % len(s)] for i in range(200))
  p = Problem("12=", "1212121212")
  short = get_task("repeat", min_len=2, max_len=2, answer_len=10)
  assert short.reward(p, "1212121212") == 1.0
  assert short.reward(p, "12121212121") == pytest.approx(0.5 * 10 / 11)  # one too many
  assert short.reward(p, "2121212121") == 0.0
  with pytest.raises(ValueError, match="answer_len"):
    get_task("repeat", answer_len=2)


def test_mixed_repeat_task_has_heavy_tailed_lengths_the_input_announces():
  task = get_task("repeat_mixed")
  problems = task.sample_prompts(np.random.default_rng(5), 400)
  lengths = np.array([len(p.answer) for p in problems])
  inputs = np.array([len(p.prompt) - 1 for p in problems])
  assert set(lengths) == {20, 200} and np.all((lengths == 200) == (inputs == 4))
  assert int((lengths == 200).sum()) == 58          # about 1 in 8 (seeded)
  for p in problems[:20]:
    s = p.prompt[:-1]
    assert all(p.answer[i] == s[i % len(s)] for i in range(len(p.answer)))
  assert task.max_new_tokens == 201 and task.reward(problems[0], problems[0].answer) == 1.0
  for kwargs, name in (({"short_len": 0}, "short_len"), ({"short_len": 300}, "short_len"),
                       ({"long_share": 1.5}, "long_share"),
                       ({"min_len": 4, "max_len": 4}, "min_len")):
    with pytest.raises(ValueError, match=name):
      get_task("repeat_mixed", **kwargs)


def test_docstring_examples():
  for mod in (tasks_pkg, tokenizer, base, strings, arithmetic, countdown):
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0, mod.__name__
  assert doctest.testmod(tokenizer).attempted > 0
