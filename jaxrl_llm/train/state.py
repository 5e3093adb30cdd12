"""The train-step configuration (importable without JAX: the ``jaxrl-llm`` command
builds its flags and checks them from here before importing JAX).

:class:`TrainState` and :func:`init_train_state` live in
:mod:`jaxrl_llm.train.train_state`; they are importable from here as before.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from jaxrl_llm import _validate as v
from jaxrl_llm._names import AGGREGATION_MODES, GAE_METHODS
from jaxrl_llm.train.registry import (ADVANTAGE_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY,
                                      get_policy_loss)

# The built-in policy losses (the live registry is ``registry.POLICY_LOSS_REGISTRY``).
POLICY_LOSSES = tuple(POLICY_LOSS_REGISTRY)
KL_MODES = ("none", "loss", "reward")
KL_KINDS = ("k1", "k2", "k3", "abs", "k1+", "k3+")

# Float fields of TrainConfig that live in TrainState.hparams as traced scalars.
TRACED_HPARAMS = ("clip_low", "clip_high", "dual_clip", "vf_coef", "vf_clip",
                  "entropy_coef", "kl_coef", "gamma", "lam", "hybrid_mix", "temperature",
                  "lam_value", "lam_alpha", "pos_nll_coef")
# Traced only while ``rollout_correction`` is on (else left out of ``hparams``).
ROLLOUT_HPARAMS = ("rollout_is_threshold", "rollout_is_lower")
ROLLOUT_LEVELS = ("token", "sequence")
ADVANTAGE_ESTIMATORS = ("gae", "hybrid")  # built-in in-step estimators


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Configuration of a train step: its structure and the initial hyperparameters.

  Static fields (ints, strings, bools, callables, and whether a float field is
  ``None``) shape the compiled program; changing them builds a new step. Float fields
  listed in ``TRACED_HPARAMS`` (and the policy loss's own hyperparameters, e.g. SAPO's
  ``tau_pos``) are copied into ``TrainState.hparams`` by :func:`init_train_state` and
  read from there by the step, so editing ``state.hparams`` (a sweep, a hand-written
  schedule) never recompiles. The step checks at trace time that the state's
  ``hparams`` keys are the ones its config declares (:meth:`hparam_names`) and raises
  ``ValueError`` naming the difference otherwise: build the state with the same config
  (``step.init(params)``).

  Clip epsilon: ``clip_schedule`` (an optax schedule, e.g.
  ``optax.linear_schedule(0.2, 0.05, n)`` for the "0.2 early, 0.05 late" dynamic
  clipping) or ``adaptive_clip=True`` (:func:`jaxrl_llm.adaptive_clip_update` after
  every step) replace ``clip_low``; ``clip_high`` then keeps its ratio to ``clip_low``.
  ``policy_loss="cispo"`` uses verl's form: the stop-gradient importance weight is
  clipped to ``[1 - clip_low, 1 + clip_high]``.

  Attributes:
    num_epochs: passes over the batch per train step.
    num_minibatches: optimizer updates per epoch (the batch is split into this many
      shuffled minibatches).
    num_microbatches: gradient-accumulation chunks per minibatch (exact: changes
      nothing but rounding).
    policy_loss: the registered policy loss (see
      :data:`jaxrl_llm.train.registry.POLICY_LOSS_REGISTRY`).
    loss_agg_mode: aggregation of per-token losses (see :func:`jaxrl_llm.aggregate`).
    norm_length: the constant divisor of ``seq-mean-token-sum-norm`` (Dr. GRPO).
    use_value: train a value head (PPO critic) with a clipped value loss.
    whiten_advantages: whiten advantages over the batch's response tokens.
    gae_method: ``scan`` or ``associative`` recurrence for in-step advantages;
      ``None``: the faster one on this backend (scan on CPU, associative on GPU/TPU;
      :func:`jaxrl_llm.advantages.default_gae_method`).
    advantage_estimator: in-step estimator when the batch has no ``advantages``
      (``gae``; ``hybrid``: n-step returns mixed with GAE; ``decoupled_gae`` /
      ``vapo_gae``: separate critic lambda ``lam_value``).
    hybrid_n: the n of the hybrid estimator's n-step returns.
    kl_mode: where the KL to the reference goes: ``none``, ``loss`` or ``reward``.
    kl_kind: KL estimator in the loss (k1, k2, k3, abs, k1+, k3+).
    reward_kl_kind: KL estimator in the reward and for the adaptive controller.
    adaptive_kl: adapt the KL coefficient toward ``kl_target`` (verl/OpenRLHF).
    kl_target: target rollout KL of the adaptive KL controller.
    kl_horizon: horizon (samples) of the adaptive KL controller.
    clip_schedule: an optax schedule of the clip epsilon (replaces ``clip_low``).
    adaptive_clip: adapt the clip epsilon toward ``adaptive_clip_target``.
    adaptive_clip_target: target of the adaptive clip controller (None: its default).
    adaptive_clip_metric: what the adaptive clip controller tracks: ``kl`` or
      ``clipfrac``.
    clip_min: lower bound of the adaptive clip epsilon.
    clip_max: upper bound of the adaptive clip epsilon.
    logprob_chunk_size: vocabulary-projection chunk for log-probs from hidden states.
    skip_nonfinite: skip updates whose inputs, loss, gradients or results are not
      finite (counted in ``metrics["skipped"]``).
    rollout_correction: correct the rollout/trainer mismatch (None: off; ``token`` or
      ``sequence``): the per-token policy loss is multiplied by
      :func:`jaxrl_llm.rollout_correction_weights` of ``old_logp - rollout_logp``
      (the batch must carry the sampler's ``rollout_logp``).
    clip_low: clip epsilon (lower side); None = the policy loss's default (PPO 0.2,
      GSPO 3e-4, GMPO 0.4).
    clip_high: clip epsilon (upper side, DAPO clip-higher); None = symmetric when
      ``clip_low`` is set, else the policy loss's default.
    dual_clip: dual-clip constant c > 1 for negative advantages (losses that take it);
      None = off.
    vf_coef: weight of the value loss.
    vf_clip: value clip range around the rollout values; None = unclipped.
    entropy_coef: weight of the entropy bonus.
    kl_coef: weight of the KL to the reference (initial value when adaptive).
    gamma: discount of in-step advantages.
    lam: GAE lambda.
    hybrid_mix: weight of the n-step returns in the hybrid estimator.
    temperature: sampling temperature the log-probs are computed at.
    lam_value: the critic's GAE lambda of the ``decoupled_gae`` / ``vapo_gae``
      estimators (None: 1.0, VC-PPO's Monte-Carlo value targets).
    lam_alpha: alpha of the ``vapo_gae`` estimator's length-adaptive policy lambda
      ``1 - 1 / (alpha * length)`` (None: 0.05, VAPO's).
    pos_nll_coef: weight mu of VAPO's positive-example NLL, the token-mean negative
      log-likelihood of the responses marked ``positive`` (correct) in the batch,
      added to the loss (None: off; VAPO uses 0.1).
    rollout_is_threshold: upper bound of the rollout-correction weights (truncated
      IS; verl's ``rollout_is_threshold``).
    rollout_is_lower: with it, weights outside ``[lower, threshold]`` are zeroed
      instead of truncated (IcePop); None: truncation.
    loss_hparams: overrides of the policy loss's own hyperparameters (e.g.
      ``{"tau_pos": 2.0}`` for SAPO); traced like the fields above.
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
  gae_method: str | None = None
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
  rollout_correction: Optional[str] = None
  # --- traced hyperparameters (see TRACED_HPARAMS)
  clip_low: Optional[float] = None
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
  lam_value: Optional[float] = None
  lam_alpha: Optional[float] = None
  pos_nll_coef: Optional[float] = None
  rollout_is_threshold: float = 2.0
  rollout_is_lower: Optional[float] = None
  loss_hparams: Optional[Mapping[str, float]] = None

  def __post_init__(self):
    for name in ("num_epochs", "num_minibatches", "num_microbatches", "hybrid_n"):
      val = getattr(self, name)
      if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {val!r}.")
    spec = get_policy_loss(self.policy_loss)
    for f in dataclasses.fields(self):
      choices = field_choices(f.name)
      if choices is not None:
        v.check_choice(f.name, getattr(self, f.name), choices)
    if self.clip_schedule is not None and self.adaptive_clip:
      raise ValueError("`clip_schedule` and `adaptive_clip` are exclusive: pick one.")
    if self.adaptive_kl and self.kl_mode == "none":
      raise ValueError("`adaptive_kl` needs `kl_mode` 'loss' or 'reward'.")
    _check_range("clip_low", self.clip_low, low=0.0)
    _check_range("clip_high", self.clip_high, low=0.0)
    _check_range("dual_clip", self.dual_clip, low=1.0)
    _check_range("vf_clip", self.vf_clip, low=0.0)
    _check_range("vf_coef", self.vf_coef, low=0.0, inclusive=True)
    _check_range("kl_coef", self.kl_coef, low=0.0, inclusive=True)
    _check_range("gamma", self.gamma, low=0.0, high=1.0, inclusive=True)
    _check_range("lam", self.lam, low=0.0, high=1.0, inclusive=True)
    _check_range("hybrid_mix", self.hybrid_mix, low=0.0, high=1.0, inclusive=True)
    _check_range("lam_value", self.lam_value, low=0.0, high=1.0, inclusive=True)
    _check_range("temperature", self.temperature, low=0.0)
    _check_range("lam_alpha", self.lam_alpha, low=0.0)
    _check_range("pos_nll_coef", self.pos_nll_coef, low=0.0, inclusive=True)
    _check_range("rollout_is_threshold", self.rollout_is_threshold, low=0.0)
    _check_range("rollout_is_lower", self.rollout_is_lower, low=0.0, inclusive=True)
    if (self.rollout_is_lower is not None
        and self.rollout_is_lower > self.rollout_is_threshold):
      raise ValueError(f"`rollout_is_lower` must be <= `rollout_is_threshold` "
                       f"({self.rollout_is_threshold!r}), got {self.rollout_is_lower!r}.")
    _check_range("kl_target", self.kl_target, low=0.0)
    _check_range("kl_horizon", self.kl_horizon, low=0.0)
    if self.norm_length is not None and (not isinstance(self.norm_length, int)
                                         or self.norm_length < 1):
      raise ValueError(f"`norm_length` must be None or an int >= 1, got "
                       f"{self.norm_length!r}.")
    if not 0 < self.clip_min <= self.clip_max:
      raise ValueError(f"`clip_min` and `clip_max` must satisfy 0 < clip_min <= clip_max,"
                       f" got {self.clip_min!r} and {self.clip_max!r}.")
    if self.dual_clip is not None and not spec.supports_dual_clip:
      raise ValueError(f"`dual_clip` is not supported by policy_loss={self.policy_loss!r}"
                       f" ({spec.fn.__name__} has no dual_clip).")
    unknown = sorted(set(self.loss_hparams or {}) - set(spec.extra_hparams))
    if unknown:
      raise ValueError(f"`loss_hparams` has {unknown}, not hyperparameters of "
                       f"policy_loss={self.policy_loss!r} (it takes "
                       f"{sorted(spec.extra_hparams) or 'none'}).")

  def clip_range(self) -> tuple[float, Optional[float]]:
    """``(clip_low, clip_high)`` after the policy loss's defaults are applied.

    ``clip_high`` None means symmetric (``clip_high = clip_low``).

    Examples:
      >>> TrainConfig().clip_range(), TrainConfig(policy_loss="gspo").clip_range()
      ((0.2, None), (0.0003, 0.0004))
      >>> TrainConfig(policy_loss="gspo", clip_low=1e-3).clip_range()
      (0.001, None)
    """
    if self.clip_low is not None:
      return self.clip_low, self.clip_high
    defaults = get_policy_loss(self.policy_loss).defaults
    low = defaults.get("clip_low")
    high = self.clip_high if self.clip_high is not None else defaults.get("clip_high")
    return (0.2 if low is None else low), high

  def hparam_values(self) -> dict:
    """The traced hyperparameters as Python floats (None-valued ones left out)."""
    vals: dict = {k: getattr(self, k) for k in TRACED_HPARAMS}
    if self.rollout_correction is not None:
      vals.update({k: getattr(self, k) for k in ROLLOUT_HPARAMS})
    vals["clip_low"], vals["clip_high"] = self.clip_range()
    spec = get_policy_loss(self.policy_loss)
    vals.update(spec.extra_hparams)
    vals.update(self.loss_hparams or {})
    return {k: val for k, val in vals.items() if val is not None}

  def hparam_names(self) -> tuple:
    """The keys ``TrainState.hparams`` must have for this config (sorted)."""
    return tuple(sorted(self.hparam_values()))

  def hparams(self) -> dict:
    """The traced hyperparameters as float32 scalars (None fields are left out)."""
    import jax.numpy as jnp
    return {k: jnp.asarray(val, jnp.float32) for k, val in self.hparam_values().items()}


def _check_range(name: str, x, *, low=None, high=None, inclusive=False) -> None:
  """ValueError naming ``name`` when the Python number ``x`` is out of range."""
  if x is None or isinstance(x, bool) or not isinstance(x, (int, float)):
    return
  ok = True
  if low is not None:
    ok = x >= low if inclusive else x > low
  if high is not None:
    ok = ok and x <= high
  if not ok:
    lo = f"{'>=' if inclusive else '>'} {low}" if low is not None else ""
    hi = f"<= {high}" if high is not None else ""
    raise ValueError(f"`{name}` must be {' and '.join(p for p in (lo, hi) if p)}, "
                     f"got {x!r}.")


def field_choices(name: str) -> Optional[tuple]:
  """The allowed values of the :class:`TrainConfig` field ``name`` (None: any value).

  Examples:
    >>> field_choices("kl_mode"), field_choices("lam")
    (('none', 'loss', 'reward'), None)
  """
  if name == "policy_loss":
    return tuple(POLICY_LOSS_REGISTRY)
  if name == "advantage_estimator":
    return advantage_estimators()
  return {"loss_agg_mode": tuple(AGGREGATION_MODES), "kl_mode": KL_MODES,
          "kl_kind": KL_KINDS, "reward_kl_kind": KL_KINDS,
          "gae_method": (None,) + GAE_METHODS, "rollout_correction": (None,) + ROLLOUT_LEVELS,
          "adaptive_clip_metric": ("kl", "clipfrac")}.get(name)


def advantage_estimators() -> tuple:
  """Names of the registered in-step (critic-based) advantage estimators."""
  return tuple(k for k, spec in ADVANTAGE_ESTIMATOR_REGISTRY.items() if spec.needs_values)


# TrainConfig fields of the GRPO family (critic-free, KL in the loss).
GRPO_DEFAULTS: dict[str, Any] = dict(use_value=False, whiten_advantages=False,
                                     kl_mode="loss", kl_kind="k3", vf_clip=None)

if TYPE_CHECKING:   # the lazy names below, for type checkers
  from jaxrl_llm.train.train_state import TrainState, init_train_state  # noqa: F401


def __getattr__(name: str) -> Any:
  """``TrainState`` and ``init_train_state`` (they import JAX) load on first use."""
  if name in ("TrainState", "init_train_state"):
    from jaxrl_llm.train import train_state
    return getattr(train_state, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
