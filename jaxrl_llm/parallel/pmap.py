r"""``jax.pmap`` train steps for users of the per-device programming model.

A pmapped step runs :func:`jaxrl_llm.train.make_train_step` built with ``axis_name``
on every local device, each with its own ``B / n`` rows; loss denominators, gradients,
metrics and whitening statistics are ``psum``-reduced over the axis, so every device
applies the update one device would compute on the whole batch (with
``num_minibatches > 1`` the minibatch shuffle is per device, so minibatches differ
from a single-device run; with one minibatch the update is the same).

State and batch carry a leading device axis: :func:`replicate` the state,
:func:`split_batch` the batch, :func:`unreplicate` to read results. For new code
prefer :func:`jaxrl_llm.parallel.shard_train_step` (``jax.jit`` with shardings), which
also shards parameters.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.train.state import TrainConfig
from jaxrl_llm.train.step import make_train_step


def make_pmap_train_step(apply_fn: Callable, optimizer: optax.GradientTransformation,
                         config: TrainConfig, *, axis_name: str = "data",
                         devices: Optional[Sequence[jax.Device]] = None,
                         donate: bool = True) -> Callable:
  """A ``jax.pmap`` ped ``train_step(state, batch) -> (state, metrics)``.

  Args:
    apply_fn: the model's pure forward (see :func:`jaxrl_llm.train.make_train_step`).
    optimizer: an optax transformation.
    config: the :class:`~jaxrl_llm.train.TrainConfig`.
    axis_name: the pmap axis name the step reduces over.
    devices: the devices to map over (default: all local devices).
    donate: donate the state buffers.

  Returns:
    The pmapped step; inputs and outputs have a leading axis of size
    ``len(devices)`` (metrics are identical across it).

  Examples:
    >>> import numpy as np, optax
    >>> from flax import nnx
    >>> from jaxrl_llm.models.transformer import (Transformer, TransformerConfig,
    ...                                           make_apply_fn, split_model)
    >>> from jaxrl_llm.train import TrainConfig, init_train_state
    >>> graphdef, params = split_model(
    ...     Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
    >>> opt, config = optax.sgd(1e-2), TrainConfig()
    >>> step = make_pmap_train_step(make_apply_fn(graphdef), opt, config)
    >>> state = replicate(init_train_state(params, opt, config))
    >>> n = jax.local_device_count()
    >>> ones = np.ones((2 * n, 8), np.float32)
    >>> batch = split_batch(dict(tokens=ones.astype(np.int32), attention_mask=ones,
    ...     loss_mask=ones, old_logp=0 * ones, old_values=0 * ones, rewards=ones))
    >>> state, metrics = step(state, batch)
    >>> int(unreplicate(state).step)
    1
  """
  step = make_train_step(apply_fn, optimizer, config, axis_name=axis_name)
  return jax.pmap(step, axis_name=axis_name, devices=devices,
                  donate_argnums=(0,) if donate else ())


def replicate(tree, devices: Optional[Sequence[jax.Device]] = None, *,
              axis_name: str = "data"):
  """Copies every leaf onto each device: leaves get a leading axis ``len(devices)``.

  The replacement of the deprecated ``jax.device_put_replicated``: the stacked copies
  are placed one per device with ``NamedSharding(Mesh(devices, (axis_name,)),
  P(axis_name))``, the layout a ``jax.pmap`` over ``axis_name`` returns its outputs
  in, so the second call of the step sees the same input layout and does not
  recompile. Pass the step's ``axis_name``.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  mesh = Mesh(np.array(devices, dtype=object), (axis_name,))
  sharding = NamedSharding(mesh, PartitionSpec(axis_name))

  def one(x):
    host = np.asarray(x)
    stacked = np.broadcast_to(host[None], (len(devices),) + host.shape)
    return jax.device_put(stacked, sharding)

  return jax.tree_util.tree_map(one, tree)


def unreplicate(tree):
  """The copy on the first device of every leaf (drops the leading device axis)."""
  return jax.tree_util.tree_map(lambda x: x[0], tree)


def split_batch(batch, num_devices: Optional[int] = None):
  """Reshapes every ``[B, ...]`` array to ``[n, B / n, ...]`` for a pmapped step.

  Device ``i`` gets rows ``i * B/n .. (i+1) * B/n - 1``.

  Raises:
    ValueError: if ``B`` is not divisible by ``n`` (naming the key).
  """
  n = jax.local_device_count() if num_devices is None else int(num_devices)

  def one(path, x):
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[0] % n:
      raise ValueError(f"batch{jax.tree_util.keystr(tuple(path))} has shape {x.shape}; "
                       f"its leading (batch) dimension must be divisible by the {n} "
                       "devices.")
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])

  return jax.tree_util.tree_map_with_path(one, batch)


__all__ = ["make_pmap_train_step", "replicate", "unreplicate", "split_batch"]
