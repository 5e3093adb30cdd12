r"""Sequence parallelism: GAE and token log-probs with the token axis split over devices.

With a ``sequence`` mesh axis of size :math:`n`, every ``[B, T]`` array is split into
:math:`n` contiguous chunks of :math:`T / n` tokens, one per device (``jax.shard_map``).

**GAE.** :func:`jaxrl_llm.gae` with transparent masks is two reverse affine
recurrences :math:`x_t = d_t + c_t x_{t+1}`: the next valid value
:math:`y` (:math:`c = 1 - m`, :math:`d = m V`, :math:`x_T =` bootstrap) and then the
advantage (:math:`c = m\gamma\lambda + 1 - m`, :math:`d = m\delta`, :math:`x_T = 0`).
Over a chunk :math:`[s, e)` the solution is affine in the value entering from the right,

.. math::

  x_t = P_t + H_t\, x_e, \qquad P_t = d_t + c_t P_{t+1},\ P_e = 0, \qquad
  H_t = c_t H_{t+1},\ H_e = 1,

so each device solves its chunk locally with :math:`x_e = 0` and :math:`x_e = 1`
(one recurrence on ``[2B]`` rows), all-gathers the chunk maps
:math:`(C_k, D_k) = (H_{s_k}, P_{s_k})` (:math:`2B` floats per device), runs the
exclusive reverse composition

.. math::

  x_{e_{n-1}} = x_T, \qquad x_{e_{k}} = D_{k+1} + C_{k+1}\, x_{e_{k+1}}

over the :math:`n` chunks (O(n) scalar work per row), and applies its own carry-in
:math:`x_{e_k}`. The next-valid value after a chunk's last token is exactly the
carry-in of the first recurrence, so no neighbour exchange (``ppermute``) is needed.
Communication: two all-gathers of ``[n, 2B]`` floats, independent of :math:`T`.

**Log-probs.** :func:`jaxrl_llm.token_logprobs_from_hidden` is per token, so each
device computes its chunk; the LM head is replicated and its gradient (a sum over
tokens) is ``psum``-reduced over the sequence (and batch) axes: ``shard_map``'s
transpose sums the cotangent of a replicated input over the devices (the body runs
with ``check_vma=False`` because the chunked log-prob backward starts its scan from
fresh zero accumulators).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jax.typing import ArrayLike

from jaxrl_llm import _validate as v
from jaxrl_llm.advantages import GAE_METHODS, reverse_linear_recurrence
from jaxrl_llm.logprobs import token_logprobs_from_hidden
from jaxrl_llm.parallel.mesh import mesh_axis_sizes


def _chunk_maps(coeffs, inputs, method):
  """``(P, H)`` of a chunk: ``x_t = P_t + H_t x_e`` for the value ``x_e`` after it."""
  b = coeffs.shape[0]
  # full_like keeps the device-varying type of the chunk (shard_map's scan carries).
  first = inputs[:, 0]
  both = reverse_linear_recurrence(
      jnp.concatenate([coeffs, coeffs]),
      jnp.concatenate([inputs, jnp.zeros_like(inputs)]),
      jnp.concatenate([jnp.full_like(first, 0.0), jnp.full_like(first, 1.0)]),
      method=method)
  return both[:b], both[b:]


def _carry_in(c_first, d_first, init, axis):
  """The value entering this device's chunk from the right (``init`` for the last)."""
  cs = lax.all_gather(c_first, axis)   # [n, B]: chunk k's map
  ds = lax.all_gather(d_first, axis)
  init = init + jnp.full_like(c_first, 0.0)   # device-varying, like the gathered maps

  def step(x_in, cd):
    c, d = cd
    return d + c * x_in, x_in

  _, carry_ins = lax.scan(step, init, (cs, ds), reverse=True)
  return carry_ins[lax.axis_index(axis)]


