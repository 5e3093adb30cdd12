r"""PPO, VAPO, GRPO, DAPO and RLOO on a built-in task (``reverse``, or the 200-token
``repeat``), plus a 2048-token update benchmark.

Run: ``python -m benchmarks.algorithms [--quick] [--seeds 3] [--task repeat]
[--algos ppo,vapo,grpo,dapo,rloo] [--rollout engine|simple] [--json out.json]``.

Part 1 (full RL runs). Each algorithm trains the tiny reference transformer with
:func:`jaxrl_llm.loop.run.run_training` under the same compute budget: ``prompts_per_step x
group_size`` sampled completions per step, the same number of steps, the same
optimizer. PPO uses a value head, GAE and whitened advantages with the KL in the
reward (the ``ppo`` recipe of :mod:`jaxrl_llm.loop.recipes`); VAPO (the ``vapo`` recipe) adds
decoupled, length-adaptive GAE, a critic warm-up, a 2x value learning rate,
clip-higher and the positive-example NLL; GRPO and RLOO use their group baselines with
the KL in the loss; DAPO (the ``dapo`` recipe) is the group baseline with clip-higher,
dynamic sampling (its extra rollouts are reported as ``groups drawn / step``; the
throughput counts the ``B`` trained samples) and the soft overlong penalty. Over
``--seeds`` seeds we report min / median / max of:

* ``iter samples/s``: completions per second of a full iteration (rollout, old and
  reference log-probs, advantages, update): ``B / time_s`` of each step (the trainer's
  per-step timer, evals excluded), median over steps 2.. (step 1 compiles).
* ``rollout samples/s``: the rollout part of that (sampling, scoring, old and
  reference log-probs: :func:`jaxrl_llm.loop.batch.build_batch`), timed inside the run.
* ``update samples/s (in run)``: the jitted, donated train step of the run itself
  (step time minus rollout time), median over steps 2..; ``(fixed batch)``: the same
  step jitted without donation and timed on the first rollout's batch (full mode
  only: it costs one more compile per run).
* ``adv_raw_var``: the per-token variance of the advantages *as the estimator produces
  them*, before PPO's whitening (the train step's metric). PPO's GAE advantages are in
  reward units; GRPO's are already divided by the group std (unit scale), RLOO's are in
  reward units. These numbers are therefore **not comparable across algorithms**.
* ``adv_var_norm`` (the comparable one): the per-token variance of the advantage in
  reward units divided by the per-token variance of the sequence score in the same
  batch,

  .. math::

     \mathrm{adv\_var\_norm} = \frac{\mathrm{Var}_{t}[\tilde A_{i,t}]}
                                    {\mathrm{Var}_{t}[R_i]}

  where both variances run over all valid response tokens of the batch (a sequence's
  score :math:`R_i` broadcast over its tokens) and :math:`\tilde A` is the advantage
  before any rescaling: GAE for PPO (on the KL-penalised rewards, with the rollout
  values), :math:`R_i - \mathrm{mean}_{\mathrm{group}}(R)` for GRPO (its advantage
  times the group std: the division is a rescaling, not variance reduction) and the
  leave-one-out difference for RLOO. It is the fraction of the reward variance left
  in the policy-gradient weight by the baseline: 1 = no baseline, lower = the baseline
  explains more. Both variances are measured on every rollout of the run and summed
  over steps before dividing (a ratio of sums: a step whose scores are all equal adds
  its advantage variance and nothing to the denominator, instead of a division by ~0).
  For VAPO :math:`\tilde A` is its own estimator's (decoupled GAE, length-adaptive
  lambda); for DAPO the group-centred score including the overlong penalty.
* ``value EV``: the explained variance of the critic's values for the returns (the
  train step's ``explained_variance``), mean over the first and the last quarter of
  the steps (value recipes only; the whole curve is in the JSON).
* steps and training wall time (sum of ``time_s``; evals excluded, the first step
  counted at the median step time so compile time is excluded) to reach
  ``--target`` greedy eval accuracy (or eval reward with ``--target-metric reward``;
  evaluated every ``eval_every`` steps), or "not reached"; and the final eval accuracy
  and reward.

Part 2 (long generation). A full RL run with 2048-token responses is not feasible on a
small machine, so on synthetic batches (random tokens, ``max_new_tokens`` response
tokens, score at the last token) we time: the jitted update of PPO (value head, GAE,
value loss) and of GRPO (no value head, given advantages), and the KV-cache rollout of
the same number of tokens with :func:`jaxrl_llm.rollout.sampler.sample`.

Beside our figures the printed tables give the figures claimed by the article in
``/work/shared/reference/ppo_over_grpo_article.txt`` (labelled "article"): PPO 18K vs
GRPO 12K samples/s at 2048 tokens, advantage variance 0.14 vs 0.32, "42% faster
convergence". Those were measured on a different model, task and cluster; they are
context, not a target.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine, markdown_table, timeit, write_json
from jaxrl_llm import advantages as A
from jaxrl_llm.loop import run as T
from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.loop.resolve import resolve
from jaxrl_llm.losses import kl_penalty
from jaxrl_llm.models.transformer import (
  Transformer,
  get_config,
  make_apply_fn,
  make_decode_fns,
  split_model,
)
from jaxrl_llm.rollout.sampler import sample
from jaxrl_llm.tasks import get_task
from jaxrl_llm.train import (
  POLICY_LOSS_REGISTRY,
  AdvantageInputs,
  compute_advantages,
  get_advantage_estimator,
  make_train_step,
)

ALGOS = ("ppo", "vapo", "grpo", "dapo", "rloo")
TASKS = ("reverse", "repeat")
_NONE = {"samples_s_2048": None, "adv_var": None, "convergence": None}
ARTICLE = {  # figures claimed by the article (theirs, not measured here)
    "ppo": {"samples_s_2048": 18000.0, "adv_var": 0.14, "convergence": "42% faster"},
    "grpo": {"samples_s_2048": 12000.0, "adv_var": 0.32, "convergence": "baseline"},
    "vapo": _NONE, "dapo": _NONE, "rloo": _NONE,
}


# ------------------------------------------------------------------ advantage variance


def _token_var(x, mask):
  m = mask > 0
  n = max(int(m.sum()), 1)
  mean = float(np.sum(np.where(m, x, 0.0))) / n
  return float(np.sum(np.where(m, (x - mean) ** 2, 0.0))) / n


def _in_step_raw_advantages(config, batch, mask):
  """The in-step estimator's advantages on the (KL-penalised) rewards, before
  whitening, as the train step computes them."""
  rewards = jnp.asarray(batch["rewards"])
  if config.kl_mode == "reward":
    rewards = rewards - config.kl_coef * kl_penalty(
        jnp.asarray(batch["old_logp"]), jnp.asarray(batch["ref_logp"]),
        config.reward_kl_kind, mask=mask)
  spec = get_advantage_estimator(config.advantage_estimator)
  static = tuple((k, getattr(config, k)) for k in spec.static)
  return np.asarray(_estimate(rewards, batch["old_values"], mask, config.hparams(),
                             estimator=config.advantage_estimator, static=static))


@functools.partial(jax.jit, static_argnames=("estimator", "static"))
def _estimate(rewards, values, mask, hparams, *, estimator, static):
  """The estimator's advantages, compiled once per (estimator, static fields, shape)."""
  adv, _ = compute_advantages(estimator, AdvantageInputs(rewards=rewards, values=values,
                                                         mask=mask), hparams, **dict(static))
  return adv


