r"""Ring attention: context parallelism over a ``sequence`` mesh axis.

With a ``sequence`` mesh axis of size :math:`n`, the tokens of every row are split into
:math:`n` contiguous chunks of :math:`T_c = T / n`; device :math:`i` holds the queries,
keys, values and key mask of chunk :math:`i`. Attention needs every key, so the key /
value / mask chunks travel around the ring (``lax.ppermute`` from device :math:`i` to
:math:`i + 1`): at step :math:`s = 0, \dots, n - 1` device :math:`i` holds chunk
:math:`j = (i - s) \bmod n`, computes the partial attention of its queries over that
chunk with :func:`jaxrl_llm.attention.attention_with_lse` (blockwise, so neither pass
forms a ``[T_c, T_c]`` score matrix), and merges it into its running result with the
online-softmax (log-sum-exp) rule

.. math::

  \ell \leftarrow \log\big(e^{\ell} + e^{\ell_j}\big), \qquad
  o \leftarrow e^{\ell_{old} - \ell}\, o + e^{\ell_j - \ell}\, o_j ,

where :math:`(o_j, \ell_j)` are the normalised output and log-sum-exp of the scores over
chunk :math:`j` alone (:math:`o = 0`, :math:`\ell = -10^{30}` before the first chunk).
After :math:`n` steps :math:`o` is the softmax attention over all keys. The sends of
the next chunk do not depend on the current block's compute, so XLA may overlap them.

**Causality and work balance.** With ``is_causal`` (self-attention, :math:`S = T`)
chunk :math:`j` is, for the queries of chunk :math:`i`: the diagonal block
(:math:`j = i`, step 0; causal inside the block), fully visible (:math:`j < i`), or
fully masked (:math:`j > i`). A fully masked block is skipped with ``lax.cond`` (no
FLOPs), so with this *contiguous* layout device :math:`i` computes :math:`i + 1` of the
:math:`n` blocks: the last device does :math:`n` blocks and sets the pace, the first
does one, and the ring runs at about :math:`2n / (n + 1)` times the ideal time. The
known fix is the zig-zag layout (device :math:`i` holds chunks :math:`i` and
:math:`2n - 1 - i` of :math:`2n`, so every device does the same work); it needs the
whole step's token order permuted (RoPE positions, masks, GAE), which this module does
not do: it keeps the contiguous layout that
:func:`jaxrl_llm.parallel.sequence_parallel_gae` and the batch shardings use.

**Memory.** Forward and backward are one ``custom_vjp``: the forward keeps only this
device's ``q, k, v, mask`` chunks and its merged output and log-sum-exp
(:math:`O(T_c)`); the backward runs the ring again, recomputing each block's
:math:`(o_j, \ell_j)` under ``jax.vjp`` and feeding it the cotangents of the merge,

.. math::

  \bar o_j = w_j\, \bar o, \qquad \bar\ell_j = w_j\, \langle \bar o,\, o_j - o\rangle,
  \qquad w_j = e^{\ell_j - \ell},

while the key/value gradients travel around the ring with their chunks (:math:`n`
sends, after which each is back on its owner). No per-step ``[T_c, T_c]`` or per-step
``[T_c, N, H]`` data is stored, so memory is linear in :math:`T_c = T / n`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxrl_llm import _validate as v
from jaxrl_llm.attention import attention_with_lse, register_attention
from jaxrl_llm.parallel.mesh import mesh_axis_sizes

_EMPTY_LSE = -1e30   # log-sum-exp of a block with no visible key (finite, very negative)
_BATCH_AXES = ("data", "fsdp")
_HEAD_AXIS = "tensor"


# ------------------------------------------------------------------- per-device ring


def _block(q, k, val, m, causal, impl):
  """``(o [b,t,N,H] f32, lse [b,t,N] f32)`` of queries ``q`` over one key chunk.

  ``impl`` is ``(implementation, block_size)`` of :func:`attention_with_lse`.
  """
  return attention_with_lse(q, k, val, key_mask=m, is_causal=causal,
                            implementation=impl[0], block_size=impl[1])


def _skip(q):
  b, t, n, _ = q.shape
  return (jnp.zeros(q.shape, jnp.float32), jnp.full((b, t, n), _EMPTY_LSE, jnp.float32))


def _merge(out, lse, o_j, lse_j):
  new = jnp.logaddexp(lse, lse_j)
  return (jnp.exp(lse - new)[..., None] * out + jnp.exp(lse_j - new)[..., None] * o_j,
          new)


def _send(xs, axis, n):
  """Every array of ``xs`` to the next device of the ring (``i -> i + 1 mod n``)."""
  perm = [(i, (i + 1) % n) for i in range(n)]
  return tuple(lax.ppermute(x, axis, perm) for x in xs)


def _branch(s, idx, causal):
  """0: diagonal (causal) block, 1: fully visible block, 2: fully masked (skip)."""
  if not causal:
    return jnp.int32(1)
  return jnp.where(s == 0, 0, jnp.where(idx >= s, 1, 2)).astype(jnp.int32)


def _ring_forward(q, k, val, m, axis, n, causal, impl):
  """``(out f32, lse f32)`` of this device's queries over all ``n`` chunks."""
  idx = lax.axis_index(axis)
  out, lse = _block(q, k, val, m, causal, impl)   # step 0: this device's own chunk

  def step(carry, s):
    k_s, v_s, m_s, out, lse = carry
    k_s, v_s, m_s = _send((k_s, v_s, m_s), axis, n)
    o_j, lse_j = lax.switch(
        _branch(s, idx, causal),
        [lambda *a: _block(*a, causal, impl), lambda *a: _block(*a, False, impl),
         lambda q_, *_: _skip(q_)], q, k_s, v_s, m_s)
    out, lse = _merge(out, lse, o_j, lse_j)
    return (k_s, v_s, m_s, out, lse), None

  if n > 1:
    (_, _, _, out, lse), _ = lax.scan(step, (k, val, m, out, lse),
                                      jnp.arange(1, n, dtype=jnp.int32))
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q, k, val, m, axis, n, causal, impl):
  return _ring_forward(q, k, val, m, axis, n, causal, impl)[0]