def _solve(coeffs, inputs, init, axis, method):
  """Solves the global reverse recurrence on this device's chunk.

  Returns ``(x_chunk [B, Tc], x_after [B])``: the solution on the chunk and the value
  just after it (the first entry of the next chunk's solution, or ``init``).
  """
  p, h = _chunk_maps(coeffs, inputs, method)
  x_after = _carry_in(h[:, 0], p[:, 0], init, axis)
  return p + h * x_after[:, None], x_after


def _gae_shard(rewards, values, mask, gamma, lam, bootstrap, *, axis, method):
  """GAE on one device's chunk ``[B, Tc]`` (inside ``shard_map``)."""
  # Masked inputs are selected away (never multiplied): NaN/inf there change nothing.
  keep = v.as_f32(mask) > 0
  m = keep.astype(jnp.float32)
  r = jnp.where(keep, v.as_f32(rewards), 0.0)
  val = jnp.where(keep, v.as_f32(values), 0.0)
  gamma, lam = v.as_f32(gamma), v.as_f32(lam)
  y, y_after = _solve(1.0 - m, val, bootstrap, axis, method)
  next_val = jnp.concatenate([y[:, 1:], y_after[:, None]], axis=1)
  delta = jnp.where(keep, r + gamma * next_val - val, 0.0)
  coeffs = jnp.where(keep, gamma * lam, 1.0)
  adv, _ = _solve(coeffs, delta, jnp.zeros_like(bootstrap), axis, method)
  adv = jnp.where(keep, adv, 0.0)
  return adv, jnp.where(keep, adv + val, 0.0)


def _normalize_axes(batch_axes):
  if batch_axes is None:
    return ()
  return (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)


def _check_layout(mesh, axis, batch_axes, shape, name):
  """Checks the mesh axes exist and divide ``[B, T]``; returns the token spec parts."""
  sizes = mesh_axis_sizes(mesh)
  for a in (axis,) + batch_axes:
    if a not in sizes:
      raise ValueError(f"mesh axis {a!r} is not in the mesh {tuple(sizes)}.")
  if axis in batch_axes:
    raise ValueError(f"`axis` {axis!r} cannot also be in `batch_axes` {batch_axes}.")
  n_seq = sizes[axis]
  if shape[1] % n_seq:
    raise ValueError(f"`{name}` has shape {shape}: its sequence dimension {shape[1]} is "
                     f"not divisible by mesh axis {axis!r} of size {n_seq}.")
  n_batch = math.prod(sizes[a] for a in batch_axes)
  if shape[0] % n_batch:
    raise ValueError(f"`{name}` has shape {shape}: its batch dimension {shape[0]} is not "
                     f"divisible by mesh axes {batch_axes} of size {n_batch}.")
  return batch_axes or None


