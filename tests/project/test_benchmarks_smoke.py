"""Smoke tests of the benchmarks: quick sizes, JSON written, RESULTS.md untouched.

Two runs of the runner (``python -m benchmarks``), so that pytest-xdist can give them
to different workers: the runner's bookkeeping with the cheap benchmarks (``gae``,
``train_step``) and a missing one, then the PPO-vs-GRPO benchmark (two short training
runs and the long-generation update) on its own.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_benchmarks(out, *args):
  proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out),
                         *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(out / "summary.json") as f:
    status = json.load(f)["status"]
  # A quick run writes its RESULTS.md into --out only, never benchmarks/RESULTS.md.
  wrote = [ln for ln in proc.stdout.splitlines() if ln.startswith("wrote ")]
  assert wrote == [f"wrote {out / 'RESULTS.md'}"]
  return status, (out / "RESULTS.md").read_text()


@pytest.mark.slow
def test_run_all_quick_statuses_json_and_results(tmp_path):
  status, text = run_benchmarks(tmp_path, "--only", "gae,train_step,no_such_benchmark",
                                "--args", "train_step=--models tiny")
  assert status["no_such_benchmark"] == "missing"
  assert status["train_step"] == "ok"
  assert status["gae"] in ("ok", "skipped")  # rlax is optional
  with open(tmp_path / "train_step.json") as f:
    rows = json.load(f)["rows"]
  assert rows and all(r["tokens_s"] > 0 and r["mfu"] > 0 for r in rows)
  assert {r["model"] for r in rows} == {"tiny"}          # --args reached the benchmark
  assert "missing" in text and "| train_step | ok |" in text


@pytest.mark.slow
def test_algorithms_benchmark_quick(tmp_path):
  status, text = run_benchmarks(
      tmp_path, "--only", "algorithms",
      "--args", "algorithms=--algos grpo,ppo --steps 2 --long-tokens 16")
  assert status["algorithms"] == "ok"
  with open(tmp_path / "algorithms.json") as f:
    alg = json.load(f)
  assert {r["algo"] for r in alg["runs"]} == {"grpo", "ppo"}
  assert all(r["iter_samples_s"] > 0 for r in alg["runs"])
  # A ratio of summed variances: NaN exactly when no rollout had any score variance.
  assert all(r["adv_var_norm"] >= 0 if r["score_var"] > 0 else math.isnan(r["adv_var_norm"])
             for r in alg["runs"])
  assert [r["algo"] for r in alg["long_generation"]] == ["ppo", "grpo"]
  assert "## PPO, VAPO, GRPO, DAPO, RLOO" in text


@pytest.mark.slow
def test_rollout_benchmark_quick(tmp_path):
  status, text = run_benchmarks(tmp_path, "--only", "rollout", "--args", "rollout=--no-hf")
  assert status["rollout"] == "ok"
  with open(tmp_path / "rollout.json") as f:
    result = json.load(f)
  assert [r["workload"] for r in result["rows"]] == ["heavy_tailed", "uniform"]
  assert all(r["engine_tok_s"] > 0 and r["sample_tok_s"] > 0 for r in result["rows"])
  assert result["shared_over_distinct"] > 0 and "## Rollout engine" in text


def test_adv_var_norm_is_a_ratio_of_summed_variances():
  from benchmarks.algorithms import _variance_ratio
  rows = [{"adv_var": 0.5, "score_var": 1.0}, {"adv_var": 0.25, "score_var": 0.0},
          {"adv_var": 0.25, "score_var": 1.0}]
  assert _variance_ratio(rows) == 0.5      # (0.5 + 0.25 + 0.25) / (1 + 0 + 1)
  assert _variance_ratio(rows[1:2]) != _variance_ratio(rows[1:2])   # NaN, not 2.5e11


def test_long_sequence_compile_case_tiny():
  # The long-sequence benchmark's measurement on the tiny config (1 device, default XLA
  # pipeline): the argument bytes are exactly the f32 params + Adam moments + count +
  # hparams + the six [1, T] batch arrays; temporaries are positive.
  import jax
  import optax
  from flax import nnx

  from benchmarks._aot import GIB
  from benchmarks.long_sequence import compile_case, model_config
  from jaxrl_llm.models.transformer import Transformer, split_model
  from jaxrl_llm.train import TrainConfig, init_train_state

  row = compile_case("tiny", "1", 64)
  _, params = split_model(nnx.eval_shape(lambda: Transformer(model_config("tiny"))))
  state = jax.eval_shape(lambda p: init_train_state(p, optax.adam(1e-5), TrainConfig()),
                         params)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert row["params"] == 90_497 and (row["mesh"], row["devices"], row["B"]) == ("1", 1, 1)
  assert row["args_gib"] * GIB == state_bytes + 6 * 64 * 4
  assert row["temp_gib"] > 0 and row["total_gib"] >= row["args_gib"]
  assert row["collective_permutes"] == 0


def test_long_sequence_mesh_specs():
  from benchmarks.long_sequence import main, mesh_devices, parse_mesh
  assert parse_mesh("1") == {} and mesh_devices("1") == 1
  assert parse_mesh("fsdp=4,sequence=2") == {"fsdp": 4, "sequence": 2}
  assert mesh_devices("fsdp=4,sequence=2") == 8
  with pytest.raises(ValueError, match="mesh"):
    parse_mesh("fsdp=0")
  with pytest.raises(SystemExit):
    main(["--meshes", "pipes=2"])


@pytest.mark.slow
def test_long_sequence_cli_tiny_meshes(tmp_path):
  # The command end to end on the tiny config: one device and fsdp=2,sequence=2 (4
  # forced CPU devices in the worker subprocess, B = 2 rows), default pipeline.
  out = tmp_path / "ls.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.long_sequence", "--models", "tiny",
                         "--meshes", "1", "fsdp=2,sequence=2", "--lengths", "64",
                         "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(r["mesh"], r["devices"], r["B"], r["pipeline"]) for r in rows] == [
      ("1", 1, 1, "default"), ("fsdp=2,sequence=2", 4, 2, "default")]
  assert all(r["total_gib"] > 0 for r in rows)
  assert rows[1]["collective_permutes"] > 0   # the ring over sequence=2


def test_lora_memory_fits_brackets_and_table():
  from benchmarks.lora_memory import fits, table
  rows = [{"model": "8b", "mode": "lora", "devices": 1, "T": t, "total_gib": g,
           "args_gib": 1.0, "temp_gib": g - 1.0, "opt_state_elems": 3, "compile_s": 1.0}
          for t, g in ((8192, 20.0), (16384, 30.0), (32768, 90.0))]
  rows.append({"model": "8b", "mode": "full", "devices": 8, "T": 8192, "skipped": "x"})
  assert fits(rows, 24.0) == {("8b", "lora", 1): (8192, 16384)}
  assert fits(rows, 80.0) == {("8b", "lora", 1): (16384, 32768)}
  assert fits(rows, 10.0) == {("8b", "lora", 1): (0, 8192)}
  text = table(rows)
  assert "| 8b | 1 | lora | 16384 | 30.00 | 1.00 | 29.00 | 3 | 1 |" in text
  assert "| 8b | 8 (fsdp=8) | full | 8192 | not compiled: x |" in text


@pytest.mark.slow
def test_lora_memory_cli_tiny_fsdp_rows_are_batch_sharded(tmp_path):
  # The command end to end on the tiny config, full and LoRA, on 1 device and on
  # fsdp=4 (4 forced CPU devices, B = 4 rows, one per device). Per device, the fsdp
  # rows' arguments shrink and their temporaries are not larger than one device's:
  # each device holds one row of activations (without shard_apply_fn's anchors XLA
  # kept all 4 rows on every device: ~1.6-1.7x the 1-device temporaries here).
  out = tmp_path / "lm.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.lora_memory", "--models", "tiny",
                         "--modes", "full,lora", "--lengths", "256", "--devices", "1,4",
                         "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = {(r["mode"], r["devices"]): r for r in json.loads(out.read_text())}
  assert set(rows) == {("full", 1), ("lora", 1), ("full", 4), ("lora", 4)}
  # Adam state: mu + nu + count; LoRA: 2 x (32,768 adapters (rank 16, 7 targets,
  # 2 layers) + 65 value head) + 1.
  assert rows["lora", 1]["opt_state_elems"] == 2 * (32_768 + 65) + 1
  assert rows["full", 1]["opt_state_elems"] == 2 * rows["full", 1]["params"] + 1
  for mode in ("full", "lora"):
    one, four = rows[mode, 1], rows[mode, 4]
    assert four["args_gib"] < one["args_gib"]
    assert 0 < four["temp_gib"] <= 1.05 * one["temp_gib"], (mode, four, one)
  assert "longest measured T within 24 GiB/device: 256" in proc.stdout


def test_agents_fake_environment_replies_with_fixed_lengths():
  from benchmarks.agents import FixedReplyEnv
  from jaxrl_llm.envs import CHAT_CHARS, PlainChat
  from jaxrl_llm.tasks.tokenizer import CharTokenizer
  chat = PlainChat(CharTokenizer(CHAT_CHARS))
  env = FixedReplyEnv(prompt=64, reply=48)
  assert len(chat.prompt_ids(env.reset(3))) == 64
  turn = chat.tokenizer.encode("abcd")                # a turn cut at its limit
  for _ in range(3):
    step = env.step("abcd")
    assert not step.done and len(chat.continuation_ids(step.messages, turn)) == 48


@pytest.mark.slow
def test_agents_benchmark_quick(tmp_path):
  # KV continuation vs re-prefilling, at smoke sizes, in this process.
  from benchmarks.agents import main
  (row,) = main(["--quick", "--json", str(tmp_path / "agents.json")])
  assert (row["episodes"], row["turns"], row["length"]) == (2, 3, 52)
  # 2 x (16 + 32 + 48) prompt tokens asked; continuing, each later turn prefills the
  # reply (12), the last sampled token and the 3 tokens of the last partial page.
  assert row["reprefill_prefill_tokens"] == 192 and row["reprefill_reused_tokens"] == 0
  assert row["continue_prefill_tokens"] == 2 * (16 + 16 + 16)
  assert row["continue_reused_tokens"] == 192 - 96 and row["same_episodes"] == 2
  assert row["reprefill_s"] > 0 and row["continue_s"] > 0
  assert json.loads((tmp_path / "agents.json").read_text())["rows"][0]["model"] == "tiny"