def token_variances(resolved, batch, scores):
  """``(Var_t[A~], Var_t[R])`` over the batch's response tokens (see module docstring)."""
  mask = np.asarray(batch["loss_mask"], np.float32)
  s = np.asarray(scores, np.float32)
  run, config = resolved.run, resolved.train
  if run.algo in ("ppo", "vapo"):
    adv = _in_step_raw_advantages(config, batch, mask)
  elif run.algo in ("grpo", "dapo"):
    g = s.reshape(-1, run.group_size)
    adv = (g - g.mean(axis=1, keepdims=True)).reshape(-1)[:, None] * mask
  elif run.algo == "rloo":
    adv = np.asarray(A.rloo_advantages(jnp.asarray(s), group_size=run.group_size))
    adv = adv[:, None] * mask
  else:
    raise ValueError(run.algo)
  return _token_var(adv, mask), _token_var(s[:, None] * mask, mask)


def _variance_ratio(rows):
  """``sum(adv_var) / sum(score_var)`` over ``rows`` (NaN when no step had any score
  variance): a ratio of sums, so a step whose scores were all equal adds its advantage
  variance without dividing by ~0."""
  den = sum(r["score_var"] for r in rows)
  return sum(r["adv_var"] for r in rows) / den if den > 0 else float("nan")


