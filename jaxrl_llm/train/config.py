"""The train-step configuration, each field declared once (importable without JAX:
the ``jaxrl-llm`` command builds its flags and checks them from here before importing
JAX).

Every :class:`TrainConfig` field carries its metadata (:func:`setting`): the help
text, the range or the choices, and whether it is a traced hyperparameter. The field
checks, :data:`TRACED_HPARAMS`, the class's ``Attributes`` documentation and the
command-line flags (:mod:`jaxrl_llm.cli`) are generated from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_llm._names import AGGREGATION_MODES, GAE_METHODS, ROLLOUT_LEVELS
from jaxrl_llm.train.registry import (
  ADVANTAGE_ESTIMATOR_REGISTRY,
  DEFAULT_CLIP_LOW,
  POLICY_LOSS_REGISTRY,
  get_policy_loss,
)

KL_MODES = ("none", "loss", "reward")
# The KL estimators the train step's ``kl_kind`` / ``reward_kl_kind`` accept: the
# canonical names of :data:`jaxrl_llm.losses.KL_KINDS` (which also lists aliases such
# as ``low_var_kl``; a test checks this is a subset of it).
STEP_KL_KINDS = ("k1", "k2", "k3", "abs", "k1+", "k3+")


def setting(default: Any, help: str, *, traced: bool | str = False,
            low: float | None = None, high: float | None = None,
            low_inclusive: bool = False, choices: Any = None, min_int: int | None = None,
            flag: bool = True, factory: Callable[[], Any] | None = None) -> Any:
  """A config field declared with its metadata: the one place of its default.

  Args:
    default: the default value.
    help: what the field does (the ``Attributes`` entry and the flag's help).
    traced: True for a float copied into ``TrainState.hparams`` (a traced scalar:
      editing it never recompiles); ``"rollout"`` for one traced only while
      ``rollout_correction`` is on; False for a static field.
    low, high: the allowed range (``high`` inclusive; ``low`` inclusive with
      ``low_inclusive``); None values are always allowed.
    choices: the allowed values (a tuple, or a function returning one, for names
      read from a registry).
    min_int: the field is an int (or None when the default is None) >= ``min_int``.
    flag: whether the command line has a flag for it.
    factory: builds the default of a mutable field (``default`` is then ignored).

  Returns:
    A :func:`dataclasses.field`.
  """
  where = {"default": default} if factory is None else {"default_factory": factory}
  return dataclasses.field(**where, metadata={
      "help": help, "traced": traced, "low": low, "high": high,
      "low_inclusive": low_inclusive, "choices": choices, "min_int": min_int,
      "flag": flag})


def _in_step_estimators() -> tuple:
  """Names of the registered in-step (critic-based) advantage estimators."""
  return tuple(k for k, spec in ADVANTAGE_ESTIMATOR_REGISTRY.items() if spec.needs_values)


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
  """
  # --- static structure
  num_epochs: int = setting(1, "passes over the batch per train step.", min_int=1)
  num_minibatches: int = setting(
      1, "optimizer updates per epoch (the batch is split into this many shuffled "
      "minibatches).", min_int=1)
  num_microbatches: int = setting(
      1, "gradient-accumulation chunks per minibatch (exact: changes nothing but "
      "rounding).", min_int=1)
  max_tokens_per_microbatch: int | None = setting(
      None, "token budget of a gradient-accumulation chunk (replaces "
      "``num_microbatches``): a minibatch of M rows of width L is split into the fewest "
      "chunks of whole rows holding at most this many token slots (rows x L; the row "
      "count of a chunk divides M). Exact, like ``num_microbatches``; with packed rows "
      "(``--pack``) a chunk holds this many tokens whatever the sequence lengths.",
      min_int=1)
  policy_loss: str = setting(
      "ppo", "the registered policy loss (see "
      ":data:`jaxrl_llm.train.registry.POLICY_LOSS_REGISTRY`).",
      choices=lambda: tuple(POLICY_LOSS_REGISTRY))
  loss_agg_mode: str = setting(
      "token-mean", "aggregation of per-token losses (see :func:`jaxrl_llm.aggregate`).",
      choices=tuple(AGGREGATION_MODES))
  norm_length: int | None = setting(
      None, "the constant divisor of ``seq-mean-token-sum-norm`` (Dr. GRPO).", min_int=1)
  use_value: bool = setting(
      True, "train a value head (PPO critic) with a clipped value loss.")
  whiten_advantages: bool = setting(
      True, "whiten advantages over the batch's response tokens.")
  gae_method: str | None = setting(
      None, "``scan`` or ``associative`` recurrence for in-step advantages; ``None``: "
      "the faster one on this backend (scan on CPU, associative on GPU/TPU; "
      ":func:`jaxrl_llm.advantages.default_gae_method`).",
      choices=(None,) + GAE_METHODS, flag=False)
  advantage_estimator: str = setting(
      "gae", "in-step estimator when the batch has no ``advantages`` (``gae``; "
      "``hybrid``: n-step returns mixed with GAE; ``decoupled_gae`` / ``vapo_gae``: "
      "separate critic lambda ``lam_value``).", choices=_in_step_estimators)
  hybrid_n: int = setting(
      4, "the n of the hybrid estimator's n-step returns.", min_int=1)
  kl_mode: str = setting(
      "none", "where the KL to the reference goes: ``none``, ``loss`` or ``reward``.",
      choices=KL_MODES)
  kl_kind: str = setting(
      "k3", "KL estimator in the loss (k1, k2, k3, abs, k1+, k3+).", choices=STEP_KL_KINDS)
  reward_kl_kind: str = setting(
      "k1", "KL estimator in the reward and for the adaptive controller.",
      choices=STEP_KL_KINDS)
  adaptive_kl: bool = setting(
      False, "adapt the KL coefficient toward ``kl_target`` (verl/OpenRLHF).")
  kl_target: float = setting(
      0.1, "target rollout KL of the adaptive KL controller.", low=0.0)
  kl_horizon: float = setting(
      10000.0, "horizon (samples) of the adaptive KL controller.", low=0.0)
  clip_schedule: Callable[[Any], Any] | None = setting(
      None, "an optax schedule of the clip epsilon (replaces ``clip_low``).", flag=False)
  adaptive_clip: bool = setting(
      False, "adapt the clip epsilon toward ``adaptive_clip_target``.")
  adaptive_clip_target: float | None = setting(
      None, "target of the adaptive clip controller (None: its default).")
  adaptive_clip_metric: str = setting(
      "kl", "what the adaptive clip controller tracks: ``kl`` or ``clipfrac``.",
      choices=("kl", "clipfrac"))
  clip_min: float = setting(0.05, "lower bound of the adaptive clip epsilon.")
  clip_max: float = setting(0.3, "upper bound of the adaptive clip epsilon.")
  logprob_chunk_size: int | None = setting(
      None, "vocabulary-projection chunk for log-probs from hidden states.")
  logprob_start: int | None = setting(
      None, "the first column whose log-probs the loss reads (a static column: the loop "
      "sets it to the prompt width for a checkpoint's run, its prompts being "
      "left-padded to it): the LM head "
      "runs on the outputs that predict columns ``>= logprob_start`` only, forward and "
      "backward (see :func:`jaxrl_llm.train.policy_forward`); ``loss_mask`` must be 0 "
      "before it. Ignored for packed batches. None: every column.", min_int=1,
      flag=False)
  old_logp_from_step: bool = setting(
      False, "take the old log-probs from the update's own forward, detached (the ratio "
      "is then exactly 1), so the batch needs no ``old_logp`` and the loop runs no "
      "forward before the update: TRL's ``num_iterations=1``. Needs one update per "
      "batch (1 epoch, 1 minibatch) and nothing that reads ``old_logp`` before it (no "
      "value model, ``kl_mode`` reward, adaptive KL or rollout correction).")
  skip_nonfinite: bool = setting(
      True, "skip updates whose inputs, loss, gradients or results are not finite "
      "(counted in ``metrics[\"skipped\"]``).")
  rollout_correction: str | None = setting(
      None, "correct the rollout/trainer mismatch (None: off; ``token`` or "
      "``sequence``): the per-token policy loss is multiplied by "
      ":func:`jaxrl_llm.rollout_correction_weights` of ``old_logp - rollout_logp`` "
      "(the batch must carry the sampler's ``rollout_logp``).",
      choices=(None,) + ROLLOUT_LEVELS)
  # --- traced hyperparameters (see TRACED_HPARAMS)
  clip_low: float | None = setting(
      None, "clip epsilon (lower side); None = the policy loss's default (PPO 0.2, "
      "GSPO 3e-4, GMPO 0.4).", traced=True, low=0.0)
  clip_high: float | None = setting(
      None, "clip epsilon (upper side, DAPO clip-higher); None = symmetric when "
      "``clip_low`` is set, else the policy loss's default.", traced=True, low=0.0)
  dual_clip: float | None = setting(
      None, "dual-clip constant c > 1 for negative advantages (losses that take it); "
      "None = off.", traced=True, low=1.0)
  vf_coef: float = setting(0.5, "weight of the value loss.", traced=True, low=0.0,
                           low_inclusive=True)
  vf_clip: float | None = setting(
      0.5, "value clip range around the rollout values; None = unclipped.",
      traced=True, low=0.0)
  entropy_coef: float = setting(0.0, "weight of the entropy bonus.", traced=True)
  kl_coef: float = setting(
      0.0, "weight of the KL to the reference (initial value when adaptive).",
      traced=True, low=0.0, low_inclusive=True)
  gamma: float = setting(1.0, "discount of in-step advantages.", traced=True, low=0.0,
                         high=1.0, low_inclusive=True)
  lam: float = setting(0.95, "GAE lambda.", traced=True, low=0.0, high=1.0,
                       low_inclusive=True)
  hybrid_mix: float = setting(
      0.5, "weight of the n-step returns in the hybrid estimator.", traced=True,
      low=0.0, high=1.0, low_inclusive=True)
  temperature: float = setting(
      1.0, "sampling temperature the log-probs are computed at.", traced=True, low=0.0)
  lam_value: float | None = setting(
      None, "the critic's GAE lambda of the ``decoupled_gae`` / ``vapo_gae`` "
      "estimators (None: the estimator's default, 1.0, VC-PPO's Monte-Carlo value "
      "targets).", traced=True, low=0.0, high=1.0, low_inclusive=True)
  lam_alpha: float | None = setting(
      None, "alpha of the ``vapo_gae`` estimator's length-adaptive policy lambda "
      "``1 - 1 / (alpha * length)`` (None: the estimator's default, 0.05, VAPO's).",
      traced=True, low=0.0)
  pos_nll_coef: float | None = setting(
      None, "weight mu of VAPO's positive-example NLL, the token-mean negative "
      "log-likelihood of the responses marked ``positive`` (correct) in the batch, "
      "added to the loss (None: off; VAPO uses 0.1).", traced=True, low=0.0,
      low_inclusive=True)
  rollout_is_threshold: float = setting(
      2.0, "upper bound of the rollout-correction weights (truncated IS; verl's "
      "``rollout_is_threshold``).", traced="rollout", low=0.0)
  rollout_is_lower: float | None = setting(
      None, "with it, weights outside ``[lower, threshold]`` are zeroed instead of "
      "truncated (IcePop); None: truncation.", traced="rollout", low=0.0,
      low_inclusive=True)
  loss_hparams: Mapping[str, float] | None = setting(
      None, "overrides of the policy loss's own hyperparameters (e.g. "
      "``{\"tau_pos\": 2.0}`` for SAPO); traced like the fields above.", flag=False)

  def __post_init__(self) -> None:
    spec = get_policy_loss(self.policy_loss)
    for f in dataclasses.fields(self):
      check_field(f, getattr(self, f.name))
    if self.clip_schedule is not None and self.adaptive_clip:
      raise ValueError("`clip_schedule` and `adaptive_clip` are exclusive: pick one.")
    if self.old_logp_from_step:
      reads = {"num_epochs > 1": self.num_epochs > 1,
               "num_minibatches > 1": self.num_minibatches > 1,
               "use_value": self.use_value, "kl_mode='reward'": self.kl_mode == "reward",
               "adaptive_kl": self.adaptive_kl,
               "rollout_correction": self.rollout_correction is not None}
      clash = [name for name, on in reads.items() if on]
      if clash:
        raise ValueError(f"`old_logp_from_step` needs one update per batch and nothing "
                         f"reading old_logp before it; {clash[0]} does.")
    if self.adaptive_kl and self.kl_mode == "none":
      raise ValueError("`adaptive_kl` needs `kl_mode` 'loss' or 'reward'.")
    if (self.rollout_is_lower is not None
        and self.rollout_is_lower > self.rollout_is_threshold):
      raise ValueError(f"`rollout_is_lower` must be <= `rollout_is_threshold` "
                       f"({self.rollout_is_threshold!r}), got {self.rollout_is_lower!r}.")
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

  def clip_range(self) -> tuple[float, float | None]:
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
    return (DEFAULT_CLIP_LOW if low is None else low), high

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


def check_field(f: dataclasses.Field, x: Any) -> None:
  """Checks value ``x`` of the declared field ``f`` against its metadata (choices,
  range, int bound): ``ValueError`` naming the field otherwise."""
  meta, name = f.metadata, f.name
  # Not merged (SIM102): the guard (a bound that applies), then the check.
  if meta.get("min_int") is not None and not (x is None and f.default is None):  # noqa: SIM102
    if not isinstance(x, int) or isinstance(x, bool) or x < meta["min_int"]:
      none = "None or " if f.default is None else ""
      raise ValueError(f"`{name}` must be {none}an int >= {meta['min_int']}, got {x!r}.")
  choices = field_choices(f)
  if choices is not None and x not in choices:
    raise ValueError(f"`{name}` must be one of {list(choices)}, got {x!r}.")
  low, high = meta.get("low"), meta.get("high")
  if (low is None and high is None) or x is None or isinstance(x, bool) or not isinstance(
      x, (int, float)):
    return
  inclusive = meta.get("low_inclusive", False)
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


def field_choices(f: dataclasses.Field | str, cls: type | None = None) -> tuple | None:
  """The allowed values of a declared field (a Field, or a :class:`TrainConfig` field
  name); None: any value.

  Examples:
    >>> field_choices("kl_mode"), field_choices("lam")
    (('none', 'loss', 'reward'), None)
  """
  if isinstance(f, str):
    f = config_field(cls or TrainConfig, f)
  choices = f.metadata.get("choices")
  return choices() if callable(choices) else choices


def config_field(cls: type, name: str) -> dataclasses.Field:
  """The declared field ``name`` of the dataclass ``cls``."""
  return next(f for f in dataclasses.fields(cls) if f.name == name)


def document_fields(cls: type) -> type:
  """Appends an ``Attributes:`` section, from the fields' help, to ``cls.__doc__``."""
  lines = ["", "  Attributes:"]
  for f in dataclasses.fields(cls):
    if "help" in f.metadata:
      lines.append(f"    {f.name}: {f.metadata['help']}")
  cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
  return cls


document_fields(TrainConfig)

# Float fields of TrainConfig that live in TrainState.hparams as traced scalars.
TRACED_HPARAMS = tuple(f.name for f in dataclasses.fields(TrainConfig)
                       if f.metadata["traced"] is True)
# Traced only while ``rollout_correction`` is on (else left out of ``hparams``).
ROLLOUT_HPARAMS = tuple(f.name for f in dataclasses.fields(TrainConfig)
                        if f.metadata["traced"] == "rollout")

# TrainConfig fields of the GRPO family (critic-free, KL in the loss).
GRPO_DEFAULTS: dict[str, Any] = dict(use_value=False, whiten_advantages=False,
                                     kl_mode="loss", vf_clip=None)

__all__ = ["TrainConfig", "TRACED_HPARAMS", "ROLLOUT_HPARAMS", "GRPO_DEFAULTS",
           "KL_MODES", "STEP_KL_KINDS", "setting", "check_field", "field_choices",
           "config_field", "document_fields"]
