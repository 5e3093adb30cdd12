r"""Registries of policy losses and advantage estimators, read by the train step,
the trainer, the CLI and the benchmarks.

Adding a policy loss is one function in :mod:`jaxrl_llm.losses` with the common
signature ``fn(logp, old_logp, advantages, mask, **hparams) -> (per_token, metrics)``
and one :func:`register_policy_loss` line naming its traced hyperparameters and their
defaults. The clip options ``clip_low`` / ``clip_high`` / ``dual_clip`` are shared:
the train step feeds them from the clip schedule or the adaptive clip controller, and
a loss accepts ``dual_clip`` exactly when its function has that keyword.

Adding an advantage estimator is one function with the common signature
``fn(inputs: AdvantageInputs, hparams) -> (advantages, returns or None)`` and one
:func:`register_advantage_estimator` line.

The module imports without JAX (the ``jaxrl-llm`` command lists and checks the
registered names before importing it): the built-in losses are registered by their
name in :mod:`jaxrl_llm.losses`, imported on first use of ``spec.fn``.

Examples:
  >>> sorted(POLICY_LOSS_REGISTRY)
  ['cispo', 'gmpo', 'gspo', 'ppo', 'reinforce', 'sapo']
  >>> spec = get_policy_loss("gspo")
  >>> spec.defaults["clip_low"], spec.defaults["clip_high"]
  (0.0003, 0.0004)
  >>> get_policy_loss("sapo").extra_hparams
  {'tau_pos': 1.0, 'tau_neg': 1.05}
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:   # the configs import this module without JAX
  import jax

CLIP_OPTIONS = ("clip_low", "clip_high", "dual_clip")
# PPO's clip epsilon: the ``ppo`` and ``cispo`` losses' default, and the clip range's
# lower side for a loss that declares none (:meth:`TrainConfig.clip_range`).
DEFAULT_CLIP_LOW = 0.2


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
  """A registered policy loss.

  Attributes:
    name: the registry key (``TrainConfig.policy_loss``, ``--policy-loss``).
    target: the loss function, or the name of one in :mod:`jaxrl_llm.losses`
      (imported on first use of :attr:`fn`).
    defaults: the loss's own defaults of its traced hyperparameters: the clip options
      it uses (``clip_low``, ``clip_high``; ``clip_high=None`` = symmetric) and its
      extra ones (e.g. SAPO's ``tau_pos``).
    static: static keyword arguments always passed (e.g. CISPO's ``mode``).
    doc: one line for ``--help``.
  """
  name: str
  target: Callable[..., Any] | str
  defaults: Mapping[str, float | None]
  static: Mapping[str, Any]
  doc: str

  @property
  def fn(self) -> Callable[..., Any]:
    """``fn(logp, old_logp, advantages, mask, **kwargs) -> (per_token, metrics)``."""
    return _loss_function(self.name, self.target, tuple(self.defaults),
                          tuple(self.static))

  @property
  def uses_clip(self) -> bool:
    """Whether the loss takes a clip range (schedule / adaptive clip apply)."""
    return "clip_low" in self.defaults

  @property
  def supports_dual_clip(self) -> bool:
    return "dual_clip" in inspect.signature(self.fn).parameters

  @property
  def extra_hparams(self) -> dict:
    """Traced hyperparameters other than the shared clip options, with defaults."""
    return {k: val for k, val in self.defaults.items() if k not in CLIP_OPTIONS}


POLICY_LOSS_REGISTRY: dict[str, PolicyLossSpec] = {}


_RESOLVED: dict = {}


def _loss_function(name: str, target: Callable[..., Any] | str, keywords: tuple,
                   static: tuple) -> Callable[..., Any]:
  """The loss function of ``target`` (a name in :mod:`jaxrl_llm.losses` is imported),
  checked once to take every registered keyword."""
  key = (name, target if isinstance(target, str) else id(target))
  if key not in _RESOLVED:
    fn = (getattr(importlib.import_module("jaxrl_llm.losses"), target)
          if isinstance(target, str) else target)
    params = inspect.signature(fn).parameters
    unknown = [k for k in keywords + static if k not in params]
    if unknown:
      raise ValueError(f"register_policy_loss({name!r}): {fn.__name__} has no "
                       f"keyword(s) {unknown}.")
    _RESOLVED[key] = fn
  return _RESOLVED[key]


def register_policy_loss(name: str, fn: Callable[..., Any] | str, *, doc: str = "",
                         static: Mapping[str, Any] | None = None,
                         **defaults: float | None) -> PolicyLossSpec:
  """Registers ``fn`` under ``name`` with its traced hyperparameter defaults.

  Args:
    name: registry key.
    fn: ``fn(logp, old_logp, advantages, mask, **hparams) -> (per_token, metrics)``,
      or the name of such a function in :mod:`jaxrl_llm.losses` (imported on first
      use, so registering imports no JAX).
    doc: a one-line description (shown by ``jaxrl-llm train --help``).
    static: static keyword arguments passed on every call.
    **defaults: traced hyperparameters and their defaults; ``clip_low`` (and
      ``clip_high``) mark a clipped loss.

  Returns:
    The :class:`PolicyLossSpec` (also stored in ``POLICY_LOSS_REGISTRY``).
  """
  spec = PolicyLossSpec(name=name, target=fn, defaults=dict(defaults),
                        static=dict(static or {}), doc=doc)
  if not isinstance(fn, str):   # a function given here is checked now
    _loss_function(name, fn, tuple(spec.defaults), tuple(spec.static))
  POLICY_LOSS_REGISTRY[name] = spec
  return spec


def get_policy_loss(name: str) -> PolicyLossSpec:
  """The :class:`PolicyLossSpec` registered as ``name`` (ValueError naming the choices)."""
  return _lookup(POLICY_LOSS_REGISTRY, "policy_loss", name)


def _reinforce(logp, old_logp, advantages, mask, **kwargs):
  """On-policy REINFORCE in the common signature (``old_logp`` unused)."""
  del old_logp
  from jaxrl_llm import losses as L
  return L.reinforce_policy_loss(logp, advantages, mask, **kwargs)


register_policy_loss("ppo", "ppo_policy_loss", clip_low=DEFAULT_CLIP_LOW, clip_high=None,
                     doc="PPO clipped surrogate (clip-higher, dual clip)")
register_policy_loss("gspo", "gspo_policy_loss", clip_low=3e-4, clip_high=4e-4,
                     doc="GSPO sequence-ratio clip (epsilons at the 3e-4 scale)")
register_policy_loss("cispo", "cispo_policy_loss", clip_low=DEFAULT_CLIP_LOW,
                     clip_high=None,
                     static={"mode": "verl"},
                     doc="CISPO clipped stop-gradient IS weight (verl form)")
register_policy_loss("sapo", "sapo_policy_loss", tau_pos=1.0, tau_neg=1.05,
                     doc="SAPO sigmoid gate (temperatures tau_pos / tau_neg)")
register_policy_loss("gmpo", "gmpo_policy_loss", clip_low=0.4, clip_high=0.4,
                     doc="GMPO geometric-mean ratio, log-space clip")
register_policy_loss("reinforce", _reinforce,
                     doc="on-policy REINFORCE / GPG (-A log pi)")


# ------------------------------------------------------------------- advantage estimators


class AdvantageInputs(NamedTuple):
  """What an advantage estimator may read (absent entries are None).

  Attributes:
    rewards: token rewards ``[B, T]`` (the score at the last response token).
    mask: ``[B, T]``, 1 on response tokens.
    values: critic values ``[B, T]`` at rollout.
    scores: per-sequence scores ``[B]``.
    greedy_scores: scores of the greedy completion of each row's prompt ``[B]``.
    group_size: completions per prompt (rows of one prompt are consecutive).
    segment_ids: ``[B, T]`` int of a packed batch (:mod:`jaxrl_llm.packing`), or None.
      Estimators that cannot take packed rows raise ``ValueError`` when it is set.
  """
  rewards: Any = None
  mask: Any = None
  values: Any = None
  scores: Any = None
  greedy_scores: Any = None
  group_size: int | None = None
  segment_ids: Any = None


@dataclasses.dataclass(frozen=True)
class AdvantageEstimatorSpec:
  """A registered advantage estimator.

  Attributes:
    name: registry key.
    fn: ``fn(inputs: AdvantageInputs, hparams: dict, **static) -> (adv, returns)``;
      ``adv`` is ``[B, T]`` or ``[B]``, ``returns`` ``[B, T]`` or None.
    needs_values: needs a critic (``inputs.values``); such estimators run inside the
      train step (``TrainConfig.advantage_estimator``).
    needs_greedy: needs ``inputs.greedy_scores`` (one greedy rollout per prompt).
    group: a group baseline (needs ``group_size >= 2``).
    doc: one line for ``--help``.
    hparams: the traced hyperparameters (``TrainConfig`` fields) ``fn`` reads from
      ``hparams``.
    defaults: values of the ones among them that a config may leave None (they are
      then absent from ``hparams``): the estimator's own defaults.
    static: the static ``TrainConfig`` fields passed to ``fn`` as keywords of the
      same name (e.g. the hybrid estimator's ``hybrid_n``).
  """
  name: str
  fn: Callable[..., Any]
  needs_values: bool
  needs_greedy: bool
  group: bool
  doc: str
  hparams: tuple = ()
  defaults: Mapping[str, float] = dataclasses.field(default_factory=dict)
  static: tuple = ()

  @property
  def reads(self) -> tuple:
    """Every config field the estimator reads (traced and static)."""
    return self.hparams + self.static


ADVANTAGE_ESTIMATOR_REGISTRY: dict[str, AdvantageEstimatorSpec] = {}


def register_advantage_estimator(name: str, fn: Callable[..., Any], *,
                                 needs_values: bool = False, needs_greedy: bool = False,
                                 group: bool = False, doc: str = "",
                                 hparams: tuple = (),
                                 defaults: Mapping[str, float] | None = None,
                                 static: tuple = ()) -> AdvantageEstimatorSpec:
  """Registers an advantage estimator (see :class:`AdvantageEstimatorSpec`)."""
  defaults = dict(defaults or {})
  unknown = sorted(set(defaults) - set(hparams))
  if unknown:
    raise ValueError(f"register_advantage_estimator({name!r}): `defaults` has "
                     f"{unknown}, not among its `hparams` {list(hparams)}.")
  spec = AdvantageEstimatorSpec(name=name, fn=fn, needs_values=needs_values,
                                needs_greedy=needs_greedy, group=group, doc=doc,
                                hparams=tuple(hparams), defaults=defaults,
                                static=tuple(static))
  ADVANTAGE_ESTIMATOR_REGISTRY[name] = spec
  return spec


def get_advantage_estimator(name: str) -> AdvantageEstimatorSpec:
  """The registered estimator ``name`` (ValueError naming the choices)."""
  return _lookup(ADVANTAGE_ESTIMATOR_REGISTRY, "advantage_estimator", name)


def _f32(x):
  import jax.numpy as jnp
  return jnp.asarray(x, jnp.float32)


def _gae(x: AdvantageInputs, hp, *, gae_method=None):
  from jaxrl_llm import advantages as A
  return A.gae(x.rewards, x.values, x.mask, gamma=hp["gamma"], lam=hp["lam"],
               method=gae_method, segment_ids=x.segment_ids)


def _unpacked_only(name: str, x: AdvantageInputs) -> None:
  if x.segment_ids is not None:
    raise ValueError(f"advantage estimator {name!r} does not take packed rows "
                     f"(segment_ids); use 'gae', 'decoupled_gae' or 'vapo_gae', or "
                     f"give per-token advantages computed before packing.")


def _hybrid(x: AdvantageInputs, hp, *, hybrid_n, gae_method=None):
  from jaxrl_llm import advantages as A
  _unpacked_only("hybrid", x)
  return A.hybrid_advantages(x.rewards, x.values, x.mask, n=hybrid_n, gamma=hp["gamma"],
                             lam=hp["lam"], mix=hp["hybrid_mix"], method=gae_method)


def _decoupled_gae(x: AdvantageInputs, hp, *, gae_method=None):
  from jaxrl_llm import advantages as A
  return A.decoupled_gae(x.rewards, x.values, x.mask, gamma=hp["gamma"],
                         lam_policy=hp["lam"], lam_value=hp["lam_value"],
                         method=gae_method, segment_ids=x.segment_ids)


def _vapo_gae(x: AdvantageInputs, hp, *, gae_method=None):
  from jaxrl_llm import advantages as A
  lam_policy = A.length_adaptive_lambda(x.mask, alpha=hp["lam_alpha"],
                                        segment_ids=x.segment_ids)
  return A.decoupled_gae(x.rewards, x.values, x.mask, gamma=hp["gamma"],
                         lam_policy=lam_policy, lam_value=hp["lam_value"],
                         method=gae_method, segment_ids=x.segment_ids)


def _group(name: str) -> Callable[..., Any]:
  """The estimator of the group baseline ``jaxrl_llm.advantages.<name>``."""
  def estimator(x: AdvantageInputs, hp):
    del hp
    _unpacked_only(name, x)
    fn = getattr(importlib.import_module("jaxrl_llm.advantages"), name)
    return fn(_f32(x.scores), group_size=x.group_size), None
  estimator.__doc__ = f"{name} of the sequence scores."
  return estimator


def _self_critical(x: AdvantageInputs, hp):
  from jaxrl_llm import advantages as A
  del hp
  _unpacked_only("self_critical", x)
  return A.self_critical_advantages(_f32(x.scores), _f32(x.greedy_scores)), None


def _reinforce_pp(x: AdvantageInputs, hp):
  from jaxrl_llm import advantages as A
  _unpacked_only("reinforce_pp", x)
  return A.reinforce_pp_advantages(x.rewards, x.mask, gamma=hp["gamma"]), None


# VC-PPO's critic lambda (Monte-Carlo value targets), the default of both estimators
# with a separate critic lambda.
_LAM_VALUE = {"lam_value": 1.0}
register_advantage_estimator("gae", _gae, needs_values=True, hparams=("gamma", "lam"),
                             static=("gae_method",),
                             doc="GAE over token rewards and critic values")
register_advantage_estimator("hybrid", _hybrid, needs_values=True,
                             hparams=("gamma", "lam", "hybrid_mix"),
                             static=("gae_method", "hybrid_n"),
                             doc="n-step returns mixed with GAE (hybrid_n, hybrid_mix)")
register_advantage_estimator("decoupled_gae", _decoupled_gae, needs_values=True,
                             hparams=("gamma", "lam", "lam_value"), defaults=_LAM_VALUE,
                             static=("gae_method",),
                             doc="GAE with lam for the policy, lam_value (default 1) "
                                 "for the critic's targets (VC-PPO)")
register_advantage_estimator("vapo_gae", _vapo_gae, needs_values=True,
                             hparams=("gamma", "lam_value", "lam_alpha"),
                             defaults={**_LAM_VALUE, "lam_alpha": 0.05},
                             static=("gae_method",),
                             doc="decoupled GAE with VAPO's length-adaptive policy "
                                 "lambda (lam_alpha, default 0.05)")
register_advantage_estimator("grpo", _group("grpo_advantages"), group=True,
                             doc="group mean baseline / group std")
register_advantage_estimator("dr_grpo", _group("dr_grpo_advantages"), group=True,
                             doc="group mean baseline, no std (Dr. GRPO)")
register_advantage_estimator("rloo", _group("rloo_advantages"), group=True,
                             doc="leave-one-out group baseline")
register_advantage_estimator("self_critical", _self_critical, needs_greedy=True,
                             doc="score minus the greedy completion's score")
register_advantage_estimator("reinforce_pp", _reinforce_pp, hparams=("gamma",),
                             doc="REINFORCE++ discounted returns, batch-whitened")


def compute_advantages(name: str, inputs: AdvantageInputs, hparams: Mapping[str, Any],
                       **static: Any) -> tuple[jax.Array, jax.Array | None]:
  """Runs the registered estimator ``name``: ``(advantages, returns or None)``.

  ``hparams`` must hold the traced hyperparameters the estimator reads (its
  ``spec.hparams``; those with ``spec.defaults`` may be absent) and ``static`` its
  static fields (``spec.static``; one may be absent when ``spec.fn`` has a default for
  it, e.g. ``gae_method=None``); a missing one is a ``ValueError`` naming it.

  Examples:
    >>> import jax.numpy as jnp
    >>> adv, ret = compute_advantages("rloo", AdvantageInputs(
    ...     scores=jnp.array([1.0, 0.0, 0.0, 0.0]), group_size=2), {})
    >>> [float(x) for x in adv], ret
    ([1.0, -1.0, 0.0, 0.0], None)
  """
  spec = get_advantage_estimator(name)
  hp = {**spec.defaults, **hparams}
  params = inspect.signature(spec.fn).parameters
  missing = [k for k in spec.hparams if k not in hp] + [
      k for k in spec.static
      if k not in static and params[k].default is inspect.Parameter.empty]
  if missing:
    raise ValueError(f"advantage estimator {name!r} reads {missing}, which were not "
                     "given.")
  unknown = sorted(set(static) - set(spec.static))
  if unknown:
    raise ValueError(f"advantage estimator {name!r} takes no static {unknown} (it "
                     f"reads {list(spec.static)}).")
  return spec.fn(inputs, hp, **static)


__all__ = ["AdvantageInputs", "AdvantageEstimatorSpec", "PolicyLossSpec",
           "ADVANTAGE_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY", "CLIP_OPTIONS",
           "DEFAULT_CLIP_LOW",
           "register_policy_loss", "register_advantage_estimator", "get_policy_loss",
           "get_advantage_estimator", "compute_advantages"]


def _lookup(registry: dict, argument: str, name: str) -> Any:
  """``registry[name]``, or a ValueError naming ``argument`` and the choices."""
  if name not in registry:
    raise ValueError(f"`{argument}` must be one of {sorted(registry)}, got {name!r}.")
  return registry[name]