def _ring_fwd(q, k, val, m, axis, n, causal, impl):
  out, lse = _ring_forward(q, k, val, m, axis, n, causal, impl)
  return out, (q, k, val, m, out, lse)


def _ring_bwd(axis, n, causal, impl, res, g):
  q, k, val, m, out, lse = res
  g = g.astype(jnp.float32)
  idx = lax.axis_index(axis)

  def grads(causal_block):
    def fn(q_, k_, v_, m_):
      (o_j, lse_j), vjp = jax.vjp(
          lambda a, b, c: _block(a, b, c, m_, causal_block, impl), q_, k_, v_)
      w = jnp.exp(lse_j - lse)
      d_lse = w * jnp.sum(g * (o_j - out), axis=-1)
      return tuple(x.astype(jnp.float32) for x in vjp((w[..., None] * g, d_lse)))
    return fn

  def zeros(q_, k_, v_, m_):
    return (jnp.zeros(q_.shape, jnp.float32), jnp.zeros(k_.shape, jnp.float32),
            jnp.zeros(v_.shape, jnp.float32))

  def step(carry, s):
    k_s, v_s, m_s, dq, dk_s, dv_s = carry
    dq_j, dk_j, dv_j = lax.switch(_branch(s, idx, causal),
                                  [grads(causal), grads(False), zeros], q, k_s, v_s, m_s)
    # The chunk and its gradient move on together; after n sends dk/dv are home.
    k_s, v_s, m_s, dk_s, dv_s = _send((k_s, v_s, m_s, dk_s + dk_j, dv_s + dv_j), axis, n)
    return (k_s, v_s, m_s, dq + dq_j, dk_s, dv_s), None

  init = (k, val, m, jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
          jnp.zeros(val.shape, jnp.float32))
  (_, _, _, dq, dk, dv), _ = lax.scan(step, init, jnp.arange(n, dtype=jnp.int32))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(val.dtype),
          jnp.zeros_like(m))


