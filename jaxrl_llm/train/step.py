r"""Pure PPO / GRPO train steps: ``train_step(state, batch) -> (state, metrics)``.

Token alignment. Per-token batch arrays have the shape of ``tokens`` ``[B, L]`` and
entry ``t`` is about *generating token t* from the prefix ``tokens[:, :t]``: the model
output at position ``t - 1`` gives ``logp[:, t]`` and ``values[:, t]``; column 0 is
never trainable. ``loss_mask`` is 1 on trainable response tokens.

Batch keys:

==================  ==========  =====================================================
key                 shape       meaning
==================  ==========  =====================================================
``tokens``          [B, L] int  prompt + response
``attention_mask``  [B, L]      1 on real tokens (padding anywhere)
``loss_mask``       [B, L]      1 on trainable response tokens
``old_logp``        [B, L]      behaviour log-probs (sampler or pre-update forward)
``advantages``      [B, L]/[B]  optional; per-token or per-sequence
``rewards``         [B, L]      token rewards (needed when ``advantages`` is absent)
``old_values``      [B, L]      critic values at rollout (PPO with a value head)
``returns``         [B, L]      optional value targets (computed by GAE if absent)
``ref_logp``        [B, L]      reference-model log-probs (``kl_mode`` loss/reward)
``positions``       [B, L] int  optional; default ``cumsum(attention_mask) - 1``
``rollout_logp``    [B, L]      the sampler's log-probs (``rollout_correction``)
``positive``        [B]/[B, L]  1 for correct responses (``pos_nll_coef``)
``segment_ids``     [B, L] int  optional; packed rows (0 = padding), see below
==================  ==========  =====================================================

Packed batches. With ``segment_ids`` (:func:`jaxrl_llm.packing.pack_batch` builds
them from a padded batch) a row holds several sequences: the model attends within a
segment only, ``positions`` default to each segment's own
(:func:`jaxrl_llm.packing.segment_positions`), log-probs, entropies and values never
read across a boundary (the first token of a segment gets 0, like column 0), GAE
restarts at each segment, and the ``seq-*`` aggregation modes, GSPO/GMPO's sequence
ratios, sequence-level rollout correction and the rollout KL of the adaptive KL
controller reduce per segment. Per-sequence inputs (``advantages``, ``positive``) come
per token (``[B, L]``). The update then equals the padded batch's (float rounding; with
``seq-mean-token-sum-norm`` set ``norm_length``, whose default is the width).

One step runs ``num_epochs`` x ``num_minibatches`` optimizer updates as nested
``lax.scan`` (a fresh permutation per epoch); each update accumulates gradients over
``num_microbatches`` with the exact minibatch-wide reduction: every loss term's
denominator (:func:`jaxrl_llm.aggregate_parts`) is computed over the whole minibatch
first, so microbatching changes nothing but rounding.

Fault handling, the same for every policy loss and estimator:

* An update is skipped (parameters and optimizer state unchanged) and counted in
  ``metrics["skipped"]`` when anything it reads or produces is not finite: a batch
  value at a trainable token (``old_logp``, ``ref_logp``, ``old_values``, the
  advantages and returns), the loss, the gradients, the optimizer's updates, the new
  parameters or the new optimizer state (so a poisoned optimizer state never reaches
  the parameters). Values at positions outside ``loss_mask`` are never read.
* An update over a minibatch with no trainable token is an exact no-op (counted in
  ``metrics["skipped_empty"]``): Adam's momentum does not move the parameters and its
  count does not advance.
* The step's metrics, which the adaptive clip controller reads, average the applied
  updates only. When no update of a step was applied, the controllers (adaptive KL /
  clip) and the shuffling key are left as they were: only ``step`` advances.

The model is any pure ``apply_fn(params, tokens, positions, attention_mask)``
returning a :class:`ModelOutput`: ``logits [B,L,V]`` or ``hidden [B,L,D]`` with
``lm_head [D,V]``, and ``values [B,L]`` or None. With hidden states the log-probs
are computed chunk by chunk (:func:`jaxrl_llm.token_logprobs_from_hidden`) without
ever forming ``[B, L, V]``. The plain tuples ``(logits, values)`` and ``(hidden,
values, lm_head)`` are read as the same (:func:`as_model_output`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import _validate as v
from jaxrl_llm import losses as L
from jaxrl_llm.control import adaptive_clip_update, adaptive_kl_update
from jaxrl_llm.logprobs import token_logprobs, token_logprobs_from_hidden
from jaxrl_llm.masked import explained_variance
from jaxrl_llm.packing import segment_positions, segment_starts, segment_sum
from jaxrl_llm.train.config import GRPO_DEFAULTS, TrainConfig
from jaxrl_llm.train.registry import (
  AdvantageInputs,
  compute_advantages,
  get_advantage_estimator,
  get_policy_loss,
)
from jaxrl_llm.train.train_state import (
  TrainState,
  init_train_state,
  merge_trainable,
  split_trainable,
)

TOKEN_KEYS = ("attention_mask", "loss_mask", "old_logp", "rewards", "old_values",
              "returns", "ref_logp", "positions", "rollout_logp", "segment_ids")


# ------------------------------------------------------------------------------ batch


def validate_batch(batch: dict, config: TrainConfig) -> None:
  """Raises ``ValueError`` naming the key for a missing, mis-shaped or mistyped entry.

  Shape/dtype checks only: safe before and during tracing.
  """
  if not isinstance(batch, dict):
    raise ValueError(f"`batch` must be a dict of arrays, got {type(batch).__name__}.")
  required = ["tokens", "attention_mask", "loss_mask"] + (
      [] if config.old_logp_from_step else ["old_logp"])
  if "advantages" not in batch:
    required.append("rewards")
  if config.use_value:
    required.append("old_values")
  if config.kl_mode != "none":
    required.append("ref_logp")
  if config.rollout_correction is not None:
    required.append("rollout_logp")
  if config.pos_nll_coef is not None:
    required.append("positive")
  missing = [k for k in required if k not in batch]
  if missing:
    raise ValueError(f"batch is missing key(s) {missing} (has {sorted(batch)}).")
  if config.kl_mode == "reward" and "advantages" in batch:
    raise ValueError("config.kl_mode='reward' with batch['advantages'] given: the step puts "
                     "the KL in the rewards only when it computes the advantages itself. "
                     "Fold the reward KL into the rewards/scores before computing the "
                     "advantages, or use kl_mode='loss'.")
  tokens = batch["tokens"]
  if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"batch['tokens'] must be an int [B, L] array, got shape "
                     f"{v.shape_of(tokens)} dtype {jnp.result_type(tokens)}.")
  shape = v.shape_of(tokens)
  for key in TOKEN_KEYS:
    if key in batch and v.shape_of(batch[key]) != shape:
      raise ValueError(f"batch['{key}'] must have the shape of batch['tokens'] {shape}, "
                       f"got {v.shape_of(batch[key])}.")
  for key in ("old_logp", "rewards", "old_values", "returns", "ref_logp", "advantages",
              "rollout_logp", "positive"):
    if key in batch and not jnp.issubdtype(jnp.result_type(batch[key]), jnp.floating):
      raise ValueError(f"batch['{key}'] must be floating point, got dtype "
                       f"{jnp.result_type(batch[key])}.")
  if "advantages" in batch and v.shape_of(batch["advantages"]) not in (shape, shape[:1]):
    raise ValueError(f"batch['advantages'] must have shape {shape} or {shape[:1]}, got "
                     f"{v.shape_of(batch['advantages'])}.")
  if "positive" in batch and v.shape_of(batch["positive"]) not in (shape[:1], shape):
    raise ValueError(f"batch['positive'] must have shape {shape[:1]} or {shape}, got "
                     f"{v.shape_of(batch['positive'])}.")
  if "segment_ids" in batch:
    if not jnp.issubdtype(jnp.result_type(batch["segment_ids"]), jnp.integer):
      raise ValueError(f"batch['segment_ids'] must be an int array, got dtype "
                       f"{jnp.result_type(batch['segment_ids'])}.")
    for key in ("advantages", "positive"):
      if key in batch and jnp.ndim(batch[key]) == 1:
        raise ValueError(f"batch['{key}'] has shape {v.shape_of(batch[key])}, one value "
                         f"per row, but a packed row (batch['segment_ids']) holds several "
                         f"sequences: give it per token {shape} "
                         f"(jaxrl_llm.packing.pack_batch broadcasts it).")
  if not config.use_value and "advantages" not in batch:
    raise ValueError("batch['advantages'] is required without a value model "
                     "(use_value=False): compute them with a group estimator.")
  b = shape[0]
  if config.max_tokens_per_microbatch is not None:
    if b % config.num_minibatches:
      raise ValueError(f"batch size {b} (batch['tokens'] {shape}) is not divisible by "
                       f"num_minibatches = {config.num_minibatches}.")
    microbatch_count(b // config.num_minibatches, shape[1], config)   # raises if unfit
    return
  per_update = config.num_minibatches * config.num_microbatches
  if b % per_update:
    raise ValueError(f"batch size {b} (batch['tokens'] {shape}) is not divisible by "
                     f"num_minibatches * num_microbatches = {per_update}.")


def microbatch_count(rows: int, width: int, config: TrainConfig) -> int:
  """Gradient-accumulation chunks of a minibatch of ``rows`` rows of ``width`` tokens.

  ``config.num_microbatches``, or with ``config.max_tokens_per_microbatch`` the fewest
  chunks of whole rows of at most that many token slots: chunks of ``r`` rows, ``r``
  the largest divisor of ``rows`` with ``r * width <= max_tokens_per_microbatch``.

  Examples:
    >>> microbatch_count(8, 100, TrainConfig(max_tokens_per_microbatch=300))
    4
  """
  budget = config.max_tokens_per_microbatch
  if budget is None:
    return config.num_microbatches
  if width > budget:
    raise ValueError(f"config.max_tokens_per_microbatch={budget} is smaller than one row "
                     f"of {width} tokens (batch['tokens'] width): a row is never split.")
  per = max(r for r in range(1, min(rows, budget // width) + 1) if rows % r == 0)
  return rows // per


def _same_segment_as_previous(segment_ids):
  """``[B, L-1]`` bool: token t+1 continues the segment of token t."""
  return segment_ids[:, 1:] == segment_ids[:, :-1]


def default_positions(attention_mask: jax.Array) -> jax.Array:
  """Positions that skip padding: ``max(cumsum(mask) - 1, 0)``."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)