def sequence_parallel_gae(rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, *,
                          mesh: Mesh | AbstractMesh, axis: str = "sequence", gamma: ArrayLike = 1.0,
                          lam: ArrayLike = 1.0, bootstrap_value: ArrayLike | None = None,
                          batch_axes: str | Sequence[str] | None = None,
                          method: str | None = None) -> tuple[jax.Array, jax.Array]:
  r""":func:`jaxrl_llm.gae` with the sequence split over mesh axis ``axis``.

  Same semantics as ``gae(..., transparent_mask=True)`` (verl: masked positions are
  skipped): with :math:`s_0 < s_1 < \dots` the valid positions of a row,

  .. math::
    \delta_{s_j} = r_{s_j} + \gamma V_{s_{j+1}} - V_{s_j}, \qquad
    A_{s_j} = \delta_{s_j} + \gamma\lambda A_{s_{j+1}}, \qquad R = A + V,

  with ``bootstrap_value`` after the last valid step. Each device holds ``T / n``
  tokens; the chunks are combined through their affine maps as described in the
  module docstring (two all-gathers of ``[n, 2B]`` floats). Equal to single-device
  ``gae`` up to float32 rounding. Call it inside or outside ``jax.jit``; the inputs
  may already be sharded ``P(batch_axes, axis)``.

  Args:
    rewards: ``[B, T]`` float token rewards.
    values: ``[B, T]`` float values.
    mask: ``[B, T]`` 1 on trainable tokens.
    mesh: the mesh holding ``axis``.
    axis: mesh axis over which the sequence is split; ``T`` must be divisible by its
      size.
    gamma: traced discount, a scalar or ``[B, T]``.
    lam: traced GAE lambda, a scalar or ``[B, T]``.
    bootstrap_value: optional ``[B]`` value after the last valid step (0 if None).
    batch_axes: optional mesh axes over which rows are split as well (e.g.
      ``("data", "fsdp")``); the batch is replicated over other axes.
    method: the local chunk solver, ``"scan"``, ``"associative"`` or ``None``
      (:func:`jaxrl_llm.advantages.default_gae_method`).

  Returns:
    ``(advantages, returns)``, ``[B, T]`` in the dtype of ``rewards``, 0 where
    ``mask`` is 0, sharded ``P(batch_axes, axis)``.

  Raises:
    ValueError: bad shapes/dtypes (naming the argument), unknown mesh axes, or ``T``
      (``B``) not divisible by the size of ``axis`` (``batch_axes``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxrl_llm.parallel.mesh import make_mesh
    >>> mesh = make_mesh(data=1, sequence=-1, devices=jax.devices()[:1])
    >>> adv, ret = sequence_parallel_gae(
    ...     jnp.array([[0., 0., 1., 0.]]), jnp.array([[.5, .2, .8, 9.]]),
    ...     jnp.array([[1, 1, 1, 0]]), mesh=mesh, gamma=1.0, lam=0.95)
    >>> [round(float(a), 4) for a in adv[0]]
    [0.4505, 0.79, 0.2, 0.0]
  """
  v.check_rank("rewards", rewards, 2)
  v.check_float("rewards", rewards)
  v.check_same_shape(("rewards", "values", "mask"), (rewards, values, mask))
  v.check_float("values", values)
  v.check_choice("method", method, (None,) + GAE_METHODS)
  shape = v.shape_of(rewards)
  if bootstrap_value is not None:
    v.check_batch_vector("bootstrap_value", bootstrap_value, shape[0])
  for name, coef in (("gamma", gamma), ("lam", lam)):
    ndim = jnp.ndim(coef)
    if ndim not in (0, 2) or (ndim == 2 and v.shape_of(coef) != shape):
      raise ValueError(f"`{name}` must be a scalar or have the shape of `rewards` "
                       f"{shape}, got shape {v.shape_of(coef)}.")
  batch_axes = _normalize_axes(batch_axes)
  rows = _check_layout(mesh, axis, batch_axes, shape, "rewards")
  tok, row = PartitionSpec(rows, axis), PartitionSpec(rows)
  coef_spec = lambda c: tok if jnp.ndim(c) == 2 else PartitionSpec()
  boot = (jnp.zeros((shape[0],), jnp.float32) if bootstrap_value is None
          else v.as_f32(bootstrap_value))
  fn = jax.shard_map(
      functools.partial(_gae_shard, axis=axis, method=method), mesh=mesh,
      in_specs=(tok, tok, tok, coef_spec(gamma), coef_spec(lam), row),
      out_specs=(tok, tok))
  adv, ret = fn(rewards, values, v.as_f32(mask), v.as_f32(gamma), v.as_f32(lam), boot)
  dtype = v.out_dtype(rewards)
  return adv.astype(dtype), ret.astype(dtype)


