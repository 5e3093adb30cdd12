"""Device meshes with the library's four named axes.

Every mesh built here has the axes ``("data", "fsdp", "tensor", "sequence")``:

* ``data``: pure data parallelism (parameters replicated, batch rows split);
* ``fsdp``: batch rows split *and* parameters split along their ``embed`` dimension
  (ZeRO-3 / fully-sharded data parallelism; XLA all-gathers weights before use);
* ``tensor``: Megatron-style tensor parallelism over heads, MLP width and vocabulary;
* ``sequence``: the token axis of the batch (sequence-parallel GAE and log-probs).

Axes of size 1 cost nothing, so every layout is one ``make_mesh`` call and the sharding
rules (:mod:`jaxrl_llm.parallel.sharding`) never need to know which axes are "on".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor", "sequence")


def _resolve_sizes(sizes: dict, n_devices: int) -> tuple[int, ...]:
  """Replaces the (single) ``-1`` by the devices left; checks the product."""
  for name, size in sizes.items():
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (
        size < 1 and size != -1):
      raise ValueError(f"mesh axis `{name}` must be a positive int or -1, got {size!r}.")
  free = [name for name, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {free} ({sizes}).")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if n_devices % fixed:
      raise ValueError(
          f"mesh axes {sizes}: the fixed sizes multiply to {fixed}, which does not "
          f"divide the {n_devices} devices, so `{free[0]}=-1` has no integer size.")
    sizes = {**sizes, free[0]: n_devices // fixed}
  total = math.prod(sizes.values())
  if total != n_devices:
    raise ValueError(
        f"mesh axes {sizes} multiply to {total} but there are {n_devices} devices; "
        "make the sizes multiply to the device count (or use -1 for one axis).")
  return tuple(int(sizes[name]) for name in MESH_AXES)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, sequence: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  r"""A :class:`jax.sharding.Mesh` with axes ``("data", "fsdp", "tensor", "sequence")``.

  The sizes must multiply to the number of devices:
  :math:`|data| \cdot |fsdp| \cdot |tensor| \cdot |sequence| = n_{devices}`; one axis
  may be ``-1`` ("the devices left"). With ``devices=None`` the mesh spans every
  device of every process (``jax.devices()``) laid out by :func:`jax.make_mesh`, which
  puts the fastest interconnect on the last axes; a given device list is reshaped in
  order. The axes are ``AxisType.Auto``: XLA's sharding propagation (GSPMD) decides
  the layouts of intermediates, as the train-step wrappers expect.

  Args:
    data: size of the pure data-parallel axis (``-1``: the devices left).
    fsdp: size of the fully-sharded data-parallel axis.
    tensor: size of the tensor-parallel axis.
    sequence: size of the sequence-parallel axis.
    devices: optional explicit devices (e.g. ``jax.local_devices()``).

  Returns:
    The mesh.

  Raises:
    ValueError: if a size is not a positive int (or -1), or the sizes do not multiply
      to the device count.

  Examples:
    >>> mesh = make_mesh(data=-1)
    >>> mesh.axis_names
    ('data', 'fsdp', 'tensor', 'sequence')
    >>> dict(mesh.shape)["data"] == len(jax.devices())
    True
  """
  sizes = dict(data=data, fsdp=fsdp, tensor=tensor, sequence=sequence)
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if devices is None:
    shape = _resolve_sizes(sizes, jax.device_count())
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
  devices = list(devices)
  shape = _resolve_sizes(sizes, len(devices))
  return Mesh(np.array(devices, dtype=object).reshape(shape), MESH_AXES,
              axis_types=axis_types)


def mesh_axis_sizes(mesh: Mesh | AbstractMesh) -> dict:
  """``{axis name: size}`` of a :class:`Mesh` or ``AbstractMesh``."""
  return {name: int(size) for name, size in dict(mesh.shape).items()}