def _shift_right(x):
  """Aligns model outputs at position t-1 with token t; column 0 becomes 0."""
  return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


class ModelOutput(NamedTuple):
  """What a model's ``apply_fn`` returns (the train step's model protocol).

  Attributes:
    logits: next-token logits ``[B, L, V]`` (or None when ``hidden`` is given).
    values: value-head outputs ``[B, L]``, or None without a value head.
    hidden: final hidden states ``[B, L, D]`` (with ``lm_head``), or None.
    lm_head: the ``[D, V]`` projection applied to ``hidden``, or None.
  """
  logits: Any = None
  values: Any = None
  hidden: Any = None
  lm_head: Any = None


def as_model_output(out: Any) -> ModelOutput:
  """Reads an ``apply_fn`` result: a :class:`ModelOutput` or one of the tuple forms.

  Examples:
    >>> import jax.numpy as jnp
    >>> as_model_output((jnp.zeros((1, 2, 3)), None)).logits.shape
    (1, 2, 3)
    >>> as_model_output((jnp.zeros((1, 2, 4)), None, jnp.zeros((4, 3)))).lm_head.shape
    (4, 3)
  """
  if isinstance(out, ModelOutput):
    result = out
  elif isinstance(out, tuple) and len(out) == 2:
    result = ModelOutput(logits=out[0], values=out[1])
  elif isinstance(out, tuple) and len(out) == 3:
    result = ModelOutput(hidden=out[0], values=out[1], lm_head=out[2])
  else:
    raise ValueError("apply_fn must return a ModelOutput, (logits, values) or (hidden, "
                     f"values, lm_head); got {type(out).__name__}.")
  if (result.logits is None) == (result.hidden is None) or (
      (result.hidden is None) != (result.lm_head is None)):
    raise ValueError("apply_fn's ModelOutput needs either `logits` or `hidden` with "
                     "`lm_head`.")
  return result


