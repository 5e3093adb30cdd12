"""The train state pytree and the train-step configuration."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import _validate as v
from jaxrl_llm.control import (AdaptiveClipState, AdaptiveKLState, adaptive_clip_init,
                               adaptive_kl_init)
from jaxrl_llm.losses import AGGREGATION_MODES

POLICY_LOSSES = ("ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce")
KL_MODES = ("none", "loss", "reward")
KL_KINDS = ("k1", "k2", "k3", "abs", "k1+", "k3+")

# Float fields of TrainConfig that live in TrainState.hparams as traced scalars.
TRACED_HPARAMS = ("clip_low", "clip_high", "dual_clip", "vf_coef", "vf_clip",
                  "entropy_coef", "kl_coef", "gamma", "lam", "hybrid_mix", "temperature")
ADVANTAGE_ESTIMATORS = ("gae", "hybrid")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Configuration of a train step.

  Static fields (ints, strings, bools, callables) shape the compiled program; changing
  them builds a new step. Float fields listed in ``TRACED_HPARAMS`` are copied into
  ``TrainState.hparams`` by :func:`init_train_state` and read from there by the step,
  so editing ``state.hparams`` (a sweep, a hand-written schedule) never recompiles.
  A float field set to ``None`` switches its term off statically (``clip_high=None``:
  symmetric clip; ``dual_clip=None``: no dual clip; ``vf_clip=None``: unclipped value
  loss).

  Clip epsilon: ``clip_schedule`` (an optax schedule, e.g.
  ``optax.linear_schedule(0.2, 0.05, n)`` for the "0.2 early, 0.05 late" dynamic
  clipping) or ``adaptive_clip=True`` (:func:`jaxrl_llm.adaptive_clip_update` after
  every step) replace ``clip_low``; ``clip_high`` then keeps its ratio to ``clip_low``.
  ``policy_loss="cispo"`` uses verl's form: the stop-gradient importance weight is
  clipped to ``[1 - clip_low, 1 + clip_high]``.

  Advantages computed in the step (when the batch has none) are ``gae`` or
  ``hybrid``: :func:`jaxrl_llm.hybrid_advantages` with ``hybrid_n`` (static) and
  ``hybrid_mix`` (traced), the "n-step returns combined with GAE" estimator.

  ``adaptive_kl=True`` updates the KL coefficient after each step from the rollout KL
  (``old_logp`` vs ``ref_logp``, ``reward_kl_kind``), with ``kl_target``/``kl_horizon``.
  """
  # --- static structure
  num_epochs: int = 1
  num_minibatches: int = 1
  num_microbatches: int = 1
  policy_loss: str = "ppo"
  loss_agg_mode: str = "token-mean"
  norm_length: Optional[int] = None
  use_value: bool = True
  whiten_advantages: bool = True
  gae_method: str = "scan"
  advantage_estimator: str = "gae"
  hybrid_n: int = 4
  kl_mode: str = "none"
  kl_kind: str = "k3"
  reward_kl_kind: str = "k1"
  adaptive_kl: bool = False
  kl_target: float = 0.1
  kl_horizon: float = 10000.0
  clip_schedule: Optional[Callable[[Any], Any]] = None
  adaptive_clip: bool = False
  adaptive_clip_target: Optional[float] = None
  adaptive_clip_metric: str = "kl"
  clip_min: float = 0.05
  clip_max: float = 0.3
  logprob_chunk_size: Optional[int] = None
  skip_nonfinite: bool = True
  # --- traced hyperparameters (see TRACED_HPARAMS)
  clip_low: float = 0.2
  clip_high: Optional[float] = None
  dual_clip: Optional[float] = None
  vf_coef: float = 0.5
  vf_clip: Optional[float] = 0.5
  entropy_coef: float = 0.0
  kl_coef: float = 0.0
  gamma: float = 1.0
  lam: float = 0.95
  hybrid_mix: float = 0.5
  temperature: float = 1.0

  def __post_init__(self):
    for name in ("num_epochs", "num_minibatches", "num_microbatches"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {val!r}.")
    v.check_choice("policy_loss", self.policy_loss, POLICY_LOSSES)
    v.check_choice("loss_agg_mode", self.loss_agg_mode, AGGREGATION_MODES)
    v.check_choice("kl_mode", self.kl_mode, KL_MODES)
    v.check_choice("kl_kind", self.kl_kind, KL_KINDS)
    v.check_choice("reward_kl_kind", self.reward_kl_kind, KL_KINDS)
    v.check_choice("gae_method", self.gae_method, ("scan", "associative"))
    v.check_choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
    v.check_choice("adaptive_clip_metric", self.adaptive_clip_metric, ("kl", "clipfrac"))
    if self.clip_schedule is not None and self.adaptive_clip:
      raise ValueError("`clip_schedule` and `adaptive_clip` are exclusive: pick one.")
    if self.adaptive_kl and self.kl_mode == "none":
      raise ValueError("`adaptive_kl` needs `kl_mode` 'loss' or 'reward'.")
    if self.dual_clip is not None and not self.dual_clip > 1:
      raise ValueError(f"`dual_clip` must be > 1, got {self.dual_clip!r}.")

  def hparams(self) -> dict:
    """The traced hyperparameters as float32 scalars (None fields are left out)."""
    return {k: jnp.asarray(getattr(self, k), jnp.float32) for k in TRACED_HPARAMS
            if getattr(self, k) is not None}


@flax.struct.dataclass
class TrainState:
  """Everything a train step reads and writes; a pytree (jit, shard, checkpoint it).

  Attributes:
    params: model parameters (any pytree; e.g. an ``nnx.State``).
    opt_state: the optax state of ``params``.
    step: int32 number of completed train steps.
    hparams: dict of float32 scalars (traced hyperparameters, see :class:`TrainConfig`).
    kl_ctrl: adaptive KL controller state (its ``coef`` is the live KL coefficient
      when ``adaptive_kl``).
    clip_ctrl: adaptive clip controller state.
    rng: a raw ``uint32[2]`` PRNG key for minibatch shuffling.
  """
  params: Any
  opt_state: Any
  step: jax.Array
  hparams: dict
  kl_ctrl: AdaptiveKLState
  clip_ctrl: AdaptiveClipState
  rng: jax.Array


def init_train_state(params, optimizer: optax.GradientTransformation, config: TrainConfig,
                     rng=None) -> TrainState:
  """Builds the initial :class:`TrainState` for ``params``."""
  if rng is None:
    rng = jax.random.PRNGKey(0)
  clip_kwargs = {} if config.adaptive_clip_target is None else {
      "target": config.adaptive_clip_target}
  return TrainState(
      params=params,
      opt_state=optimizer.init(params),
      step=jnp.zeros((), jnp.int32),
      hparams=config.hparams(),
      kl_ctrl=adaptive_kl_init(max(config.kl_coef, 1e-8), target=config.kl_target,
                               horizon=config.kl_horizon),
      # The controller's epsilon lives in [clip_min, clip_max] (adaptive_clip_init
      # rejects a start outside it); a loss's own clip_low (GSPO 3e-4) may not.
      clip_ctrl=adaptive_clip_init(min(max(config.clip_low, config.clip_min),
                                       config.clip_max),
                                   eps_min=config.clip_min, eps_max=config.clip_max,
                                   metric=config.adaptive_clip_metric, **clip_kwargs),
      rng=jnp.asarray(rng, jnp.uint32),
  )
