"""What a new user with a real checkpoint hits first (issue: the first hour): one-line
command errors, defaults by model kind, and a misspelt --out on --resume."""

import json
import os
import re
import subprocess
import sys

import pytest

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.resolve import PRETRAINED_LR, SCRATCH_LR, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _command(*args, cwd):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "jaxrl_llm", *args], env=env, cwd=cwd,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, says", [
    (("train", "--steps", "abc"), "argument --steps: invalid int value: 'abc'"),
    (("train", "--resume", "--out", "runs/misspelt"), "--resume-or-start"),
    (("train", "--max-new-tokens", "8"), "--max-new-tokens applies to --dataset runs"),
])
def test_command_mistakes_are_one_line_and_write_nothing(tmp_path, args, says):
  done = _command(*args, cwd=tmp_path)
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and says in lines[0], done.stderr
  assert "--help" in lines[0] or "error:" in lines[0]
  assert not os.path.exists(tmp_path / "runs")


def _hf_run(tmp_path, **fields):
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text("{}")
  data = tmp_path / "train.jsonl"
  data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
  return RunConfig(model=str(model), dataset=str(data), **fields)


def test_learning_rates_default_by_model_kind(tmp_path):
  scratch = resolve(RunConfig(algo="ppo")).optimizer
  assert (scratch.lr, scratch.value_lr, scratch.split) == (SCRATCH_LR, SCRATCH_LR, False)
  pretrained = resolve(_hf_run(tmp_path, algo="ppo")).optimizer
  assert (pretrained.lr, pretrained.value_lr, pretrained.split) == (
      1e-5, pytest.approx(1e-4), True)
  assert PRETRAINED_LR == 1e-5
  (tmp_path / "v").mkdir()
  vapo = resolve(_hf_run(tmp_path / "v", algo="vapo")).optimizer
  assert vapo.value_lr == pytest.approx(2e-4)            # the recipe's 2x on top
  (tmp_path / "g").mkdir()
  given = resolve(_hf_run(tmp_path / "g", algo="ppo", lr=3e-6)).optimizer
  assert (given.lr, given.value_lr) == (3e-6, pytest.approx(3e-5))   # the user's flag wins


def test_early_note_names_the_dataset(capsys):
  from jaxrl_llm.cli import _early_note
  _early_note(RunConfig(dataset="data/math.jsonl", algo="ppo"))
  assert "ppo on data/math.jsonl" in capsys.readouterr().err


def test_from_pretrained_value_head_none_means_none(tmp_path):
  pytest.importorskip("safetensors")
  from flax import nnx

  from jaxrl_llm.models import Transformer, TransformerConfig, from_pretrained, save_pretrained
  save_pretrained(Transformer(TransformerConfig.tiny(32, value_head=False),
                              rngs=nnx.Rngs(0)), str(tmp_path))
  assert not from_pretrained(str(tmp_path), value_head=None).config.value_head
  with pytest.raises(ValueError, match="`value_head` must be"):
    from_pretrained(str(tmp_path), value_head=3)


@pytest.mark.parametrize("content, says", [
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', "train.jsonl:2: missing 'answer'"),
    ('{"prompt": "1+1=", "answer": "2"}\nnot json\n', "train.jsonl:2: invalid JSON"),
    ("", "no records"),
])
def test_dataset_mistakes_are_one_line_before_anything_heavy(tmp_path, content, says):
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text("{}")        # never loaded: the data is read first
  (tmp_path / "train.jsonl").write_text(content)
  done = _command("train", "--model", str(model), "--dataset", "train.jsonl",
                  "--out", "runs/x", cwd=tmp_path)
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
  assert not os.path.exists(tmp_path / "runs")