def check_logprob_start(logprob_start: int | None, width: int) -> None:
  """Raises ``ValueError`` unless ``logprob_start`` is None or an int in ``[1, width)``.

  Examples:
    >>> check_logprob_start(3, 8)
    >>> check_logprob_start(8, 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `logprob_start` must be None or an int with 1 <= logprob_start < L = 8 ...
  """
  if logprob_start is None:
    return
  if (isinstance(logprob_start, bool) or not isinstance(logprob_start, int)
      or not 1 <= logprob_start < width):
    raise ValueError(f"`logprob_start` must be None or an int with 1 <= logprob_start < "
                     f"L = {width} (the width of batch['tokens']), got {logprob_start!r}.")


def policy_forward(apply_fn: Callable, params: Any, batch: dict, *,
                   chunk_size: int | None = None,
                   temperature: Any = TrainConfig.temperature,
                   logprob_start: int | None = TrainConfig.logprob_start
                   ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Token log-probs, entropies and values of ``batch['tokens']`` under ``params``.

  Returns ``(logp, entropy, values)``, each ``[B, L]`` aligned with the tokens (entry t
  is about generating token t; column 0 is 0); ``values`` is None without a value head.
  Use it for old / reference log-probs as well as inside the loss.

  ``logprob_start``: a static column ``s`` (``1 <= s < L``, else ``ValueError``) from
  which on the log-probs and entropies are wanted, e.g. the first response column of
  prompts left-padded to a fixed width. The LM head then runs on the hidden states
  ``s - 1 .. L - 2`` only (forward and backward), and ``logp`` / ``entropy`` are 0 in
  columns ``< s``; columns ``>= s`` equal the full computation's (float rounding).
  Whatever reads the outputs must read nothing before ``s`` (in the train step:
  ``loss_mask`` is 0 there). ``values`` are computed at every position as without it.
  Ignored for packed rows (``segment_ids``), whose sequences start anywhere. None: all.
  """
  missing = [k for k in ("tokens", "attention_mask") if k not in batch]
  if missing:
    raise ValueError(f"`batch` is missing key(s) {missing} (has {sorted(batch)}).")
  tokens, attn = batch["tokens"], batch["attention_mask"]
  check_logprob_start(logprob_start, v.shape_of(tokens)[-1])
  positions = batch.get("positions")
  seg = batch.get("segment_ids")
  if positions is None:
    positions = default_positions(attn) if seg is None else segment_positions(seg)
  if seg is None:
    out = as_model_output(apply_fn(params, tokens, positions, attn))
  else:
    out = as_model_output(apply_fn(params, tokens, positions, attn, segment_ids=seg))
  # Outputs at positions start - 1 .. L - 2 predict tokens start .. L - 1.
  start = 1 if logprob_start is None or seg is not None else logprob_start
  targets = tokens[:, start:]
  target_mask = attn[:, start:]
  if seg is not None:   # a segment's last output never predicts the next segment
    target_mask = jnp.where(_same_segment_as_previous(seg), target_mask, 0)
  values = out.values
  if out.hidden is not None:
    logp, ent = token_logprobs_from_hidden(
        out.hidden[:, start - 1:-1], out.lm_head, targets, mask=target_mask,
        chunk_size=chunk_size, return_entropy=True, temperature=temperature)
  else:
    logp, ent = token_logprobs(out.logits[:, start - 1:-1] / temperature, targets,
                               target_mask, return_entropy=True)
  pad = lambda x: jnp.concatenate([jnp.zeros((x.shape[0], start), x.dtype), x], axis=1)
  values = None if values is None else _shift_right(v.as_f32(values))
  if values is not None and seg is not None:
    values = jnp.where(segment_starts(seg), 0.0, values)
  return pad(logp), pad(ent), values


def _psum(x, axis_name):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def _global_mean(x, mask, axis_name=None):
  """Masked mean over all devices of ``axis_name`` (:func:`masked_mean` without one)."""
  m = v.as_f32(mask)
  total = _psum(jnp.sum(jnp.where(m > 0, v.as_f32(x), 0.0)), axis_name)
  return total / jnp.maximum(_psum(jnp.sum(m), axis_name), 1.0)


def _global_moments(x, mask, axis_name=None):
  """``(count, mean, biased variance)`` of the valid entries, over all devices."""
  count = _psum(jnp.sum(v.as_f32(mask)), axis_name)
  mean = _global_mean(x, mask, axis_name)
  return count, mean, _global_mean(jnp.square(v.as_f32(x) - mean), mask, axis_name)


def _global_explained_variance(y_pred, y_true, mask, axis_name=None):
  """:func:`explained_variance` over the valid entries of all devices (the whole-batch
  statistic, not a mean of per-device ones)."""
  if axis_name is None:
    return explained_variance(y_pred, y_true, mask)
  var_y = _global_moments(y_true, mask, axis_name)[2]
  var_res = _global_moments(v.as_f32(y_true) - v.as_f32(y_pred), mask, axis_name)[2]
  return jnp.where(var_y > 0, 1.0 - var_res / jnp.where(var_y > 0, var_y, 1.0), 0.0)


def _global_row_mean(x, mask, axis_name=None, segment_ids=None):
  r"""Mean of the rows' masked means over the non-empty rows of all devices.

  .. math::

     \frac{1}{|\{i : n_i > 0\}|} \sum_{i : n_i > 0} \frac{1}{n_i} \sum_t m_{it} x_{it},
     \qquad n_i = \sum_t m_{it}

  verl's ``current_kl`` in ``apply_kl_penalty`` (``masked_mean(kld, mask, axis=-1)``,
  then the batch mean): every response weighs the same, whatever its length. With
  ``segment_ids`` the rows are the segments (sequences) of packed rows.
  """
  m = v.as_f32(mask)
  if segment_ids is not None:
    inv = jnp.where(m > 0, 1.0 / jnp.maximum(segment_sum(m, segment_ids), 1.0), 0.0)
    total = jnp.sum(jnp.where(m > 0, v.as_f32(x), 0.0) * inv)
    total, n_seq = _psum((total, jnp.sum(inv)), axis_name)
    return total / jnp.maximum(n_seq, 1.0)
  count = jnp.sum(m, axis=-1)
  rows = jnp.sum(jnp.where(m > 0, v.as_f32(x), 0.0), axis=-1) / jnp.maximum(count, 1.0)
  total, n_rows = _psum((jnp.sum(rows), jnp.sum(v.as_f32(count > 0))), axis_name)
  return total / jnp.maximum(n_rows, 1.0)


def _whiten(x, mask, moments, eps=1e-8):
  """:func:`masked_whiten` (ddof=1) given :func:`_global_moments` of ``x``."""
  count, mean, var = moments
  var = jnp.where(count > 1, var * count / jnp.maximum(count - 1.0, 1.0), 0.0)
  return jnp.where(v.as_f32(mask) > 0, (v.as_f32(x) - mean) * jax.lax.rsqrt(var + eps),
                   0.0)


def prepare_batch(batch: dict, state: TrainState, config: TrainConfig,
                  axis_name: str | None = None) -> dict:
  """Fills in ``advantages`` / ``returns`` (GAE, KL-in-reward, whitening).

  * ``kl_mode="reward"``: ``rewards - kl_coef * kl(old_logp, ref_logp)`` per token
    (so the batch must not carry ``advantages``: :func:`validate_batch` raises).
  * No ``advantages``: GAE (or the hybrid n-step/GAE estimator) over ``rewards`` and
    ``old_values`` with ``gamma``/``lam`` from ``state.hparams``;
    ``returns = advantages + old_values`` unless given.
  * ``whiten_advantages``: :func:`jaxrl_llm.masked_whiten` over the batch's mask
    (per-sequence advantages are broadcast over the mask first), with statistics
    over all devices of ``axis_name``.

  The advantage variance before whitening is kept as ``batch["adv_raw_var"]`` (a
  scalar, for comparing estimators).
  """
  batch = dict(batch)
  mask = v.as_f32(batch["loss_mask"])
  hp = state.hparams
  kl_coef = _kl_coef(state, config)
  if "advantages" not in batch:
    rewards = v.as_f32(batch["rewards"])
    if config.kl_mode == "reward":
      kl = L.kl_penalty(batch["old_logp"], batch["ref_logp"], config.reward_kl_kind,
                        mask=mask)
      rewards = rewards - kl_coef * kl
    # The static fields the estimator declares it reads (e.g. hybrid_n).
    spec = get_advantage_estimator(config.advantage_estimator)
    adv, ret = compute_advantages(
        config.advantage_estimator,
        AdvantageInputs(rewards=rewards, values=batch["old_values"], mask=mask,
                        segment_ids=batch.get("segment_ids")), hp,
        **{k: getattr(config, k) for k in spec.static})
    batch["advantages"] = adv
    batch.setdefault("returns", ret)
  adv = v.as_f32(batch["advantages"])
  if adv.ndim == 1:
    adv = adv[:, None] * mask
  if config.use_value and "returns" not in batch:
    # value targets come from the raw advantages, never the whitened ones
    batch["returns"] = (adv + v.as_f32(batch["old_values"])) * mask
  moments = _global_moments(adv, mask, axis_name)
  batch["adv_raw_var"] = moments[2]
  if config.whiten_advantages:
    adv = _whiten(adv, mask, moments)
  batch["advantages"] = adv * mask
  return batch


# ----------------------------------------------------------------------------- losses


def _kl_coef(state, config):
  return state.kl_ctrl.coef if config.adaptive_kl else state.hparams["kl_coef"]


def check_hparams(state: TrainState, config: TrainConfig) -> None:
  """Raises ``ValueError`` unless ``state.hparams`` has exactly the config's keys.

  The step's structure (dual clip, clip-high, value clip, the policy loss's own
  hyperparameters) comes from its config; a state built from another config would
  otherwise silently switch terms on or off. Trace-time only (keys, not values).
  """
  have, want = set(state.hparams), set(config.hparam_names())
  if have != want:
    raise ValueError(
        f"state.hparams does not match the step's TrainConfig: missing {sorted(want - have)}"
        f", unexpected {sorted(have - want)}. Build the state with the step's config "
        f"(step.init(params) or init_train_state(params, optimizer, config)).")


def _clip_range(state, config):
  """(eps_low, eps_high) for this step: schedule, adaptive controller or fixed."""
  hp = state.hparams
  if config.clip_schedule is not None:
    low = v.as_f32(config.clip_schedule(state.step))
  elif config.adaptive_clip:
    low = state.clip_ctrl.eps
  else:
    low = hp["clip_low"]
  if config.clip_range()[1] is not None:
    return low, low * hp["clip_high"] / hp["clip_low"]
  return low, low


def _policy_loss(config, logp, mb, eps_low, eps_high, hp):
  """The registered policy loss of ``config``, fed its traced hyperparameters."""
  spec = get_policy_loss(config.policy_loss)
  kwargs = dict(spec.static)
  if spec.uses_clip:
    kwargs.update(clip_low=eps_low, clip_high=eps_high)
  if config.dual_clip is not None:
    kwargs["dual_clip"] = hp["dual_clip"]
  names = config.hparam_names()
  kwargs.update({k: hp[k] for k in spec.extra_hparams if k in names})
  if "segment_ids" in mb and "segment_ids" in inspect.signature(spec.fn).parameters:
    kwargs["segment_ids"] = mb["segment_ids"]   # a sequence-level loss: per segment
  return spec.fn(logp, mb["old_logp"], mb["advantages"], mb["loss_mask"], **kwargs)


def _denominators(mb, config, axis_name=None):
  """Loss denominators over a whole minibatch, summed over ``axis_name`` devices.

  They depend on the mask only, so they are known before any gradient is taken.
  """
  mask = mb["loss_mask"]
  zeros = jnp.zeros(mask.shape, jnp.float32)
  _, pg = L.aggregate_parts(zeros, mask, config.loss_agg_mode,
                            norm_length=config.norm_length,
                            segment_ids=mb.get("segment_ids"))
  tokens = jnp.sum(v.as_f32(mask))
  pg, tokens = _psum(pg, axis_name), _psum(tokens, axis_name)
  out = {"pg": jnp.maximum(pg, 1.0), "tokens": jnp.maximum(tokens, 1.0),
         "count": tokens}
  if config.pos_nll_coef is not None:
    pos = _positive_mask(mb)
    out["pos_tokens"] = jnp.maximum(_psum(jnp.sum(pos), axis_name), 1.0)
  return out


def _positive_mask(mb):
  """``loss_mask`` on the rows marked ``positive`` (correct responses), else 0."""
  positive = v.as_f32(mb["positive"])
  positive = (positive if positive.ndim == 2 else positive[:, None]) > 0
  return jnp.where(positive, v.as_f32(mb["loss_mask"]), 0.0)


def _loss_fn(params, mb, denoms, state, config, apply_fn, eps_low, eps_high):
  """Scalar loss of one microbatch, scaled by minibatch-wide denominators."""
  hp = state.hparams
  mask = v.as_f32(mb["loss_mask"])
  logp, ent, values = policy_forward(apply_fn, params, mb,
                                     chunk_size=config.logprob_chunk_size,
                                     temperature=hp["temperature"],
                                     logprob_start=config.logprob_start)
  seg = mb.get("segment_ids")
  agg = lambda x: L.aggregate_parts(x, mask, config.loss_agg_mode,
                                    norm_length=config.norm_length,
                                    segment_ids=seg)[0] / denoms["pg"]
  if config.old_logp_from_step:     # one update per batch: pi_old is pi, detached
    mb = {**mb, "old_logp": jax.lax.stop_gradient(logp)}
  pg_tok, pg_metrics = _policy_loss(config, logp, mb, eps_low, eps_high, hp)
  if config.rollout_correction is not None:
    lower = None if config.rollout_is_lower is None else hp["rollout_is_lower"]
    weights, is_metrics = L.rollout_correction_weights(
        v.as_f32(mb["old_logp"]) - v.as_f32(mb["rollout_logp"]), mask,
        level=config.rollout_correction, threshold=hp["rollout_is_threshold"],
        lower=lower, segment_ids=seg)
    pg_tok = pg_tok * weights
    # The ESS is a ratio of sums, not a token mean: the update rebuilds it from the
    # minibatch-wide token means of w and w^2 (:func:`_reduce_microbatches`).
    del is_metrics["rollout_is_ess"]
    is_metrics["rollout_is_sq"] = _global_mean(jnp.square(weights), mask)
    pg_metrics = {**pg_metrics, **is_metrics}
  pg_loss = agg(pg_tok)
  entropy = agg(ent)
  loss = pg_loss - hp["entropy_coef"] * entropy
  terms = {"pg_loss": pg_loss, "entropy": entropy}
  if config.use_value:
    if values is None:
      raise ValueError("config.use_value=True but apply_fn returned no values.")
    vf_clip = None if config.vf_clip is None else hp["vf_clip"]
    vf_tok, vf_metrics = L.value_loss(values, mb["old_values"], mb["returns"], mask,
                                      clip=vf_clip)
    vf_loss = jnp.sum(vf_tok * mask) / denoms["tokens"]
    loss = loss + hp["vf_coef"] * vf_loss
    terms["vf_loss"] = vf_loss
    pg_metrics = {**pg_metrics, **vf_metrics}
  if config.pos_nll_coef is not None:
    # VAPO's positive-example NLL: token mean over the correct responses' tokens.
    pos = _positive_mask(mb)
    pos_nll = -jnp.sum(jnp.where(pos > 0, logp, 0.0)) / denoms["pos_tokens"]
    loss = loss + hp["pos_nll_coef"] * pos_nll
    terms["pos_nll"] = pos_nll
  if config.kl_mode == "loss":
    kl = agg(L.kl_penalty(logp, mb["ref_logp"], config.kl_kind, mask=mask))
    loss = loss + _kl_coef(state, config) * kl
    terms["kl_loss"] = kl
  if "ref_logp" in mb:
    diff = jnp.where(mask > 0, jax.lax.stop_gradient(logp) - v.as_f32(mb["ref_logp"]),
                     0.0)
    terms["kl_ref"] = jnp.sum(diff) / denoms["tokens"]
  # Mean-type metrics are token means of this microbatch: re-weight them by its
  # share of the minibatch's tokens so that their sum over microbatches is exact.
  share = jnp.sum(mask) / denoms["tokens"]
  metrics = {k: val if k in _MAX_METRICS else val * share for k, val in pg_metrics.items()}
  metrics.update(terms)
  metrics["loss"] = loss
  return loss, metrics


# ------------------------------------------------------------------------------- step


# Metrics reduced by a max (over microbatches and devices) instead of a sum.
_MAX_METRICS = ("rollout_is_max",)


def _reduce_microbatches(metrics, axis_name=None):
  r"""A minibatch's metrics from its microbatches' ``[num_microbatches]``, over all devices.

  The sum (the mean-type metrics are already weighted by their microbatch's token
  share, the loss terms divided by minibatch-wide denominators), the max for
  :data:`_MAX_METRICS`. The rollout ESS is then formed from the exact token means of
  the weights and their squares:
  :math:`(\sum w)^2 / (N \sum w^2) = \bar w^2 / \overline{w^2}` (0 when every w is 0).
  """
  out = _psum({k: jnp.sum(x) for k, x in metrics.items() if k not in _MAX_METRICS},
              axis_name)
  maxes = {k: jnp.max(x) for k, x in metrics.items() if k in _MAX_METRICS}
  out.update(maxes if axis_name is None else jax.lax.pmax(maxes, axis_name))
  if "rollout_is_sq" in out:
    sq = out.pop("rollout_is_sq")
    out["rollout_is_ess"] = jnp.where(
        sq > 0, jnp.square(out["rollout_is_mean"]) / jnp.where(sq > 0, sq, 1.0), 0.0)
  return out


def _mean_over_applied(metrics):
  r"""The step's metrics from its updates' ``[num_epochs, num_minibatches]``.

  ``skipped`` and ``skipped_empty`` are counts. Every other metric is the mean over
  the applied updates, :math:`\sum_u a_u m_u / \max(\sum_u a_u, 1)` with :math:`a_u`
  the update's ``applied`` flag, so a skipped update's NaN or an empty one's zeros
  never reach the reported values or the controllers; with none applied, the mean over
  all updates. Returns ``(metrics, whether any update was applied)``.
  """
  metrics = dict(metrics)
  applied = metrics.pop("applied") > 0
  n_applied = jnp.sum(v.as_f32(applied))

  def mean(x):
    over_applied = jnp.sum(jnp.where(applied, x, 0.0)) / jnp.maximum(n_applied, 1.0)
    return jnp.where(n_applied > 0, over_applied, jnp.mean(x))

  out = {k: jnp.sum(x) if k in ("skipped", "skipped_empty") else mean(x)
         for k, x in metrics.items()}
  return out, n_applied > 0


def _split(x, n):
  """``[B, ...] -> [n, B / n, ...]``; part ``i`` holds rows ``i, i + n, i + 2n, ...``.

  Strided rather than contiguous: when the rows are sharded over devices (each
  holding a contiguous block, as ``jax.jit`` shardings lay them out), every part gets
  an equal share of every device's rows, so the split is a local reshape and each
  minibatch / microbatch stays sharded over all devices (no data movement).
  """
  return x.reshape((x.shape[0] // n, n) + x.shape[1:]).swapaxes(0, 1)


def _all_finite(tree):
  """Whether every value of the float leaves of ``tree`` is finite: one scalar.

  The finite leaves are counted (a sum over their stacked flags), not and-ed: XLA
  rewrites ``all`` over stacked scalars into a chain of scalar ``and`` ops, and as
  that chain is cheap it copies it into each fusion that reads the result, here every
  leaf's keep-or-skip select. The program then grows with the square of the number of
  leaves (3x the compile time of a PPO step with a separate critic); a sum stays one
  reduction, read by each select.
  """
  leaves = [x for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  flags = jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.asarray(True)])
  return jnp.sum(flags.astype(jnp.int32)) == flags.shape[0]


# Batch values the update reads at trainable tokens (after prepare_batch).
_CHECKED_KEYS = ("old_logp", "ref_logp", "old_values", "advantages", "returns")


def _nonfinite_inputs(mb, axis_name=None):
  """Number of non-finite batch values at trainable tokens, over all devices."""
  valid = v.as_f32(mb["loss_mask"]) > 0
  bad = jnp.zeros((), jnp.float32)
  for key in _CHECKED_KEYS:
    if key in mb:
      bad = bad + jnp.sum(jnp.where(valid, ~jnp.isfinite(v.as_f32(mb[key])), False))
  return _psum(bad, axis_name)


class TrainStep(Protocol):
  """What :func:`make_train_step` returns: the pure step, its config and its ``init``."""
  config: TrainConfig

  def __call__(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]: ...

  def init(self, params: Any, rng: jax.Array | None = None) -> TrainState: ...


def make_train_step(apply_fn: Callable, optimizer: optax.GradientTransformation,
                    config: TrainConfig, *, axis_name: str | None = None,
                    trainable: Callable[[Any], Any] | None = None) -> TrainStep:
  """Returns a pure ``train_step(state, batch) -> (state, metrics)``; jit it yourself.

  The step and its state come from one config: ``train_step.init(params, rng=None)``
  builds the matching :class:`TrainState` (:func:`init_train_state` with the same
  optimizer and config). A state whose ``hparams`` keys differ from the config's
  raises ``ValueError`` at trace time (see :func:`check_hparams`); hyperparameter
  *values* stay traced, so changing them never recompiles.

  ``axis_name``: set it when the step runs per device under ``jax.pmap`` or
  ``shard_map`` with the batch split over that axis. Loss denominators, gradients,
  metrics and the advantage-whitening statistics are then ``psum``-reduced over it,
  so every device applies the same update as one device on the whole batch would
  (minibatch shuffling is per device). Not needed with ``jax.jit`` shardings, where
  the step is written for the global batch.

  ``trainable``: ``params -> pytree of bools`` (a prefix of ``params``) marking what
  is trained (e.g. :func:`jaxrl_llm.models.lora.lora_trainable`: LoRA adapters and the
  value head); gradients, the optimizer and its state then see only those parameters,
  and the others pass through the step untouched (bit-identical). None: all.

  ``jax.jit(step, donate_argnums=0)`` is the usual wrapping. Metrics (float32 scalars)
  are averaged over the applied ones of the ``num_epochs * num_minibatches`` updates
  (over all of them when none was applied): ``loss``, ``pg_loss``, ``entropy``,
  ``pg_clipfrac``, ``pg_clipfrac_lower``, ``approx_kl``, ``grad_norm``, (``vf_loss``,
  ``vf_clipfrac``, ``explained_variance``), (``kl_loss``, ``kl_ref``), ``adv_mean``,
  ``adv_std``, ``clip_eps``, ``kl_coef``, (``rollout_kl``), (``pos_nll``),
  (``rollout_is_mean``, ``rollout_is_max``, ``rollout_is_clipfrac``, ``rollout_is_ess``,
  ``rollout_mismatch_kl``,
  each over its update's whole minibatch); ``skipped`` (non-finite) and ``skipped_empty``
  (no trainable token) are counts of skipped updates.

  Examples:
    >>> import jax, numpy as np, optax
    >>> apply = lambda p, tokens, pos, attn: (p["w"][tokens], None)   # logits [B,L,V]
    >>> opt, config = optax.sgd(0.1), TrainConfig(use_value=False, whiten_advantages=False)
    >>> step = make_train_step(apply, opt, config)
    >>> state = step.init({"w": np.zeros((4, 4), np.float32)})
    >>> ones = np.ones((2, 3), np.float32)
    >>> batch = dict(tokens=np.ones((2, 3), np.int32), attention_mask=ones,
    ...              loss_mask=ones, old_logp=np.log(0.25) * ones,
    ...              advantages=np.array([1.0, -1.0], np.float32))
    >>> state, metrics = jax.jit(step)(state, batch)
    >>> int(state.step), float(metrics["skipped"])
    (1, 0.0)
  """

  def train_step(state: TrainState, batch: dict):
    check_hparams(state, config)
    validate_batch(batch, config)
    batch = prepare_batch(batch, state, config, axis_name)
    adv_raw_var = batch.pop("adv_raw_var")
    eps_low, eps_high = _clip_range(state, config)
    mask = batch["loss_mask"]
    # Only the trainable part is differentiated and updated; the frozen rest (e.g. a
    # LoRA base) is closed over and passed through.
    train_mask, train_params, frozen = split_trainable(state.params, trainable)
    grad_fn = jax.grad(
        lambda params, mb, denoms: _loss_fn(merge_trainable(train_mask, params, frozen),
                                            mb, denoms, state, config, apply_fn,
                                            eps_low, eps_high), has_aux=True)

    def update(carry, mb):
      """One optimizer update on a minibatch, gradients accumulated over microbatches."""
      params, opt_state = carry
      denoms = _denominators(mb, config, axis_name)
      n_micro = microbatch_count(mb["tokens"].shape[0], mb["tokens"].shape[1], config)
      micro = jax.tree_util.tree_map(lambda x: _split(x, n_micro), mb)

      def accumulate(acc, micro_batch):
        grads, metrics = grad_fn(params, micro_batch, denoms)
        return jax.tree_util.tree_map(jnp.add, acc, grads), metrics

      first = jax.tree_util.tree_map(lambda x: x[0], micro)
      zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                    jax.eval_shape(grad_fn, params, first, denoms)[0])
      grads, metrics = jax.lax.scan(accumulate, zero, micro)
      grads, metrics = _psum(grads, axis_name), _reduce_microbatches(metrics, axis_name)

      updates, new_opt_state = optimizer.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      if config.skip_nonfinite:
        finite = ((_nonfinite_inputs(mb, axis_name) == 0)
                  & _all_finite((grads, metrics["loss"], updates, new_params,
                                 new_opt_state)))
      else:
        finite = jnp.asarray(True)
      nonempty = denoms["count"] > 0
      ok = finite & nonempty
      keep = lambda new, old: jax.tree_util.tree_map(
          lambda a, b: jnp.where(ok, a, b), new, old)
      metrics["grad_norm"] = optax.tree.norm(grads)
      metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
      metrics["skipped_empty"] = 1.0 - nonempty.astype(jnp.float32)
      metrics["applied"] = ok.astype(jnp.float32)
      return (keep(new_params, params), keep(new_opt_state, opt_state)), metrics

    n = config.num_minibatches
    rng, epoch_rng = jax.random.split(state.rng)
    keys = jax.random.split(epoch_rng, config.num_epochs)

    def epoch(carry, key):
      size = batch["tokens"].shape[0]
      if n > 1:
        perm = jax.random.permutation(key, size)
        shuffled = jax.tree_util.tree_map(lambda x: _split(x[perm], n), batch)
      else:  # one minibatch: no shuffle, and no gather of a sharded batch
        shuffled = jax.tree_util.tree_map(lambda x: x[None], batch)
      return jax.lax.scan(update, carry, shuffled)

    carry = (train_params, state.opt_state)
    (params, opt_state), metrics = jax.lax.scan(epoch, carry, keys)
    params = merge_trainable(train_mask, params, frozen)
    metrics, applied = _mean_over_applied(metrics)   # applied: any update of the step
    _, metrics["adv_mean"], adv_var = _global_moments(batch["advantages"], mask,
                                                      axis_name)
    metrics["adv_std"] = jnp.sqrt(adv_var)
    metrics["adv_raw_var"] = adv_raw_var
    metrics["clip_eps"] = eps_low
    kl_coef = _kl_coef(state, config)
    metrics["kl_coef"] = kl_coef
    if config.use_value:
      metrics["explained_variance"] = _global_explained_variance(
          batch["old_values"], batch["returns"], mask, axis_name)

    kl_ctrl, clip_ctrl = state.kl_ctrl, state.clip_ctrl
    if config.adaptive_kl:
      # verl: the KL of the behaviour policy to the reference, measured at rollout, as
      # the batch mean of the per-response token means.
      rollout_kl = _global_row_mean(L.kl_penalty(batch["old_logp"], batch["ref_logp"],
                                                 config.reward_kl_kind, mask=mask),
                                    mask, axis_name, batch.get("segment_ids"))
      metrics["rollout_kl"] = rollout_kl
      # verl's n_steps is the number of sequences of the whole (global) batch.
      seg = batch.get("segment_ids")
      n_seq = (jnp.asarray(mask.shape[0], jnp.float32) if seg is None
               else jnp.sum(v.as_f32(segment_starts(seg) & (seg > 0))))
      n_seq = _psum(n_seq, axis_name)
      kl_ctrl = adaptive_kl_update(kl_ctrl, rollout_kl, n_seq)
    if config.adaptive_clip:
      observed = metrics["approx_kl" if config.adaptive_clip_metric == "kl"
                         else "pg_clipfrac"]
      clip_ctrl = adaptive_clip_update(clip_ctrl, observed)
    # A step that applied no update (all skipped or empty) moves nothing but `step`.
    unless_idle = lambda new, old: jax.tree_util.tree_map(
        lambda a, b: jnp.where(applied, a, b), new, old)
    kl_ctrl, clip_ctrl, rng = unless_idle((kl_ctrl, clip_ctrl, rng),
                                          (state.kl_ctrl, state.clip_ctrl, state.rng))
    new_state = dataclasses.replace(state, params=params, opt_state=opt_state,
                                    step=state.step + 1, kl_ctrl=kl_ctrl,
                                    clip_ctrl=clip_ctrl, rng=rng)
    return new_state, metrics

  def init(params: Any, rng: jax.Array | None = None) -> TrainState:
    """The :class:`TrainState` of this step (same optimizer and config)."""
    return init_train_state(params, optimizer, config, rng=rng, trainable=trainable)

  step = cast(TrainStep, train_step)
  step.init = init  # type: ignore[method-assign]
  step.config = config
  return step


def _with_overrides(config: TrainConfig | None, defaults: dict,
                    overrides: dict) -> TrainConfig:
  """``config`` (or ``TrainConfig(**defaults)``) with ``overrides`` applied on top."""
  if config is None:
    return TrainConfig(**{**defaults, **overrides})
  unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)})
  if unknown:
    raise ValueError(f"unknown TrainConfig field(s) {unknown}.")
  return dataclasses.replace(config, **overrides) if overrides else config


def make_ppo_train_step(apply_fn: Callable, optimizer: optax.GradientTransformation,
                        config: TrainConfig | None = None,
                        **overrides: Any) -> TrainStep:
  """PPO with a value head (GAE from ``rewards``/``old_values`` or given advantages).

  Defaults: clipped surrogate (``clip_low=0.2``), clipped value loss (0.5, coef 0.5),
  token-mean aggregation, whitened advantages. ``overrides`` are TrainConfig fields,
  applied on top of ``config`` when one is given.
  """
  return make_train_step(apply_fn, optimizer, _with_overrides(config, {}, overrides))


def make_grpo_train_step(apply_fn: Callable, optimizer: optax.GradientTransformation,
                         config: TrainConfig | None = None,
                         **overrides: Any) -> TrainStep:
  """GRPO-family step: no value model, per-sequence advantages from a group estimator,
  KL to the reference in the loss (k3) when ``kl_coef > 0``.

  Defaults: ``use_value=False, whiten_advantages=False, kl_mode="loss",
  kl_kind="k3", loss_agg_mode="token-mean"`` (DAPO / TRL default); Dr.GRPO is
  ``loss_agg_mode="seq-mean-token-sum-norm"`` with :func:`jaxrl_llm.dr_grpo_advantages`.
  ``overrides`` are TrainConfig fields, applied on top of ``config`` when given
  (the GRPO defaults above apply only without a ``config``).
  """
  return make_train_step(apply_fn, optimizer,
                         _with_overrides(config, GRPO_DEFAULTS, overrides))