_ring.defvjp(_ring_fwd, _ring_bwd)


# ------------------------------------------------------------------------- public API


def _axes_of(mesh_sizes, names, dims):
  """The mesh axes among ``names`` of size > 1 whose product divides every ``dims``."""
  axes = tuple(a for a in names if mesh_sizes.get(a, 1) > 1)
  total = math.prod(mesh_sizes[a] for a in axes)
  if axes and all(d % total == 0 for d in dims):
    return axes
  return ()


def _spec_part(axes):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def ring_attention(query, key, value, *, mesh, axis: str = "sequence", key_mask=None,
                   is_causal: bool = True,
                   batch_axes: str | Sequence[str] | None = None,
                   head_axis: str | None = None,
                   implementation: str = "blockwise",
                   block_size: int | tuple[int, int] | None = None):
  r"""Self-attention with the sequence split over mesh axis ``axis`` (a ring).

  Same result as :func:`jaxrl_llm.dot_product_attention` on the whole sequence (up to
  float rounding), computed with ``jax.shard_map``: each device holds ``T / n``
  queries, keys and values, and the key / value / mask chunks go around the ring with
  ``lax.ppermute``; see the module docstring for the merge recurrence, the gradient
  and the work balance (contiguous layout; fully masked causal blocks are skipped, so
  device ``i`` computes ``i + 1`` blocks; a zig-zag layout would balance them).

  Args:
    query: ``[B, T, N, H]``.
    key: ``[B, T, K, H]`` with ``N`` a multiple of ``K`` (grouped-query attention;
      query head ``h`` uses key head ``h // (N / K)``). Self-attention: keys and
      queries have the same length and the same split.
    value: ``[B, T, K, H]``.
    mesh: a ``Mesh`` or ``AbstractMesh`` holding ``axis``.
    axis: the sequence mesh axis; ``T`` must be divisible by its size.
    key_mask: optional ``[B, T]``, nonzero on real keys (padding anywhere).
    is_causal: query ``t`` sees keys ``s <= t``.
    batch_axes: mesh axes over which rows are split as well; ``None``: those of
      ``("data", "fsdp")`` with size > 1, if they divide ``B`` (else rows are
      replicated).
    head_axis: mesh axis over which heads are split; ``None``: ``"tensor"`` if its size
      is > 1 and divides both ``N`` and ``K``.
    implementation: the per-block implementation of
      :func:`jaxrl_llm.attention.attention_with_lse` (``"blockwise"``: O(T) memory).
    block_size: its block size (default: that function's default).

  Returns:
    ``[B, T, N, H]`` in the dtype of ``query``; 0 for a query with no visible key.

  Raises:
    ValueError: bad ranks or head counts, ``key``/``value``/``key_mask`` shapes that do
      not match ``query``, a missing mesh axis, or ``T`` not divisible by the size of
      ``axis`` (naming the argument and the shapes).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jaxrl_llm.parallel import make_mesh
    >>> mesh = make_mesh(data=1, sequence=-1, devices=jax.devices()[:1])
    >>> q = k = val = jnp.ones((1, 4, 2, 8))
    >>> ring_attention(q, k, val, mesh=mesh).shape
    (1, 4, 2, 8)
  """
  v.check_rank("query", query, 4)
  v.check_rank("key", key, 4)
  v.check_float("query", query)
  v.check_same_shape(("key", "value"), (key, value))
  b, t, n_heads, h = v.shape_of(query)
  kb, s, k_heads, kh = v.shape_of(key)
  if (kb, s, kh) != (b, t, h):
    raise ValueError(f"`key` must have shape ({b}, {t}, K, {h}) for `query` of shape "
                     f"{v.shape_of(query)} (ring attention is self-attention: same "
                     f"batch, length and head size), got {v.shape_of(key)}.")
  if n_heads % k_heads:
    raise ValueError(f"`query` has {n_heads} heads (shape {v.shape_of(query)}), not a "
                     f"multiple of the {k_heads} heads of `key` {v.shape_of(key)}.")
  if key_mask is not None and v.shape_of(key_mask) != (b, s):
    raise ValueError(f"`key_mask` must have shape ({b}, {s}) (the [B, S] of `key` "
                     f"{v.shape_of(key)}), got {v.shape_of(key_mask)}.")
  sizes = mesh_axis_sizes(mesh)
  if axis not in sizes:
    raise ValueError(f"`axis` {axis!r} is not an axis of the mesh {tuple(sizes)}.")
  n = sizes[axis]
  if t % n:
    raise ValueError(f"`query` has shape {v.shape_of(query)}: its sequence dimension {t} "
                     f"is not divisible by mesh axis {axis!r} of size {n}.")
  mask = (jnp.ones((b, s), jnp.float32) if key_mask is None
          else (jnp.asarray(key_mask) != 0).astype(jnp.float32))
  if n == 1:
    out, _ = attention_with_lse(query, key, value, key_mask=mask, is_causal=is_causal,
                                implementation=implementation, block_size=block_size)
    return out.astype(query.dtype)
  if batch_axes is None:
    rows = _axes_of(sizes, _BATCH_AXES, (b,))
  else:
    rows = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    if b % math.prod(sizes[a] for a in rows):
      raise ValueError(f"`query` has shape {v.shape_of(query)}: batch {b} is not "
                       f"divisible by mesh axes {rows}.")
  if head_axis is None:
    heads = _axes_of(sizes, (_HEAD_AXIS,), (n_heads, k_heads))
  else:
    heads = (head_axis,)
  tok = PartitionSpec(_spec_part(rows), axis, _spec_part(heads), None)
  fn = jax.shard_map(
      lambda q_, k_, v_, m_: _ring(q_, k_, v_, m_, axis, n, bool(is_causal),
                                   (implementation, block_size)),
      mesh=mesh, in_specs=(tok, tok, tok, PartitionSpec(_spec_part(rows), axis)),
      out_specs=tok, check_vma=False)
  return fn(query, key, value, mask).astype(query.dtype)