def test_python_save_writes_token_ids_and_generate_stops(tmp_path):
  """save_pretrained(..., tokenizer=tok) as the README shows it: config.json and
  generation_config.json carry the tokenizer's ids (two eos here, as Qwen / Llama-3
  list them), and transformers' generate stops at eos."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from jaxrl_llm.models import from_pretrained, save_pretrained
  from jaxrl_llm.models.transformer import split_model
  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  from tests.models.test_hf import _tiny_hf_folder
  model_dir, _ = _tiny_hf_folder(tmp_path)
  cfg = json.loads((tmp_path / "model" / "config.json").read_text())
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    cfg.pop(key, None)
  (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
  end_of_turn = HFTokenizer.from_pretrained(model_dir).tokenizer.token_to_id("<|im_end|>")
  (tmp_path / "model" / "generation_config.json").write_text(
      json.dumps({"eos_token_id": [1, end_of_turn]}))
  tok = HFTokenizer.from_pretrained(model_dir)
  assert tok.eos_ids == (1, end_of_turn)
  model = from_pretrained(model_dir)
  prompt = tok.encode("what is 3 + 4?")
  # Make the greedy first token eos: its lm_head column 10x the column of the token the
  # model would pick (a positive logit), so generate must stop after one token.
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
  with torch.no_grad():
    first = int(hf_model(torch.tensor([prompt])).logits[0, -1].argmax())
  graphdef, params = split_model(model)
  head = np.array(params["lm_head"][...])
  head[:, 1] = 10 * head[:, first]
  params["lm_head"][...] = jnp.asarray(head)
  model = nnx.merge(graphdef, params)
  out = str(tmp_path / "saved")
  save_pretrained(model, out, tokenizer=tok)
  saved_cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
  assert (saved_cfg["bos_token_id"], saved_cfg["eos_token_id"]) == (0, [1, end_of_turn])
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert list(reloaded.generation_config.eos_token_id) == [1, end_of_turn]
  assert HFTokenizer.from_pretrained(out).eos_ids == (1, end_of_turn)
  with torch.no_grad():
    generated = reloaded.generate(torch.tensor([prompt]), max_new_tokens=12,
                                  do_sample=False, pad_token_id=1)
  assert generated[0, len(prompt):].tolist() == [1]


@pytest.mark.slow
def test_run_without_learning_signal_warns_and_export_says_unchanged(tmp_path):
  """No sample can be right (a 2-token budget for 9-digit answers): the run says so in
  one warning line and its summary, config.json names the dataset (no built-in task),
  and export says the weights are bit-identical to the start."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from tests.models.test_hf import _tiny_hf_folder
  model_dir, _ = _tiny_hf_folder(tmp_path)
  (tmp_path / "train.jsonl").write_text("".join(
      json.dumps({"prompt": f"what is {i} * 111111111?", "answer": str(i * 111111111)})
      + "\n" for i in range(1, 9)))
  done = _command("train", "--model", model_dir, "--dataset", "train.jsonl", "--steps", "2",
                  "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "2",
                  "--eval-size", "2", "--out", "run", cwd=tmp_path)
  assert done.returncode == 0, done.stderr
  warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: no "
                                                                           "learning signal")]
  assert len(warnings) == 1 and "steps 1-2 of 2" in warnings[0], done.stderr
  assert re.search(r"cut at --max-new-tokens \d+%, without a parsable answer \d+%",
                   warnings[0]), warnings[0]
  assert "grpo on train.jsonl" in done.stderr
  assert re.search(r"warning +no learning signal in steps 1-2", done.stdout), done.stdout
  assert re.search(r"policy_weights +UNCHANGED: bit-identical", done.stdout), done.stdout
  config = json.loads((tmp_path / "run" / "config.json").read_text())
  assert (config["task"], config["dataset"]) == (None, "train.jsonl")
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert [r.get("no_learning_signal_steps") for r in rows] == [None, None, 2.0]
  done = _command("export", "run", "--out", "exported", cwd=tmp_path)
  assert done.returncode == 0, done.stderr
  assert "the policy's weights are UNCHANGED: bit-identical" in done.stderr


def test_a_dataset_run_has_no_built_in_task(tmp_path):
  (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
  run = RunConfig(dataset=str(tmp_path / "d.jsonl"))
  assert run.task is None and RunConfig().task == "reverse"
  assert RunConfig.from_dict({"task": "reverse", "dataset": run.dataset}).task is None
  run.validate()
  with pytest.raises(ValueError, match="--task copy and --dataset are exclusive"):
    RunConfig(dataset=run.dataset, task="copy").validate()


@pytest.mark.slow
def test_ctrl_c_ends_the_progress_line_and_draws_the_curves(tmp_path):
  """Ctrl-C on the real command with its progress bar on a terminal (a pty): the
  checkpoint message starts a line of its own and curves.png is written."""
  pytest.importorskip("matplotlib")
  import pty
  import select
  import signal
  import time
  master, slave = pty.openpty()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxrl_llm", "train", "--steps", "500", "--prompts-per-step",
       "2", "--group-size", "2", "--eval-size", "4", "--eval-every", "500",
       "--save-every", "500", "--out", "run"],
      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=slave, text=True)
  os.close(slave)
  text, sent, deadline = "", False, time.time() + 240
  while time.time() < deadline:
    ready, _, _ = select.select([master], [], [], 1.0)
    if ready:
      try:
        chunk = os.read(master, 4096)
      except OSError:            # the child closed the terminal
        break
      if not chunk:
        break
      text += chunk.decode(errors="replace")
    if not sent and re.search(r"\] [2-9]/500 ", text):
      proc.send_signal(signal.SIGINT)
      sent = True
    if proc.poll() is not None and not ready:
      break
  proc.wait(timeout=60)
  os.close(master)
  assert sent and proc.returncode == 128 + signal.SIGINT, text
  lines = re.split(r"\r?\n", text)       # (the terminal writes \r\n)
  (saved,) = [line for line in lines if "checkpoint saved" in line]
  assert re.fullmatch(r"\r?SIGINT: checkpoint saved at step \d+ in .*", saved), saved
  assert not [line for line in lines if "/500 " in line and "SIGINT" in line], text
  assert (tmp_path / "run" / "curves.png").stat().st_size > 0
  assert "curves: run/curves.png" in text