def sequence_parallel_token_logprobs(hidden: ArrayLike, lm_head: ArrayLike, targets: ArrayLike, *,
                                     mesh: Mesh | AbstractMesh, mask: ArrayLike | None = None,
                                     axis: str = "sequence",
                                     batch_axes: str | Sequence[str] | None = None,
                                     chunk_size: int | None = None, return_entropy: bool = False,
                                     temperature: ArrayLike = 1.0
                                     ) -> jax.Array | tuple[jax.Array, jax.Array]:
  r""":func:`jaxrl_llm.token_logprobs_from_hidden` with the sequence split over ``axis``.

  .. math::

    \log p_{b,t} = z_{b,t,y_{b,t}} - \log\sum_v e^{z_{b,t,v}}, \quad
    z_{b,t} = h_{b,t} W / \tau, \qquad
    \frac{\partial L}{\partial W} = \sum_{\text{devices}} \sum_{t \in \text{chunk}}
      h_t^\top \frac{\partial L}{\partial z_t} / \tau

  Each device computes the log-probs (chunked, never forming ``[B, T, V]``) of its
  ``T / n`` tokens with the replicated ``lm_head`` ``[D, V]``; under ``jax.grad`` the
  head's (and the temperature's) gradient is summed over the devices (a ``psum``).

  Args:
    hidden: ``[B, T, D]`` hidden states aligned with ``targets``.
    lm_head: ``[D, V]``.
    targets: ``[B, T]`` int token ids.
    mesh: the mesh holding ``axis``.
    mask: optional ``[B, T]`` mask (1 = valid).
    axis: the sequence mesh axis (``T`` divisible by its size).
    batch_axes: optional mesh axes over which rows are split as well.
    chunk_size: positions per chunk *within* a device (see
      :func:`token_logprobs_from_hidden`).
    return_entropy: also return per-token entropies.
    temperature: traced scalar :math:`\tau`.

  Returns:
    ``logp`` ``[B, T]`` float32 (and ``entropy``), sharded ``P(batch_axes, axis)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxrl_llm.parallel.mesh import make_mesh
    >>> mesh = make_mesh(data=1, sequence=-1, devices=jax.devices()[:1])
    >>> logp = sequence_parallel_token_logprobs(
    ...     jnp.ones((1, 3, 2)), jnp.array([[0., 1., 0.], [0., 1., 0.]]),
    ...     jnp.array([[1, 0, 2]]), mesh=mesh)
    >>> [round(float(x), 4) for x in logp[0]]
    [-0.2395, -2.2395, -2.2395]
  """
  v.check_rank("hidden", hidden, 3)
  v.check_float("hidden", hidden)
  v.check_rank("lm_head", lm_head, 2)
  v.check_float("lm_head", lm_head)
  shape = v.shape_of(hidden)
  if v.shape_of(targets) != shape[:2]:
    raise ValueError(f"`targets` must have shape {shape[:2]} (the [B, T] of `hidden` "
                     f"{shape}), got {v.shape_of(targets)}.")
  if mask is None:
    mask = jnp.ones(shape[:2], jnp.float32)
  v.check_same_shape(("targets", "mask"), (targets, mask))
  if jnp.ndim(temperature) != 0:
    raise ValueError(f"`temperature` must be a scalar, got shape "
                     f"{v.shape_of(temperature)}.")
  batch_axes = _normalize_axes(batch_axes)
  rows = _check_layout(mesh, axis, batch_axes, shape, "hidden")
  tok = PartitionSpec(rows, axis)

  def local(h, w, y, m, temp):
    return token_logprobs_from_hidden(h, w, y, mask=m, chunk_size=chunk_size,
                                      return_entropy=return_entropy, temperature=temp)

  out_specs = (tok, tok) if return_entropy else tok
  fn = jax.shard_map(local, mesh=mesh,
                     in_specs=(PartitionSpec(rows, axis, None), PartitionSpec(), tok, tok,
                               PartitionSpec()),
                     out_specs=out_specs, check_vma=False)
  return fn(hidden, lm_head, targets, mask, jnp.asarray(temperature, jnp.float32))


__all__ = ["sequence_parallel_gae", "sequence_parallel_token_logprobs"]