class _Recorder:
  """Wraps :func:`jaxrl_llm.loop.batch.build_batch` to record per-rollout statistics.

  The batch rows' scores come from ``build_batch``'s ``info`` (as the advantages saw
  them: after dynamic sampling, with the overlong penalty), so the training run
  itself is untouched.
  """

  def __init__(self):
    self.rows = []
    self.first_batch = None
    self._orig = T.build_batch

  def __call__(self, resolved, task, policy, params, ref_params, rng_np, key, **kwargs):
    t0 = time.perf_counter()
    info: dict | None = kwargs.pop("info", None)    # the loop's own, when it passes one
    if info is None:
      info = {}
    batch, stats = self._orig(resolved, task, policy, params, ref_params, rng_np, key,
                              info=info, **kwargs)
    t1 = time.perf_counter()
    if self.first_batch is None:
      self.first_batch = {k: np.array(val) for k, val in batch.items()}
    adv_var, score_var = token_variances(resolved, batch, info["scores"])
    # Our own bookkeeping is subtracted from the trainer's step time.
    self.rows.append({"adv_var": adv_var, "score_var": score_var, "rollout_s": t1 - t0,
                      "overhead_s": time.perf_counter() - t1})
    return batch, stats

  def __enter__(self):
    T.build_batch = self
    return self

  def __exit__(self, *exc):
    T.build_batch = self._orig


# ------------------------------------------------------------------------ RL runs


def _update_samples_per_s(run, batch, repeats):
  """Samples/s of the jitted train step alone on ``batch`` (no donation)."""
  task = get_task(run.task)
  tok = task.tokenizer
  resolved = resolve(run, task)
  config = resolved.train
  policy = Policy.reference(run.model, tok.vocab_size,
                              task.max_prompt_len + task.max_new_tokens, tok.pad_id,
                              value_head=config.use_value, seed=run.seed,
                              temperature=config.temperature)
  step_fn = make_train_step(policy.apply, resolved.optimizer.build(), config)
  step = jax.jit(step_fn)
  state = step_fn.init(policy.init_params, rng=jax.random.PRNGKey(run.seed))
  batch = {k: jnp.asarray(val) for k, val in batch.items()}
  sec = timeit(step, state, batch, repeats=repeats)
  return batch["tokens"].shape[0] / sec


