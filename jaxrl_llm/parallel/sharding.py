r"""Sharding rules: logical axis names to mesh axes, for parameters, states and batches.

Parameters carry *logical* axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``; the reference transformer's parameters carry them); a *rules* table maps
each logical name to mesh axes, so a layout is a table, never a per-parameter list:

==============  ====================  ===============================================
logical name    default mesh axes     effect
==============  ====================  ===============================================
``batch``       ``("data", "fsdp")``  batch rows split over data x fsdp devices
``sequence``    ``"sequence"``        token axis of batch arrays (if that axis > 1)
``embed``       ``"fsdp"``            ZeRO-3: every weight split along its width D
``vocab``       ``"tensor"``          embedding / LM head split over the vocabulary
``heads``       ``"tensor"``          attention split by query heads (Megatron)
``kv_heads``    ``"tensor"``          ... and by key/value heads
``mlp``         ``"tensor"``          MLP split along its hidden width F
``head_dim``    ``None``              replicated
==============  ====================  ===============================================

A parameter dimension whose size does not divide the product of its mesh axes raises
``ValueError`` naming the parameter path, the dimension and the axes: a layout is
never silently replicated. Mesh axes of size 1 are dropped from the specs (and so never
fail a divisibility check); library axes absent from a foreign mesh count as size 1.

The optimizer state mirrors the parameters: every state leaf whose key path *ends
with* a parameter's key path and has its shape (Adam's ``mu``/``nu``, momentum, ...)
gets that parameter's sharding; the rest (step counts, hyperparameters, controller
states, the PRNG key) is replicated.

The sharded train step built on these rules (``jax.jit`` with parameter, state and
batch shardings) is ``shard_train_step`` of the train package (``train/sharded.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.parallel.mesh import MESH_AXES, mesh_axis_sizes

AxisRule = None | str | Sequence[str]
# Rule overrides: a dict, or ``(logical name, axes)`` pairs (see make_rules).
Rules = Mapping[str, AxisRule] | Sequence[tuple[str, AxisRule]]
MeshLike = Mesh | AbstractMesh

DEFAULT_RULES: Mapping[str, AxisRule] = {
    "batch": ("data", "fsdp"),
    "sequence": "sequence",
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
}


# ------------------------------------------------------------------------------ rules


def make_rules(rules: Rules | None = None) -> dict:
  """:data:`DEFAULT_RULES` updated with ``rules`` (a dict or ``(name, axes)`` pairs).

  Each value is ``None`` (replicate), a mesh axis name, or a tuple of mesh axis names
  (the dimension is split over their product, major to minor). Returns a new dict with
  tuple values.

  Examples:
    >>> make_rules({"embed": None})["embed"], make_rules()["batch"]
    ((), ('data', 'fsdp'))
  """
  merged = dict(DEFAULT_RULES)
  if rules is not None:
    merged.update(dict(rules.items() if isinstance(rules, Mapping) else rules))
  out: dict[str, tuple] = {}
  for name, axes in merged.items():
    if axes is None:
      out[name] = ()
    elif isinstance(axes, str):
      out[name] = (axes,)
    else:
      if not isinstance(axes, Sequence) or not all(isinstance(a, str) for a in axes):
        raise ValueError(f"rule for logical axis {name!r} must be None, a mesh axis name "
                         f"or a tuple of names, got {axes!r}.")
      out[name] = tuple(axes)
  return out


def _mesh_axes(name, rule_axes, sizes, where):
  """The mesh axes of size > 1 that logical axis ``name`` maps to."""
  axes = []
  for axis in rule_axes:
    if axis not in sizes:
      if axis in MESH_AXES:   # a library axis the (foreign) mesh lacks: size 1
        continue
      raise ValueError(f"{where}: rule {name!r} -> {axis!r} names a mesh axis that is "
                       f"not in the mesh {tuple(sizes)}.")
    if sizes[axis] > 1:
      axes.append(axis)
  return tuple(axes)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: MeshLike,
                    rules: Rules | None = None, *, where: str = "array") -> PartitionSpec:
  r"""The mesh :class:`PartitionSpec` of an array with logical axis ``names``.

  Dimension ``i`` with logical name ``n_i`` is split over the mesh axes
  ``rules[n_i]`` (those of size > 1); it must be divisible by their product
  :math:`\prod_{a \in rules[n_i]} |a|`.

  Args:
    names: one logical name (or ``None``) per dimension, e.g. ``("vocab", "embed")``.
    shape: the array's shape.
    mesh: a ``Mesh`` or ``AbstractMesh``.
    rules: rule overrides (see :func:`make_rules`) or an already merged table.
    where: what to call the array in error messages (a parameter path).

  Raises:
    ValueError: unknown logical name, rank mismatch, a mesh axis used twice, or a
      dimension not divisible by its mesh axes (naming ``where``, the dimension and the
      axes).

  Examples:
    >>> mesh = jax.sharding.AbstractMesh((2, 4, 1, 1),
    ...                                  ("data", "fsdp", "tensor", "sequence"))
    >>> logical_to_spec(("vocab", "embed"), (32, 64), mesh)
    P(None, 'fsdp')
  """
  rules = make_rules(rules)
  sizes = mesh_axis_sizes(mesh)
  names = tuple(names)
  shape = tuple(shape)
  if len(names) != len(shape):
    raise ValueError(f"{where}: {len(names)} logical axis names {names} for an array of "
                     f"shape {shape} (rank {len(shape)}).")
  used: dict = {}
  parts: list = []
  for dim, (name, size) in enumerate(zip(names, shape)):
    if name is None:
      parts.append(None)
      continue
    if name not in rules:
      raise ValueError(
          f"{where}: logical axis {name!r} (dimension {dim}) has no sharding rule; "
          f"known names {sorted(rules)}. Pass rules={{{name!r}: ...}}.")
    axes = _mesh_axes(name, rules[name], sizes, where)
    total = math.prod(sizes[a] for a in axes)
    if size % total:
      raise ValueError(
          f"{where}: dimension {dim} ({name!r}, size {size}) is not divisible by mesh "
          f"axis {axes if len(axes) > 1 else axes[0]!r} of size {total}. Change the "
          f"mesh, the model size, or the rule for {name!r}.")
    for axis in axes:
      if axis in used:
        raise ValueError(f"{where}: mesh axis {axis!r} is used by dimension {used[axis]} "
                         f"and dimension {dim} (logical axes {names}); a mesh axis may "
                         "split only one dimension of an array.")
      used[axis] = dim
    parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*parts)


def _keystr(path) -> str:
  return jax.tree_util.keystr(tuple(path))


# ------------------------------------------------------------------------ parameters


def _logical_names(params, logical_specs):
  """Per-leaf logical names: ``logical_specs`` or the parameters' ``nnx`` metadata."""
  if logical_specs is None:
    logical_specs = nnx.get_partition_spec(params)
  is_spec = lambda x: isinstance(x, (PartitionSpec, tuple)) or x is None
  leaves = jax.tree_util.tree_leaves(logical_specs, is_leaf=is_spec)
  return [() if s is None else tuple(s) for s in leaves]


