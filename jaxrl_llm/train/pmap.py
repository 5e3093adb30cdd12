r"""``jax.pmap`` train steps for users of the per-device programming model.

A pmapped step runs :func:`jaxrl_llm.train.make_train_step` built with ``axis_name``
on every local device, each with its own ``B / n`` rows; loss denominators, gradients,
metrics and whitening statistics are ``psum``-reduced over the axis, so every device
applies the update one device would compute on the whole batch (with
``num_minibatches > 1`` the minibatch shuffle is per device, so minibatches differ
from a single-device run; with one minibatch the update is the same).

State and batch carry a leading device axis: :func:`~jaxrl_llm.parallel.replicate`
the state, :func:`~jaxrl_llm.parallel.split_batch` the batch,
:func:`~jaxrl_llm.parallel.unreplicate` to read results. For new code
prefer :func:`jaxrl_llm.train.shard_train_step` (``jax.jit`` with shardings), which
also shards parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import optax

from jaxrl_llm.train.step import make_train_step

if TYPE_CHECKING:
  from jaxrl_llm.train import TrainConfig


def make_pmap_train_step(apply_fn: Callable, optimizer: optax.GradientTransformation,
                         config: TrainConfig, *, axis_name: str = "data",
                         devices: Sequence[jax.Device] | None = None,
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
    >>> from jaxrl_llm.parallel import replicate, split_batch, unreplicate
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


__all__ = ["make_pmap_train_step"]
