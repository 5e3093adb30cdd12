"""The train state pytree and its initialisation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm.control import (
  AdaptiveClipState,
  AdaptiveKLState,
  adaptive_clip_init,
  adaptive_kl_init,
)
from jaxrl_llm.train.config import TrainConfig


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


def trainable_mask(params: Any, trainable: Callable[[Any], Any]) -> Any:
  """``trainable(params)``, checked: a pytree of bools (Python or NumPy ``bool``) whose
  structure is a prefix of ``params``; raises a one-line ``ValueError`` naming
  ``trainable`` otherwise. A mask read by truthiness would train a part marked
  ``"no"`` or ``0.5`` (a frozen LoRA base).

  Examples:
    >>> trainable_mask({"a": 1.0, "b": 2.0}, lambda p: {"a": True, "b": False})
    {'a': True, 'b': False}
    >>> trainable_mask({"a": 1.0}, lambda p: {"a": "no"})
    Traceback (most recent call last):
    ...
    ValueError: `trainable(params)` must hold bools, got str 'no' at ['a'].
  """
  mask = trainable(params)
  for path, leaf in jax.tree_util.tree_leaves_with_path(mask):
    if not isinstance(leaf, (bool, np.bool_)):
      shown = (f"{type(leaf).__name__} of shape {np.shape(leaf)}" if np.ndim(leaf)
               else f"{type(leaf).__name__} {leaf!r}")
      raise ValueError(f"`trainable(params)` must hold bools, got {shown} at "
                       f"{jax.tree_util.keystr(path) or 'the root'}.")
  where = _structure_mismatch(mask, params, ())
  if where is not None:
    raise ValueError(f"`trainable(params)` must have a prefix of the structure of "
                     f"`params`: {where}.")
  return mask


def _children(tree: Any) -> tuple[str, list]:
  """``(kind, [(key, child), ...])`` one level down a pytree (no children: a leaf)."""
  if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(tree)) and tree is not None:
    return type(tree).__name__, []
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
  return type(tree).__name__, [(path[0], child) for path, child in flat]


def _structure_mismatch(mask: Any, params: Any, path: tuple) -> str | None:
  """Where ``mask`` (bools at its leaves) stops being a prefix of ``params``."""
  if isinstance(mask, (bool, np.bool_)):
    return None
  (mask_kind, mask_kids), (kind, kids) = _children(mask), _children(params)
  keys = [jax.tree_util.keystr((k,)) for k, _ in mask_kids]
  want = [jax.tree_util.keystr((k,)) for k, _ in kids]
  if mask_kind != kind or keys != want:
    return (f"at {jax.tree_util.keystr(path) or 'the root'} it has a {mask_kind} with "
            f"children {' '.join(keys) or '(none)'} where `params` has a {kind} with "
            f"children {' '.join(want) or '(none)'}")
  for (key, m), (_, p) in zip(mask_kids, kids):
    found = _structure_mismatch(m, p, path + (key,))
    if found is not None:
      return found
  return None


def split_trainable(params: Any, trainable: Callable[[Any], Any] | None
                    ) -> tuple[Any, Any, Any]:
  """``(mask, train, frozen)``: ``params`` split by ``trainable(params)``, a pytree of
  bools that is a prefix of ``params`` (e.g. :func:`jaxrl_llm.models.lora.lora_trainable`).

  ``train`` keeps the marked subtrees (None elsewhere), ``frozen`` the others;
  :func:`merge_trainable` puts them back. ``trainable=None``: everything is trained
  (``mask`` and ``frozen`` are None, ``train`` is ``params``).

  Examples:
    >>> mask, train, frozen = split_trainable({"a": 1.0, "b": 2.0},
    ...                                       lambda p: {"a": True, "b": False})
    >>> train, frozen, merge_trainable(mask, train, frozen)
    ({'a': 1.0, 'b': None}, {'a': None, 'b': 2.0}, {'a': 1.0, 'b': 2.0})
  """
  if trainable is None:
    return None, params, None
  mask = trainable_mask(params, trainable)
  train = jax.tree_util.tree_map(lambda m, p: p if m else None, mask, params)
  frozen = jax.tree_util.tree_map(lambda m, p: None if m else p, mask, params)
  return mask, train, frozen


def merge_trainable(mask: Any, train: Any, frozen: Any) -> Any:
  """The inverse of :func:`split_trainable`."""
  if mask is None:
    return train
  return jax.tree_util.tree_map(lambda m, t, f: t if m else f, mask, train, frozen,
                                is_leaf=lambda x: x is None)


def init_train_state(params: Any, optimizer: optax.GradientTransformation,
                     config: TrainConfig, rng: jax.Array | None = None, *,
                     trainable: Callable[[Any], Any] | None = None) -> TrainState:
  """Builds the initial :class:`TrainState` for ``params``.

  ``trainable``: as in :func:`jaxrl_llm.train.make_train_step` (the optimizer state
  then covers the trainable parameters alone, e.g. LoRA adapters).

  Use the same ``config`` (and optimizer) as the train step; ``step.init(params)`` of a
  step from :func:`jaxrl_llm.train.make_train_step` does exactly that.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> state = init_train_state({"w": jnp.zeros(2)}, optax.sgd(0.1), TrainConfig())
    >>> int(state.step), sorted(state.hparams)[:3]
    (0, ['clip_low', 'entropy_coef', 'gamma'])
  """
  if rng is None:
    rng = jax.random.PRNGKey(0)
  clip_kwargs = {} if config.adaptive_clip_target is None else {
      "target": config.adaptive_clip_target}
  return TrainState(
      params=params,
      opt_state=optimizer.init(split_trainable(params, trainable)[1]),
      step=jnp.zeros((), jnp.int32),
      hparams=config.hparams(),
      kl_ctrl=adaptive_kl_init(max(config.kl_coef, 1e-8), target=config.kl_target,
                               horizon=config.kl_horizon),
      # The controller's epsilon lives in [clip_min, clip_max] (adaptive_clip_init
      # rejects a start outside it); a loss's own clip_low (GSPO 3e-4) may not.
      clip_ctrl=adaptive_clip_init(min(max(config.clip_range()[0], config.clip_min),
                                       config.clip_max),
                                   eps_min=config.clip_min, eps_max=config.clip_max,
                                   metric=config.adaptive_clip_metric, **clip_kwargs),
      rng=jnp.asarray(rng, jnp.uint32),
  )
