r"""Device-axis helpers for ``jax.pmap`` programs: replicate a state, split a batch.

State and batch of a pmapped step (``make_pmap_train_step`` of the train package) carry
a leading device axis: :func:`replicate` the state, :func:`split_batch` the batch,
:func:`unreplicate` to read results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def replicate(tree: Any, devices: Sequence[jax.Device] | None = None, *,
              axis_name: str = "data") -> Any:
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


def unreplicate(tree: Any) -> Any:
  """The copy on the first device of every leaf (drops the leading device axis)."""
  return jax.tree_util.tree_map(lambda x: x[0], tree)


def split_batch(batch: Any, num_devices: int | None = None) -> Any:
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


__all__ = ["replicate", "unreplicate", "split_batch"]
