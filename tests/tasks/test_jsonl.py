"""Tests for JSONL datasets (jaxrl_llm.tasks.jsonl)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl_llm.tasks.jsonl import JsonlTask, Record, load_jsonl, parse_record
from jaxrl_llm.tasks.tokenizer import CharTokenizer


def _write(tmp_path, lines, name="data.jsonl"):
  path = tmp_path / name
  path.write_text("".join(
      (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
  return str(path)


ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in
        [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (12, 30)]]


def test_load_fixture(tmp_path):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  path = _write(tmp_path, [
      {"prompt": "1+1=", "answer": "2", "id": 7},
      "",                                               # blank lines are skipped
      {"prompt": msgs, "answer": 4},
      {"messages": msgs[1:], "answer": "#### 4", "source": "gsm8k"},
      {"prompt": "x", "answer": 0.5},
  ])
  recs = load_jsonl(path)
  assert [r.line for r in recs] == [1, 3, 4, 5]
  assert recs[0] == Record("1+1=", "2", 1, {"id": 7})
  assert recs[1].prompt == tuple(msgs) and recs[1].answer == "4"
  assert recs[2].prompt == tuple(msgs[1:]) and recs[2].info == {"source": "gsm8k"}
  assert recs[3].answer == "0.5"


def test_custom_keys(tmp_path):
  path = _write(tmp_path, [{"question": "q?", "solution": "#### 3"}])
  recs = load_jsonl(path, prompt_key="question", answer_key="solution")
  assert recs[0].prompt == "q?" and recs[0].answer == "#### 3"


def test_a_line_that_is_not_utf8_names_the_file_and_line(tmp_path, capsys):
  """Reliability issue, item 9: the error was ``'utf-8' codec can't decode byte 0xe9 in
  position 48`` (no file, no line; the position counted from the file's start)."""
  from jaxrl_llm.cli import main
  path = tmp_path / "data.jsonl"
  path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
  message = f"{path}:2: not UTF-8 text (byte 0xe9 at byte 16 of the line); save the file as UTF-8."
  with pytest.raises(ValueError) as info:
    load_jsonl(str(path))
  assert str(info.value) == message
  assert main(["train", "--dataset", str(path), "--reward", "math",
               "--out", str(tmp_path / "run")]) == 2
  assert capsys.readouterr().err.splitlines() == [f"error: {message}"]
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("line, message", [
    ("{not json", r"data.jsonl:2: invalid JSON"),
    ("[1, 2]", r"data.jsonl:2: expected a JSON object, got list"),
    ({"answer": "1"}, r"data.jsonl:2: missing 'prompt' \(or 'messages'\)"),
    ({"prompt": "q"}, r"data.jsonl:2: missing 'answer'"),
    ({"prompt": "", "answer": "1"}, r"data.jsonl:2: 'prompt' is an empty string"),
    ({"prompt": 3, "answer": "1"}, (r"data.jsonl:2: 'prompt': chat messages must be a "
                                    r"non-empty list, got int")),
    ({"prompt": [], "answer": "1"}, r"data.jsonl:2: 'prompt': chat messages must be"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, r"data.jsonl:2: 'prompt': message 0"),
    ({"messages": [{"role": "user", "content": 5}], "answer": "1"},
     r"data.jsonl:2: 'messages': message 0"),
    ({"prompt": "q", "answer": None}, (r"data.jsonl:2: 'answer' must be a string or a "
                                       r"number, got NoneType")),
    ({"prompt": "q", "answer": True}, r"'answer' must be a string or a number, got bool"),
    ({"prompt": "q", "answer": [1]}, r"got list"),
])
def test_malformed_lines_name_the_line(tmp_path, line, message):
  path = _write(tmp_path, [ROWS[0], line, ROWS[1]])
  with pytest.raises(ValueError, match=message):
    load_jsonl(path)


def test_empty_file(tmp_path):
  path = _write(tmp_path, ["", "  "])
  with pytest.raises(ValueError, match="no records"):
    load_jsonl(path)


def test_parse_record_direct():
  r = parse_record({"prompt": "p", "answer": 3}, line=9)
  assert (r.prompt, r.answer, r.line) == ("p", "3", 9)


def test_task_from_scratch_char_tokenizer(tmp_path):
  path = _write(tmp_path, ROWS)
  task = JsonlTask(path=path, max_new_tokens=3)
  tok = task.tokenizer
  assert isinstance(tok, CharTokenizer)
  assert set(tok.chars) == set("0123456789+=")
  assert task.max_prompt_len == len("12+30=")
  assert task.max_new_tokens == 3
  # Sampling: seeded, uniform with replacement over the rows.
  a = task.sample_prompts(np.random.default_rng(0), 50)
  b = task.sample_prompts(np.random.default_rng(0), 50)
  assert [p.prompt for p in a] == [p.prompt for p in b]
  assert {p.prompt for p in a} == {r["prompt"] for r in ROWS}
  # Eval: file order, no repeats, deterministic.
  evals = task.eval_problems(4)
  assert [p.prompt for p in evals] == [r["prompt"] for r in ROWS[:4]]
  assert len(task.eval_problems(100)) == len(ROWS)
  assert evals[0].info["line"] == 1
  # Scoring uses the reward ("math" by default) in one batched call.
  comps = ["3", "the sum is 7", "#### 12", "nonsense"]
  np.testing.assert_array_equal(task.score(evals, comps), [1, 1, 0, 0])
  np.testing.assert_array_equal(task.exact(evals, comps), [True, True, False, False])
  assert task.is_correct(evals[0], "3") and task.reward(evals[0], "4") == 0.0
  # The prompts encode with the task's tokenizer, as the trainer does.
  tokens, mask = tok.encode_batch([p.prompt for p in evals], task.max_prompt_len)
  assert tokens.shape == (4, task.max_prompt_len)
  assert tok.decode(tokens[0][mask[0] > 0]) == "1+2="


def test_task_reward_choices(tmp_path):
  path = _write(tmp_path, [{"prompt": "capital?", "answer": "Paris"}])
  task = JsonlTask(path=path, reward_fn="exact")
  p = task.eval_problems(1)
  assert task.score(p * 2, ["Paris", "paris"]).tolist() == [1.0, 0.0]
  custom = JsonlTask(path=path, reward_fn=lambda ps, cs, ans: np.full(len(cs), 0.25))
  assert custom.score(p, ["x"]).tolist() == [0.25]
  with pytest.raises(ValueError, match="`reward` must be one of"):
    JsonlTask(path=path, reward_fn="nope")
  bad = JsonlTask(path=path, reward_fn=lambda ps, cs, ans: np.ones(3))
  with pytest.raises(ValueError, match=r"returned shape \(3,\) for 1"):
    bad.score(p, ["x"])


def test_task_eval_splits(tmp_path):
  path = _write(tmp_path, ROWS)
  eval_path = _write(tmp_path, [{"prompt": "2+2=", "answer": "4"}], "eval.jsonl")
  task = JsonlTask(path=path, eval_path=eval_path)
  assert [p.prompt for p in task.eval_problems()] == ["2+2="]
  assert len(task.problems) == len(ROWS)
  # A hash split: held-out rows never appear in training.
  many = [{"prompt": f"{i}*{i}=", "answer": str(i * i)} for i in range(60)]
  task = JsonlTask(path=_write(tmp_path, many, "many.jsonl"), holdout=0.3)
  held = {p.prompt for p in task.eval_problems(1000)}
  train = {p.prompt for p in task.sample_prompts(np.random.default_rng(0), 500)}
  assert held and train and not held & train
  assert len(held) + len(task.problems) == 60
  with pytest.raises(ValueError, match="eval split"):
    JsonlTask(path=_write(tmp_path, ROWS[:1], "one.jsonl"), holdout=0.01)


def test_task_errors(tmp_path):
  msgs = [{"role": "user", "content": "hi"}]
  path = _write(tmp_path, [ROWS[0], {"prompt": msgs, "answer": "1"}])
  with pytest.raises(ValueError, match="line 2: a chat prompt needs a tokenizer"):
    JsonlTask(path=path)
  with pytest.raises(ValueError, match="chat prompt needs a tokenizer with a chat"):
    JsonlTask(path=path, tokenizer=CharTokenizer())
  with pytest.raises(ValueError, match=r"line 1: `text` '1\+2=' holds '\+'"):
    JsonlTask(path=_write(tmp_path, ROWS, "d2.jsonl"), tokenizer=CharTokenizer("0123"))
  with pytest.raises(ValueError, match="max_new_tokens"):
    JsonlTask(path=_write(tmp_path, ROWS, "d3.jsonl"), max_new_tokens=0)
  with pytest.raises(ValueError, match=r"data.jsonl:1: invalid JSON"):
    JsonlTask(path=_write(tmp_path, ["{"]))