def param_specs(params: Any, mesh: MeshLike, rules: Rules | None = None, *,
                logical_specs: Any = None) -> Any:
  """Mesh ``PartitionSpec`` of every parameter, from its logical axis names.

  Args:
    params: the parameter pytree (e.g. the ``nnx.State`` of :func:`split_model`).
    mesh: a ``Mesh`` or ``AbstractMesh``.
    rules: rule overrides (see :func:`make_rules`).
    logical_specs: optional pytree (structure of ``params``) of logical names per
      leaf (``PartitionSpec("vocab", "embed")`` or tuples); default
      ``nnx.get_partition_spec(params)``. A leaf without names (``P()``) is
      replicated.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``params``.

  Raises:
    ValueError: see :func:`logical_to_spec`; the message names the parameter path.
  """
  rules = make_rules(rules)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = _logical_names(params, logical_specs)
  if len(names) != len(flat):
    raise ValueError(
        f"`logical_specs` has {len(names)} leaves, `params` has {len(flat)}.")
  specs = []
  for (path, leaf), leaf_names in zip(flat, names):
    shape = np.shape(leaf)
    if not leaf_names:
      specs.append(PartitionSpec())
      continue
    specs.append(logical_to_spec(leaf_names, shape, mesh, rules,
                                 where=f"parameter {_keystr(path)!r}"))
  return jax.tree_util.tree_unflatten(treedef, specs)