def ring_dot_product_attention(query, key, value, *, key_mask=None,
                               is_causal: bool = True, query_offset=None,
                               block_size=None, **unused):
  """``dot_product_attention``'s signature over the ambient mesh's ``sequence`` axis.

  Registered as the ``"ring"`` implementation of
  :func:`jaxrl_llm.dot_product_attention` when :mod:`jaxrl_llm.parallel` is
  imported; the mesh is ``jax.sharding.get_abstract_mesh()`` (set it with
  ``jax.set_mesh(mesh)``, :func:`jaxrl_llm.parallel.ambient_mesh` or
  :func:`jaxrl_llm.parallel.shard_train_step`). Without an ambient mesh holding a
  ``sequence`` axis, or for cross-length / offset attention (``S != T`` or a
  ``query_offset``: KV-cache prefill and decode), it is the plain blockwise attention.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if (mesh.empty or "sequence" not in mesh.axis_names or query_offset is not None
      or key.shape[1] != query.shape[1]):
    out, _ = attention_with_lse(query, key, value, key_mask=key_mask,
                                is_causal=is_causal, implementation="blockwise",
                                block_size=block_size, query_offset=query_offset)
    return out.astype(query.dtype)
  return ring_attention(query, key, value, mesh=mesh, key_mask=key_mask,
                        is_causal=is_causal, block_size=block_size)


register_attention("ring", ring_dot_product_attention)

__all__ = ["ring_attention", "ring_dot_product_attention"]