def test_prompts_longer_than_the_model_are_one_line(tmp_path):
  pytest.importorskip("transformers")
  from tests.models.test_hf import make_tokenizer_dir
  model_dir = make_tokenizer_dir(tmp_path / "model")
  (tmp_path / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 24}))
  rows = [{"prompt": "what is 3 + 4?", "answer": "7"},
          {"prompt": "hello world, what is 3 + 4? The answer is 7. " * 3, "answer": "7"}]
  (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  done = _command("train", "--model", model_dir, "--dataset", "train.jsonl",
                  "--max-new-tokens", "8", "--out", "runs/x", cwd=tmp_path)
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and re.match(
      r"error: train.jsonl:2: the prompt is \d+ tokens, which with --max-new-tokens 8 "
      r"needs \d+ positions; .* has 24 \(max_position_embeddings\)", lines[0]), lines
  assert not os.path.exists(tmp_path / "runs")


def test_answers_the_reward_cannot_parse_warn_with_examples(tmp_path):
  from jaxrl_llm.loop.datacheck import UNREACHABLE_SHARE, check_dataset
  answers = ["7", "#### 12", r"\frac{1}{2}"] * 6 + ["x = 3, y = 4", r"(1, \sqrt{2})"]
  data = tmp_path / "d.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n"
                          for i, a in enumerate(answers)))
  assert UNREACHABLE_SHARE == 0.05      # 2 of 20 rows (10%) are more than that
  (warning,) = check_dataset(RunConfig(dataset=str(data), max_new_tokens=4))
  assert warning.startswith("warning: --reward math cannot parse the answers of 2 of 20 ")
  assert "line 19: 'x = 3, y = 4'; line 20: '(1, \\\\sqrt{2})'" in warning
  assert check_dataset(RunConfig(dataset=str(data), max_new_tokens=4, reward="exact")) == []
  data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n"
                          for i, a in enumerate(answers[:18] + ["8"])))
  assert check_dataset(RunConfig(dataset=str(data), max_new_tokens=4)) == []


def test_a_checkpoint_trains_with_rematerialised_blocks_by_default(tmp_path):
  """``--remat`` None: a checkpoint's blocks are rematerialised in the train step (the
  same parameters, the same logits), a preset's are not; ``--remat`` with LoRA is one
  line."""
  pytest.importorskip("transformers")
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from jaxrl_llm.loop.setup import load_models, make_task
  from tests.models.test_hf import _tiny_hf_folder
  model_dir, data = _tiny_hf_folder(tmp_path)
  runs = {v: RunConfig(model=model_dir, dataset=data, remat=v) for v in (None, False)}
  loaded = {v: load_models(resolve(run), make_task(run))[:2] for v, run in runs.items()}
  on, off = loaded[None], loaded[False]
  assert nnx.merge(*on).config.remat and not nnx.merge(*off).config.remat
  tokens = jnp.array([[1, 2, 3, 4]])
  logits = [np.asarray(m.logits(m(tokens)[0])) for m in (nnx.merge(*on), nnx.merge(*off))]
  np.testing.assert_array_equal(*logits)
  preset = RunConfig()
  assert not nnx.merge(*load_models(resolve(preset), make_task(preset))[:2]).config.remat
  with pytest.raises(ValueError, match="--remat is not supported with --lora-rank"):
    RunConfig(model=model_dir, dataset=data, remat=True, lora_rank=4).validate()