def _named(mesh, specs):
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(params: Any, mesh: MeshLike, rules: Rules | None = None, *,
                    logical_specs: Any = None) -> Any:
  """:class:`NamedSharding` of every parameter (:func:`param_specs` on ``mesh``).

  Examples:
    >>> from jaxrl_llm.parallel.mesh import make_mesh
    >>> params = {"embed": np.zeros((32, 8)), "w_up": np.zeros((8, 16))}
    >>> logical = {"embed": PartitionSpec("vocab", "embed"),   # what nnx.Param metadata
    ...            "w_up": PartitionSpec("embed", "mlp")}      # of the model gives
    >>> shardings = param_shardings(params, make_mesh(), logical_specs=logical)
    >>> shardings["embed"].spec, shardings["w_up"].spec     # one device: replicated
    (P(None, None), P(None, None))
  """
  return _named(mesh, param_specs(params, mesh, rules, logical_specs=logical_specs))


def _spec_like_params(tree, params, specs):
  """Specs for ``tree``: a param's spec where a leaf's key path ends with the param's
  key path and the shapes agree, ``P()`` elsewhere."""
  index = {}
  for (path, leaf), spec in zip(
      jax.tree_util.tree_flatten_with_path(params)[0],
      jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
    index[tuple(str(k) for k in path)] = (np.shape(leaf), spec)
  lengths = sorted({len(k) for k in index}, reverse=True)

  def one(path, leaf):
    keys = tuple(str(k) for k in path)
    for n in lengths:
      if n > len(keys):
        continue
      hit = index.get(keys[len(keys) - n:])
      if hit is not None and hit[0] == np.shape(leaf):
        return hit[1]
    return PartitionSpec()

  return jax.tree_util.tree_map_with_path(one, tree)


def state_specs(state: Any, mesh: MeshLike, rules: Rules | None = None, *, params: Any = None,
                logical_specs: Any = None) -> Any:
  """``PartitionSpec`` of every leaf of a train state (any pytree holding params).

  ``state.params`` (or ``params``) get :func:`param_specs`; every other leaf whose key
  path ends with a parameter's key path and has its shape (optimizer moments, EMA
  copies) gets that parameter's spec; everything else is replicated (``P()``).

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``state``.
  """
  params = state.params if params is None else params
  specs = param_specs(params, mesh, rules, logical_specs=logical_specs)
  return _spec_like_params(state, params, specs)


def state_shardings(state: Any, mesh: MeshLike, rules: Rules | None = None, *, params: Any = None,
                    logical_specs: Any = None) -> Any:
  """:class:`NamedSharding` of every leaf of a train state (see :func:`state_specs`).

  Examples:
    >>> import optax
    >>> from jaxrl_llm.parallel.mesh import make_mesh
    >>> params = {"w_up": np.zeros((8, 16))}
    >>> state = {"params": params, "opt_state": optax.adam(1e-3).init(params),
    ...          "step": np.zeros((), np.int32)}
    >>> shardings = state_shardings(state, make_mesh(), params=params,
    ...                             logical_specs={"w_up": PartitionSpec("embed", "mlp")})
    >>> shardings["opt_state"][0].mu["w_up"].spec, shardings["step"].spec
    (P(None, None), P())
  """
  return _named(mesh, state_specs(state, mesh, rules, params=params,
                                  logical_specs=logical_specs))


# ----------------------------------------------------------------------------- batches


def batch_spec(shape: Sequence[int], mesh: MeshLike, rules: Rules | None = None, *,
               where: str = "batch array") -> PartitionSpec:
  """Spec of a batch array: dimension 0 is ``batch``, dimension 1 ``sequence``.

  Further dimensions are replicated. ``shape`` is the *global* shape.
  """
  names = ("batch", "sequence", *([None] * max(len(shape) - 2, 0)))[:len(shape)]
  return logical_to_spec(names, shape, mesh, rules, where=where)


def batch_specs(batch: Any, mesh: MeshLike, rules: Rules | None = None) -> Any:
  """``PartitionSpec`` of every array of a (global) batch dict: rows over
  ``rules["batch"]``, tokens over ``rules["sequence"]``.

  Raises:
    ValueError: a dimension not divisible by its mesh axes, naming the batch key.
  """
  rules = make_rules(rules)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: batch_spec(np.shape(x), mesh, rules,
                                 where=f"batch{_keystr(path)}"), batch)