def _quarter_means(values):
  """Means over the first and the last quarter of ``values`` (None when empty)."""
  vals = [x for x in values if x is not None and np.isfinite(x)]
  if not vals:
    return None, None
  q = max(len(vals) // 4, 1)
  return float(np.mean(vals[:q])), float(np.mean(vals[-q:]))


def run_one(algo, seed, size, out_dir, target, update_repeats, train=None,
            task="reverse", target_metric="accuracy", rollout="engine"):
  run = RunConfig(algo=algo, seed=seed, steps=size["steps"], train=dict(train or {}),
                    task=task, rollout=rollout,
                    prompts_per_step=size["prompts"], group_size=size["group"],
                    eval_every=size["eval_every"], eval_size=size["eval_size"],
                    save_every=10 ** 9, out=os.path.join(out_dir, f"{algo}_{seed}"),
                    overwrite=True, progress=False)
  t0 = time.perf_counter()
  with _Recorder() as rec:
    summary = T.run_training(run)
  total_s = time.perf_counter() - t0
  with open(os.path.join(run.out, "metrics.jsonl")) as f:
    hist = [json.loads(line) for line in f if line.strip()]
  steps = [r for r in hist if "time_s" in r]
  b = run.prompts_per_step * run.group_size
  step_times = [r["time_s"] - x["overhead_s"] for r, x in zip(steps, rec.rows)]
  update_times = [t - x["rollout_s"] for t, x in zip(step_times, rec.rows)]
  med = statistics.median(step_times[1:] or step_times)
  med_update = statistics.median(update_times[1:] or update_times)
  cum, elapsed = {}, 0.0
  for r, t in zip(steps, step_times):
    elapsed += med if r["step"] == 1 else t
    cum[r["step"]] = elapsed
  late = rec.rows[len(rec.rows) // 2:]
  reached = [r for r in hist if r.get(f"eval_{target_metric}", -1.0) >= target]
  first = reached[0]["step"] if reached else None
  ev_curve = [[r["step"], r["explained_variance"]] for r in steps
              if "explained_variance" in r]
  ev_first, ev_last = _quarter_means([ev for _, ev in ev_curve])
  drawn = [r["groups_drawn"] for r in steps if "groups_drawn" in r]
  out = {
      "algo": algo, "task": task, "seed": seed, "B": b, "steps": run.steps,
      "iter_samples_s": b / med,
      "update_samples_s": b / med_update,
      "update_fixed_samples_s": (_update_samples_per_s(run, rec.first_batch,
                                                       update_repeats)
                                 if update_repeats else None),
      "rollout_samples_s": b / statistics.median(
          [x["rollout_s"] for x in rec.rows[1:]] or [rec.rows[0]["rollout_s"]]),
      "adv_raw_var": float(np.mean([r["adv_raw_var"] for r in steps])),
      "adv_var_norm": _variance_ratio(rec.rows),
      "adv_var_norm_late": _variance_ratio(late),
      "score_var": float(np.mean([r["score_var"] for r in rec.rows])),
      "steps_to_target": first,
      "wall_to_target_s": (cum.get(first, 0.0) if first is not None else None),
      "final_eval_accuracy": summary["eval_accuracy_end"],
      "final_eval_reward": summary["eval_reward_end"],
      "final_kl_ref": steps[-1].get("kl_ref"),
      "value_ev_first_quarter": ev_first,
      "value_ev_last_quarter": ev_last,
      "value_ev_curve": ev_curve,
      "groups_drawn_per_step": float(np.mean(drawn)) if drawn else None,
      "eval_curve": [[r["step"], r["eval_accuracy"]] for r in hist
                     if "eval_accuracy" in r],
      "eval_reward_curve": [[r["step"], r["eval_reward"]] for r in hist
                            if "eval_reward" in r],
      "run_total_s": total_s,
  }
  return out


def _mmm(values, missing="not reached"):
  vals = [x for x in values if x is not None]
  if not vals:
    return missing
  note = "" if len(vals) == len(values) else f" ({len(vals)}/{len(values)} seeds)"
  fmt = lambda x: f"{x:.3g}"
  if len(vals) == 1:
    return fmt(vals[0]) + note
  return f"{fmt(min(vals))} / {fmt(statistics.median(vals))} / {fmt(max(vals))}{note}"


def summarise(results, target, metric="accuracy"):
  table = []
  for algo in ALGOS:
    rs = [r for r in results if r["algo"] == algo]
    if not rs:
      continue
    art = ARTICLE[algo]
    table.append({
        "algo": algo,
        "iter samples/s": _mmm([r["iter_samples_s"] for r in rs]),
        "rollout samples/s": _mmm([r["rollout_samples_s"] for r in rs]),
        "update samples/s (in run)": _mmm([r["update_samples_s"] for r in rs]),
        "update samples/s (fixed batch)": _mmm([r["update_fixed_samples_s"]
                                                for r in rs], "-"),
        "adv_raw_var": _mmm([r["adv_raw_var"] for r in rs]),
        "adv_var_norm": _mmm([r["adv_var_norm"] for r in rs]),
        "adv_var_norm (2nd half)": _mmm([r["adv_var_norm_late"] for r in rs]),
        "value EV (1st quarter)": _mmm([r["value_ev_first_quarter"] for r in rs], "-"),
        "value EV (last quarter)": _mmm([r["value_ev_last_quarter"] for r in rs], "-"),
        "groups drawn / step": _mmm([r["groups_drawn_per_step"] for r in rs], "-"),
        f"steps to {metric} {target}": _mmm([r["steps_to_target"] for r in rs]),
        f"wall s to {metric} {target}": _mmm([r["wall_to_target_s"] for r in rs]),
        "final eval acc": _mmm([r["final_eval_accuracy"] for r in rs]),
        "final eval reward": _mmm([r["final_eval_reward"] for r in rs]),
        "article adv var (theirs)": art["adv_var"] if art["adv_var"] is not None else "-",
        "article convergence (theirs)": art["convergence"] or "-",
    })
  return table


# ------------------------------------------------------------------ long generation


def _synthetic_batch(rng, b, prompt_len, new_tokens, vocab, value):
  length = prompt_len + new_tokens
  tokens = rng.integers(1, vocab, (b, length)).astype(np.int32)
  attn = np.ones((b, length), np.float32)
  loss_mask = np.concatenate([np.zeros((b, prompt_len)), np.ones((b, new_tokens))],
                             1).astype(np.float32)
  scores = rng.uniform(size=b).astype(np.float32)
  batch = {"tokens": tokens, "attention_mask": attn, "loss_mask": loss_mask,
           "old_logp": np.full((b, length), -np.log(vocab), np.float32) * loss_mask,
           "ref_logp": np.full((b, length), -np.log(vocab), np.float32) * loss_mask}
  if value:
    rewards = np.zeros((b, length), np.float32)
    rewards[:, -1] = scores
    batch.update(rewards=rewards, old_values=np.zeros((b, length), np.float32))
  else:
    batch["advantages"] = (scores - scores.mean()) / (scores.std() + 1e-6)
  return {k: jnp.asarray(val) for k, val in batch.items()}


def long_generation(model, batch, prompt_len, new_tokens, repeats, vocab=64):
  """Samples/s of the PPO / GRPO update and of the rollout at ``new_tokens`` tokens."""
  rng = np.random.default_rng(0)
  rows = []
  max_len = prompt_len + new_tokens
  for algo in ("ppo", "grpo"):
    value = algo == "ppo"
    cfg = get_config(model, vocab, value_head=value, max_seq_len=max_len)
    graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
    # resolve reads the task's response budget alone: the generation length here.
    resolved = resolve(RunConfig(algo=algo, model=model, lr=1e-4),
                       types.SimpleNamespace(max_new_tokens=new_tokens))
    step_fn = make_train_step(make_apply_fn(graphdef), resolved.optimizer.build(),
                              resolved.train)
    step = jax.jit(step_fn)
    state = step_fn.init(params, rng=jax.random.PRNGKey(0))
    data = _synthetic_batch(rng, batch, prompt_len, new_tokens, vocab, value)
    sec = timeit(step, state, data, repeats=repeats)
    row = {"setting": f"{model}, B={batch}, prompt {prompt_len} + {new_tokens} tokens",
           "algo": algo, "update_samples_s": batch / sec,
           "update_tokens_s": batch * max_len / sec}
    if algo == "ppo":
      # The rollout is the same for both (the value head costs nothing while sampling).
      fns = make_decode_fns(graphdef)
      sampler = jax.jit(lambda p, t, m, k: sample(
          fns, p, t, m, k, max_new_tokens=new_tokens,  # noqa: B023 (used in this iteration)
          temperature=1.0, eos_id=None, pad_id=0).completion)
      prompts = jnp.asarray(rng.integers(1, vocab, (batch, prompt_len)), jnp.int32)
      pmask = jnp.ones((batch, prompt_len), jnp.float32)
      rsec = timeit(sampler, params, prompts, pmask, jax.random.PRNGKey(1),
                    repeats=max(1, repeats // 2))
      row["rollout_samples_s"] = batch / rsec
      row["rollout_tokens_s"] = batch * new_tokens / rsec
    art = ARTICLE[algo]["samples_s_2048"]
    row["article samples/s @2048 (theirs)"] = art
    rows.append(row)
  grpo_rate = rows[1]["update_samples_s"]
  rows[0]["rollout+update samples/s"] = 1.0 / (1 / rows[0]["rollout_samples_s"]
                                               + 1 / rows[0]["update_samples_s"])
  rows[1]["rollout_samples_s"] = rows[0]["rollout_samples_s"]
  rows[1]["rollout+update samples/s"] = 1.0 / (1 / rows[0]["rollout_samples_s"]
                                               + 1 / grpo_rate)
  return rows


# ------------------------------------------------------------------------------ notes


def notes(table_rows, long_rows, results, target, metric="accuracy"):
  """Plain-language reading of the figures (conditional on what was measured)."""
  med = lambda algo, key: statistics.median(
      [r[key] for r in results if r["algo"] == algo and r[key] is not None]
      or [float("nan")])
  out = []
  ppo_u, grpo_u = med("ppo", "update_samples_s"), med("grpo", "update_samples_s")
  ppo_i, grpo_i = med("ppo", "iter_samples_s"), med("grpo", "iter_samples_s")
  ppo_r, grpo_r = med("ppo", "rollout_samples_s"), med("grpo", "rollout_samples_s")
  out.append(
      f"Update alone (in run): PPO {ppo_u:.0f} vs GRPO {grpo_u:.0f} samples/s "
      f"({'PPO measured faster' if ppo_u > grpo_u else 'PPO not faster'}). Per sample "
      "PPO's step does GRPO's work plus a value head, GAE and a value loss (a few "
      "percent of the FLOPs on the tiny model), so a PPO lead is not a real speed-up: "
      "the batches differ (each policy's responses have their own lengths, and the "
      "step's cost on this CPU follows them) and the shared machine adds noise.")
  out.append(
      f"Full iteration: PPO {ppo_i:.0f} vs GRPO {grpo_i:.0f} samples/s; the rollout "
      f"alone runs at {ppo_r:.0f} vs {grpo_r:.0f} samples/s. On a tiny model the rollout "
      "(sequential KV-cache decoding, scoring in Python, two extra forwards for old "
      "and reference log-probs) is the larger part of an iteration, and its cost "
      "follows the response lengths each policy happens to produce.")
  lp = {r["algo"]: r for r in long_rows}
  if lp:
    faster = lp["ppo"]["update_samples_s"] > lp["grpo"]["update_samples_s"]
    out.append(
        f"Long generation ({long_rows[0]['setting']}): update PPO "
        f"{lp['ppo']['update_samples_s']:.3g} vs GRPO {lp['grpo']['update_samples_s']:.3g} "
        f"samples/s ({'PPO measured faster' if faster else 'PPO not faster'}), rollout "
        f"{lp['ppo']['rollout_samples_s']:.3g} samples/s. "
        + ("PPO's update does strictly more work than GRPO's (value head and value "
           "loss; GRPO's only extra is its k3 KL term in the loss), so a PPO lead of "
           "this size is run-to-run noise on a shared CPU, not a real speed-up. "
           if faster else "")
        + "The article's 18K vs 12K samples/s (PPO +50%) is not reproduced and cannot "
        "come from the update with the same samples and model; a throughput advantage "
        "for PPO could only come from generating fewer samples per prompt (G = 1 vs "
        "G > 1), which is a different compute budget. The rollout costs about as much "
        "as the update here, so rollout + update differs even less.")
  ppo_n, grpo_n = med("ppo", "adv_var_norm"), med("grpo", "adv_var_norm")
  ppo_l, grpo_l = med("ppo", "adv_var_norm_late"), med("grpo", "adv_var_norm_late")
  out.append(
      f"Advantage variance normalised by the score variance (comparable across "
      f"algorithms): PPO {ppo_n:.3g} vs GRPO {grpo_n:.3g} vs RLOO "
      f"{med('rloo', 'adv_var_norm'):.3g} over the run, PPO {ppo_l:.3g} vs GRPO "
      f"{grpo_l:.3g} over its second half: "
      f"{'PPO is lower' if ppo_n < grpo_n else 'PPO is NOT lower'}. With one terminal "
      "reward per response, PPO's GAE advantage is the score minus a learned value, so "
      "its variance includes the critic's error (large while the critic is untrained); "
      "the group mean of G samples of the same prompt is an unbiased per-prompt "
      "baseline from the start. The raw variances (PPO "
      f"{med('ppo', 'adv_raw_var'):.3g}, GRPO {med('grpo', 'adv_raw_var'):.3g}) are in "
      "different units (reward units vs group-std units) and are not comparable; the "
      "article does not say how its 0.14 vs 0.32 were normalised.")
  have = {r["algo"] for r in results}
  if "vapo" in have:
    out.append(
        f"VAPO vs PPO: adv_var_norm {med('vapo', 'adv_var_norm'):.3g} vs {ppo_n:.3g}; "
        f"value EV over the last quarter {med('vapo', 'value_ev_last_quarter'):.3g} vs "
        f"{med('ppo', 'value_ev_last_quarter'):.3g} (VAPO's value targets are "
        "Monte-Carlo returns, lam_value=1, and its first steps only train the critic).")
  if "dapo" in have:
    out.append(
        f"DAPO vs GRPO: adv_var_norm {med('dapo', 'adv_var_norm'):.3g} vs {grpo_n:.3g}; "
        f"DAPO drew {med('dapo', 'groups_drawn_per_step'):.3g} groups per step for "
        "its batch (dynamic sampling): every draw is in its iter and rollout samples/s "
        "(B trained samples over the time of all draws), none in update samples/s.")
  conv = {a: [r["steps_to_target"] for r in results if r["algo"] == a] for a in ALGOS}
  out.append(
      f"Steps to eval {metric} {target} per seed: "
      + ", ".join(f"{a} {['-' if x is None else x for x in v]}" for a, v in conv.items()
                  if v)
      + " ('-' = not reached). The article's '42% faster convergence' is its own claim "
      "for its own setting; compare the rows above for ours.")
  return out


# ------------------------------------------------------------------------------- main


FULL = {"steps": 120, "prompts": 32, "group": 8, "eval_every": 10, "eval_size": 256}
# --quick uses the test-suite's training sizes (tests/loop/test_trainer.py SMALL), so its
# compiled programs come from the shared compilation cache.
QUICK = {"steps": 4, "prompts": 4, "group": 2, "eval_every": 4, "eval_size": 8}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="a few steps, 1 seed, tiny sizes")
  p.add_argument("--seeds", type=int, default=None, help="seeds per algorithm (3)")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--target", type=float, default=0.3,
                 help="eval target: accuracy (or reward with --target-metric reward)")
  p.add_argument("--target-metric", default="accuracy", choices=("accuracy", "reward"),
                 help="the eval metric --target applies to (reward: the task's partial "
                      "credit, for tasks where exact answers come late)")
  p.add_argument("--prompts", type=int, default=None, help="prompts per step (32)")
  p.add_argument("--group", type=int, default=None, help="samples per prompt (8)")
  p.add_argument("--eval-every", type=int, default=None, help="steps between evals (10)")
  p.add_argument("--eval-size", type=int, default=None, help="held-out prompts (256)")
  p.add_argument("--long-tokens", type=int, default=None, help="response length (2048)")
  p.add_argument("--long-batch", type=int, default=None, help="long-gen batch (4)")
  p.add_argument("--skip-long", action="store_true")
  p.add_argument("--task", default="reverse", choices=TASKS,
                 help="the built-in task (repeat: 200-token answers, reward at the end)")
  p.add_argument("--algos", default=",".join(ALGOS),
                 help=f"comma-separated recipes, of {ALGOS} (the adv_var_norm metric is "
                      "defined for these)")
  p.add_argument("--policy-loss", default=None, choices=sorted(POLICY_LOSS_REGISTRY),
                 help="policy loss for every run (default: each recipe's)")
  p.add_argument("--rollout", default="engine", choices=("engine", "simple"),
                 help="how the runs generate (RunConfig.rollout)")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  size = dict(QUICK if args.quick else FULL)
  for key in ("steps", "prompts", "group", "eval_every", "eval_size"):
    if getattr(args, key):
      size[key] = getattr(args, key)
  seeds = args.seeds or (1 if args.quick else 3)
  algos = [a for a in args.algos.split(",") if a]
  for a in algos:
    if a not in ALGOS:
      raise SystemExit(f"--algos: unknown {a!r}; choose from {ALGOS}")

  print(f"# {' vs '.join(a.upper() for a in algos)} ({machine()})", flush=True)
  print(f"task {args.task}, model tiny, {size['prompts']} prompts x {size['group']} samples "
        f"per step, {size['steps']} steps, {seeds} seed(s), eval every "
        f"{size['eval_every']} on {size['eval_size']} held-out prompts", flush=True)
  results = []
  with tempfile.TemporaryDirectory(prefix="jaxrl_llm_bench_") as tmp:
    for algo in algos:
      for seed in range(seeds):
        train = {} if args.policy_loss is None else {"policy_loss": args.policy_loss}
        r = run_one(algo, seed, size, tmp, args.target, 0 if args.quick else 10, train,
                    task=args.task, target_metric=args.target_metric,
                    rollout=args.rollout)
        results.append(r)
        print(f"  {algo} seed {seed}: iter {r['iter_samples_s']:.0f} samples/s, "
              f"update {r['update_samples_s']:.0f} samples/s, adv_var_norm "
              f"{r['adv_var_norm']:.3f}, final acc {r['final_eval_accuracy']:.3f} "
              f"({r['run_total_s']:.0f}s)", flush=True)
  table = summarise(results, args.target, args.target_metric)
  cols = list(table[0]) if table else []
  print("\nmin / median / max over seeds")
  print(markdown_table(table, cols))

  long_rows = []
  if not args.skip_long:
    tokens = args.long_tokens or (64 if args.quick else 2048)
    bsz = args.long_batch or (2 if args.quick else 4)
    long_rows = long_generation("tiny", bsz, 16, tokens, 2 if args.quick else 3)
    lcols = ["setting", "algo", "update_samples_s", "update_tokens_s",
             "rollout_samples_s", "rollout+update samples/s",
             "article samples/s @2048 (theirs)"]
    print(f"\nLong generation ({tokens} response tokens, synthetic batch)")
    print(markdown_table(long_rows, lcols))

  note_lines = (notes(table, long_rows, results, args.target, args.target_metric)
                if results else [])
  print("\nNotes:")
  for line in note_lines:
    print(f"- {line}")
  payload = {"benchmark": "algorithms", "machine": machine(), "quick": args.quick,
             "task": args.task, "rollout": args.rollout,
             "size": size, "seeds": seeds, "target": args.target,
             "target_metric": args.target_metric, "runs": results,
             "table": table, "long_generation": long_rows, "notes": note_lines,
             "article": ARTICLE}
  write_json(args.json, payload)
  return payload


if __name__ == "__main__":
  main()