def batch_shardings(batch: Any, mesh: MeshLike, rules: Rules | None = None) -> Any:
  """:class:`NamedSharding` of every array of a (global) batch (:func:`batch_specs`)."""
  return _named(mesh, batch_specs(batch, mesh, rules))


def _spec_axes(part):
  return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def _process_shard_counts(mesh, spec, ndim):
  """Per dimension: (number of shards, number of them held by this process)."""
  devices = mesh.devices
  pid = jax.process_index()
  local = np.vectorize(lambda d: d.process_index == pid, otypes=[bool])(devices)
  coords = np.argwhere(local)
  names = list(mesh.axis_names)
  parts = list(spec) + [None] * (ndim - len(spec))
  counts = []
  for part in parts:
    idx = [names.index(a) for a in _spec_axes(part)]
    if not idx:
      counts.append((1, 1))
      continue
    total = math.prod(devices.shape[i] for i in idx)
    held = len({tuple(c[idx]) for c in coords})
    counts.append((total, held))
  return counts


def shard_batch(batch: Any, mesh: MeshLike, rules: Rules | None = None) -> Any:
  """Places a host batch on ``mesh`` as global ``jax.Array`` s, multi-host ready.

  Each process passes *its own rows* (its slice of the global batch, e.g. from
  :func:`host_local_batch` or its own data loader);
  ``jax.make_array_from_process_local_data`` assembles the global arrays without any
  cross-host transfer. In a single process the local batch is the global batch.

  Args:
    batch: dict (pytree) of host arrays ``[B_local, L, ...]``.
    mesh: the mesh.
    rules: rule overrides (``batch``/``sequence`` entries).

  Returns:
    The batch as global arrays sharded by :func:`batch_specs`.

  Raises:
    ValueError: if a local dimension is not divisible by the number of shards this
      process holds (naming the key, the dimension and the mesh axes).

  Examples:
    >>> import numpy as np
    >>> from jaxrl_llm.parallel.mesh import make_mesh
    >>> out = shard_batch({"tokens": np.zeros((8, 6), np.int32)}, make_mesh())
    >>> out["tokens"].shape
    (8, 6)
  """
  rules = make_rules(rules)

  def one(path, x):
    x = np.asarray(x)
    where = f"batch{_keystr(path)}"
    names = ("batch", "sequence", *([None] * max(x.ndim - 2, 0)))[:x.ndim]
    # The spec of the global array: axes of size > 1 only (divisibility checked below).
    spec = logical_to_spec(names, (0,) * x.ndim, mesh, rules, where=where)
    global_shape = []
    for dim, ((total, held), size) in enumerate(
        zip(_process_shard_counts(mesh, spec, x.ndim), x.shape)):
      if size % held:
        raise ValueError(
            f"{where}: dimension {dim} has {size} local entries (shape {x.shape}), not "
            f"divisible by the {held} shards of mesh axis {spec[dim]!r} this process "
            "holds.")
      global_shape.append(size // held * total)
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_process_local_data(sharding, x, tuple(global_shape))

  return jax.tree_util.tree_map_with_path(one, batch)


def host_local_batch(batch: Any, mesh: MeshLike, rules: Rules | None = None) -> Any:
  """The part of a *global* host batch that this process feeds to :func:`shard_batch`.

  For every array, the bounding box of the index ranges of this process's devices
  under :func:`batch_specs` (its rows, and its columns when the sequence is sharded).
  The whole batch in a single process.
  """

  def one(path, x):
    x = np.asarray(x)
    spec = batch_spec(x.shape, mesh, rules, where=f"batch{_keystr(path)}")
    index_map = NamedSharding(mesh, spec).addressable_devices_indices_map(x.shape)
    box = []
    for dim in range(x.ndim):
      # A NamedSharding indexes every addressable device (typed Optional for others).
      starts = [idx[dim].indices(x.shape[dim])[0]  # type: ignore[index]
                for idx in index_map.values()]
      stops = [idx[dim].indices(x.shape[dim])[1]  # type: ignore[index]
               for idx in index_map.values()]
      box.append(slice(min(starts), max(stops)))
    return x[tuple(box)]

  return jax.tree_util.tree_map_with_path(one, batch)


# ------------------------------------------------------------------------ ambient mesh


def ambient_mesh(mesh: MeshLike, *arrays: Any) -> contextlib.AbstractContextManager:
  """A context making ``mesh`` the ambient mesh when it has a ``sequence`` axis > 1.

  Under it ``jax.sharding.get_abstract_mesh()`` is ``mesh`` and
  :func:`jaxrl_llm.dot_product_attention` (``implementation=None``) uses ring
  attention over the ``sequence`` axis. While tracing (any of ``arrays`` is a tracer)
  it is ``jax.sharding.use_abstract_mesh``; on concrete arrays ``jax.set_mesh`` (which
  JAX forbids inside ``jax.jit``). With no ``sequence`` axis > 1 it does nothing.

  Examples:
    >>> from jaxrl_llm.parallel.mesh import make_mesh
    >>> with ambient_mesh(make_mesh()):
    ...   jax.sharding.get_abstract_mesh().empty
    True
  """
  if mesh_axis_sizes(mesh).get("sequence", 1) <= 1:
    return contextlib.nullcontext()
  tracing = any(isinstance(x, jax.core.Tracer)
                for x in jax.tree_util.tree_leaves(arrays))
  if tracing or not isinstance(mesh, Mesh):
    # A Mesh gives its abstract_mesh, an AbstractMesh itself (getattr is typed loosely).
    return jax.sharding.use_abstract_mesh(
        getattr(mesh, "abstract_mesh", mesh))  # type: ignore[arg-type]
  return jax.set_mesh(mesh)


# ------------------------------------------------------------------------- placement


def put_sharded(tree: Any, shardings: Any) -> Any:
  """Places every leaf of ``tree`` with its sharding; works across processes.

  In one process this is ``jax.device_put``. With several processes each leaf is
  built from the (identical) host value on every process with
  ``jax.make_array_from_callback``, so no cross-host transfer is needed; leaves that
  already are global arrays are resharded with ``jax.device_put``.
  """
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, sharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

  return jax.tree_util.tree_map(one, tree, shardings)


def sharding_summary(tree: Any) -> dict:
  """``{key path: str(spec)}`` of the ``NamedSharding`` s of a pytree of arrays."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    sharding = getattr(x, "sharding", x)
    out[_keystr(path)] = str(getattr(sharding, "spec", sharding))
  return out


__all__ = ["DEFAULT_RULES", "make_rules", "logical_to_spec", "param_specs",
           "param_shardings", "state_specs", "state_shardings", "batch_spec",
           "batch_specs", "batch_shardings", "shard_batch", "host_local_batch",
           "put_sharded", "sharding_summary", "ambient_mesh"]
