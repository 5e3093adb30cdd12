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
fully masked (:math:`j > i`). A fully masked block is skipped with ``lax.switch`` (no
FLOPs), so with the *contiguous* layout device :math:`i` computes :math:`i + 1` of the
:math:`n` blocks: the last device does :math:`n` blocks and sets the pace, the first
does one, and the ring runs at about :math:`2n / (n + 1)` times the ideal time.

The *zig-zag* layout (``layout="zigzag"``, the default) balances it: split the tokens
into :math:`2n` half-chunks; device :math:`i` holds half-chunks :math:`i` and
:math:`2n - 1 - i` (an early and a late one). Against the keys of device :math:`j`:

* :math:`j = i`: causal attention of the local :math:`[i \,|\, 2n-1-i]` queries over
  the same keys (local order is global order, so the plain causal mask is exact);
* :math:`j < i`: both query halves see key half-chunk :math:`j` fully and
  :math:`2n - 1 - j` not at all: all queries over the first half of the keys;
* :math:`j > i`: only query half-chunk :math:`2n - 1 - i` sees keys, and it sees both
  halves: the second half of the queries over all keys.

So every device computes one diagonal block and :math:`n - 1` half blocks. The
permutation is internal to :func:`ring_attention`: its inputs and output keep the
contiguous layout of :func:`jaxrl_llm.parallel.sequence_parallel_gae`, the batch
shardings, RoPE positions and masks (device :math:`i` holds tokens
:math:`[i T/n, (i+1) T/n)`); inside, ``q, k, v`` and the key mask move once into the
zig-zag order and the output once back (``lax.ppermute`` of half-chunks, outside the
``custom_vjp``, so their transposes are the inverse permutations). Each layout is a
table of three branches (diagonal, earlier, later chunk) shared by the forward and
the recomputing backward. Non-causal attention does the same work in any layout and
runs contiguous, as does a ``T`` not divisible by :math:`2n`.

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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jax.typing import ArrayLike

from jaxrl_llm import _validate as v
from jaxrl_llm.attention import attention_with_lse, register_attention
from jaxrl_llm.parallel.mesh import mesh_axis_sizes

_EMPTY_LSE = -1e30   # log-sum-exp of a block with no visible key (finite, very negative)
_BATCH_AXES = ("data", "fsdp")
_HEAD_AXIS = "tensor"


# ------------------------------------------------------------------- per-device ring


class _Part(NamedTuple):
  """What one ring step computes: the local queries ``q`` over the received keys ``k``.

  ``q`` and ``k`` are ranges ``(start, stop)`` of the chunk in half-chunks (units of
  ``T_c / 2``; ``(0, 2)`` is the whole chunk), ``causal`` masks ``key > query`` inside
  (only the diagonal block, where local order is global order). Queries outside ``q``
  see no key of this chunk.
  """

  q: tuple[int, int]
  k: tuple[int, int]
  causal: bool


_WHOLE = (0, 2)
_DIAGONAL = _Part(_WHOLE, _WHOLE, True)
_FULL = _Part(_WHOLE, _WHOLE, False)

# The branch table of a causal ring: what device i computes with the key chunk of
# device j in the cases (j == i, j < i, j > i) (None: fully masked, skipped).
# Contiguous chunks i, j: j < i is fully visible, j > i fully masked. Zig-zag chunks
# (i, 2n-1-i) and (j, 2n-1-j): for j < i both local query halves see the first key half
# (sub-chunk j) and not the second; for j > i only the second query half (sub-chunk
# 2n-1-i) sees keys, and it sees both halves.
_CONTIGUOUS_BRANCHES: tuple[_Part | None, ...] = (_DIAGONAL, _FULL, None)
_ZIGZAG_BRANCHES: tuple[_Part | None, ...] = (
    _DIAGONAL, _Part(_WHOLE, (0, 1), False), _Part((1, 2), _WHOLE, False))
_NONCAUSAL_BRANCHES: tuple[_Part | None, ...] = (_FULL,)   # every step, every layout


def _case(s, idx, branches):
  """Index into ``branches`` at ring step ``s`` on device ``idx`` (keys of device
  ``j = idx - s mod n``): 0 if ``j == idx``, 1 if ``j < idx``, 2 if ``j > idx``."""
  if len(branches) == 1:
    return jnp.int32(0)
  return jnp.where(s == 0, 0, jnp.where(idx >= s, 1, 2)).astype(jnp.int32)


def _block(q, k, val, m, causal, impl, qs=None):
  """``(o [b,t,N,H] f32, lse [b,t,N] f32)`` of queries ``q`` over one key chunk.

  ``impl`` is ``(implementation, block_size)`` of :func:`attention_with_lse`. With
  packed rows ``qs`` holds the queries' segment ids and ``m`` the keys' (as float32,
  0 on padding); without, ``qs`` is None and ``m`` the 0/1 key mask.
  """
  if qs is None:
    return attention_with_lse(q, k, val, key_mask=m, is_causal=causal,
                              implementation=impl[0], block_size=impl[1])
  return attention_with_lse(q, k, val, key_mask=m, is_causal=causal,
                            implementation=impl[0], block_size=impl[1],
                            segment_ids=qs.astype(jnp.int32),
                            key_segment_ids=m.astype(jnp.int32))


def _skip(q):
  b, t, n, _ = q.shape
  return (jnp.zeros(q.shape, jnp.float32), jnp.full((b, t, n), _EMPTY_LSE, jnp.float32))


def _attend(part, impl, q, k, val, m, qs=None):
  """``(o, lse)`` of all local queries for one branch ``part`` (empty outside it)."""
  if part is None:
    return _skip(q)
  t = q.shape[1]
  (q0, q1), (k0, k1) = ((a * t // 2, b * t // 2) for a, b in (part.q, part.k))
  o, lse = _block(q[:, q0:q1], k[:, k0:k1], val[:, k0:k1], m[:, k0:k1], part.causal,
                  impl, None if qs is None else qs[:, q0:q1])
  if (q0, q1) == (0, t):
    return o, lse
  pieces = [x for x in (_skip(q[:, :q0]), (o, lse), _skip(q[:, q1:])) if x[0].shape[1]]
  return tuple(jnp.concatenate(xs, axis=1) for xs in zip(*pieces))


def _merge(out, lse, o_j, lse_j):
  new = jnp.logaddexp(lse, lse_j)
  return (jnp.exp(lse - new)[..., None] * out + jnp.exp(lse_j - new)[..., None] * o_j,
          new)


def _send(xs, axis, n):
  """Every array of ``xs`` to the next device of the ring (``i -> i + 1 mod n``)."""
  perm = [(i, (i + 1) % n) for i in range(n)]
  return tuple(lax.ppermute(x, axis, perm) for x in xs)


def _ring_forward(q, k, val, m, qs, axis, n, branches, impl):
  """``(out f32, lse f32)`` of this device's queries over all ``n`` chunks."""
  idx = lax.axis_index(axis)
  fns = [functools.partial(_attend, part, impl) for part in branches]
  out, lse = fns[0](q, k, val, m, qs)   # step 0: this device's own chunk

  def step(carry, s):
    k_s, v_s, m_s, out, lse = carry
    k_s, v_s, m_s = _send((k_s, v_s, m_s), axis, n)
    o_j, lse_j = lax.switch(_case(s, idx, branches), fns, q, k_s, v_s, m_s, qs)
    out, lse = _merge(out, lse, o_j, lse_j)
    return (k_s, v_s, m_s, out, lse), None

  if n > 1:
    (_, _, _, out, lse), _ = lax.scan(step, (k, val, m, out, lse),
                                      jnp.arange(1, n, dtype=jnp.int32))
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, val, m, qs, axis, n, branches, impl):
  return _ring_forward(q, k, val, m, qs, axis, n, branches, impl)[0]


def _ring_fwd(q, k, val, m, qs, axis, n, branches, impl):
  out, lse = _ring_forward(q, k, val, m, qs, axis, n, branches, impl)
  return out, (q, k, val, m, qs, out, lse)


def _ring_bwd(axis, n, branches, impl, res, g):
  q, k, val, m, qs, out, lse = res
  g = g.astype(jnp.float32)
  idx = lax.axis_index(axis)

  def grads(part):
    def fn(q_, k_, v_, m_):
      if part is None:
        return (jnp.zeros(q_.shape, jnp.float32), jnp.zeros(k_.shape, jnp.float32),
                jnp.zeros(v_.shape, jnp.float32))
      (o_j, lse_j), vjp = jax.vjp(
          lambda a, b, c: _attend(part, impl, a, b, c, m_, qs), q_, k_, v_)
      w = jnp.exp(lse_j - lse)
      d_lse = w * jnp.sum(g * (o_j - out), axis=-1)
      return tuple(x.astype(jnp.float32) for x in vjp((w[..., None] * g, d_lse)))
    return fn

  def step(carry, s):
    k_s, v_s, m_s, dq, dk_s, dv_s = carry
    dq_j, dk_j, dv_j = lax.switch(_case(s, idx, branches),
                                  [grads(part) for part in branches], q, k_s, v_s, m_s)
    # The chunk and its gradient move on together; after n sends dk/dv are home.
    k_s, v_s, m_s, dk_s, dv_s = _send((k_s, v_s, m_s, dk_s + dk_j, dv_s + dv_j), axis, n)
    return (k_s, v_s, m_s, dq + dq_j, dk_s, dv_s), None

  init = (k, val, m, jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
          jnp.zeros(val.shape, jnp.float32))
  (_, _, _, dq, dk, dv), _ = lax.scan(step, init, jnp.arange(n, dtype=jnp.int32))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(val.dtype),
          jnp.zeros_like(m), None if qs is None else jnp.zeros_like(qs))


_ring.defvjp(_ring_fwd, _ring_bwd)


# ------------------------------------------------------------------- zig-zag layout


def _zigzag_perms(n):
  """``ppermute`` pairs moving the first and the second halves of contiguous chunks.

  Half-chunk ``c`` of ``2n`` (held by device ``c // 2``) belongs to device ``c`` if
  ``c < n`` (its first half), else to device ``2n - 1 - c`` (its second half).
  """
  owner = [c if c < n else 2 * n - 1 - c for c in range(2 * n)]
  return ([(d, owner[2 * d]) for d in range(n)],
          [(d, owner[2 * d + 1]) for d in range(n)])


def _to_zigzag(x, axis, n):
  """Contiguous chunk ``[2i | 2i+1]`` on device ``i`` -> zig-zag ``[i | 2n-1-i]``.

  Device ``i`` receives half-chunk ``i`` and ``2n - 1 - i``: an even ``i`` gets ``i``
  through the first-halves permutation and ``2n - 1 - i`` (odd) through the second; an
  odd ``i`` the other way round.
  """
  h = x.shape[1] // 2
  first, second = _zigzag_perms(n)
  a = lax.ppermute(x[:, :h], axis, first)
  b = lax.ppermute(x[:, h:], axis, second)
  even = lax.axis_index(axis) % 2 == 0
  return jnp.concatenate([jnp.where(even, a, b), jnp.where(even, b, a)], 1)


def _from_zigzag(x, axis, n):
  """The inverse of :func:`_to_zigzag`."""
  h = x.shape[1] // 2
  first, second = _zigzag_perms(n)
  even = lax.axis_index(axis) % 2 == 0
  a = jnp.where(even, x[:, :h], x[:, h:])    # the half that came by `first`
  b = jnp.where(even, x[:, h:], x[:, :h])
  back = lambda perm: [(dst, src) for src, dst in perm]
  return jnp.concatenate([lax.ppermute(a, axis, back(first)),
                          lax.ppermute(b, axis, back(second))], 1)


class _Layout(NamedTuple):
  """A token layout of the causal ring.

  ``chunks(n, i)``: the global half-chunks (of ``2n``) device ``i`` holds, in local
  order; ``enter`` / ``leave``: ``(x, axis, n) ->`` the permutation from the contiguous
  chunks into the layout and back; ``branches``: the branch table.
  """

  chunks: Callable[[int, int], tuple[int, int]]
  enter: Callable
  leave: Callable
  branches: tuple[_Part | None, ...]


def _stay(x, axis, n):
  return x


_LAYOUTS = {
    "contiguous": _Layout(lambda n, i: (2 * i, 2 * i + 1), _stay, _stay,
                          _CONTIGUOUS_BRANCHES),
    "zigzag": _Layout(lambda n, i: (i, 2 * n - 1 - i), _to_zigzag, _from_zigzag,
                      _ZIGZAG_BRANCHES),
}
LAYOUTS = tuple(_LAYOUTS)


def _ring_body(q, k, val, m, axis, n, layout, causal, impl, qs=None):
  """The per-device ring in ``layout``; takes and returns contiguous chunks."""
  if not causal:
    return _ring(q, k, val, m, qs, axis, n, _NONCAUSAL_BRANCHES, impl)
  lay = _LAYOUTS[layout]
  # Outside the custom_vjp: JAX transposes the ppermutes (inverse permutations).
  q, k, val, m = (lay.enter(x, axis, n) for x in (q, k, val, m))
  if qs is not None:
    qs = lay.enter(qs, axis, n)
  return lay.leave(_ring(q, k, val, m, qs, axis, n, lay.branches, impl), axis, n)


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


def ring_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, mesh: Mesh | AbstractMesh,
                   axis: str = "sequence", key_mask: ArrayLike | None = None,
                   is_causal: bool = True, batch_axes: str | Sequence[str] | None = None,
                   head_axis: str | None = None, implementation: str = "blockwise",
                   block_size: int | tuple[int, int] | None = None,
                   layout: str = "zigzag",
                   segment_ids: ArrayLike | None = None) -> jax.Array:
  r"""Self-attention with the sequence split over mesh axis ``axis`` (a ring).

  Same result as :func:`jaxrl_llm.dot_product_attention` on the whole sequence (up to
  float rounding), computed with ``jax.shard_map``: each device holds ``T / n``
  queries, keys and values, and the key / value / mask chunks go around the ring with
  ``lax.ppermute``; see the module docstring for the merge recurrence and the gradient.

  Work balance (causal): fully masked blocks are skipped. With
  ``layout="contiguous"`` device ``i`` attends over its chunk ``i`` of ``n`` and computes
  ``i + 1`` blocks (the diagonal and the ``i`` earlier chunks), so the last device sets
  the pace. With ``layout="zigzag"`` (the default) device ``i`` works on half-chunks
  ``i`` and ``2n - 1 - i`` of ``2n``, and every device computes one diagonal block and
  ``n - 1`` half blocks. The zig-zag order is internal: inputs and output keep the
  contiguous layout (device ``i`` holds tokens ``[i T/n, (i+1) T/n)``), at the cost of
  moving ``q, k, v`` and the key mask once into the zig-zag order (two half-chunk
  ``ppermute`` calls each) and the output once back. Non-causal attention does the same
  work in both layouts and runs contiguous; so does a ``T`` that is not divisible by
  ``2n`` (only ``T % n == 0`` is required).

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
    layout: ``"zigzag"`` (balanced causal work) or ``"contiguous"``; same result.
    segment_ids: optional ``[B, T]`` int, packed rows (0 = padding): a query sees only
      the keys of its own segment. The keys' ids travel around the ring in place of
      the key mask (as float32: exact for ids below :math:`2^{24}`), the queries' stay.

  Returns:
    ``[B, T, N, H]`` in the dtype of ``query``; 0 for a query with no visible key.

  Raises:
    ValueError: bad ranks or head counts, ``key``/``value``/``key_mask`` shapes that do
      not match ``query``, a missing mesh axis, ``T`` not divisible by the size of
      ``axis`` (naming the argument and the shapes), or an unknown ``layout``.

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
  v.check_choice("layout", layout, LAYOUTS)
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
  qs = None
  if segment_ids is not None:
    if v.shape_of(segment_ids) != (b, t) or not jnp.issubdtype(
        jnp.result_type(segment_ids), jnp.integer):
      raise ValueError(f"`segment_ids` must be an int array of shape ({b}, {t}), got "
                       f"{v.shape_of(segment_ids)} {jnp.result_type(segment_ids)}.")
    qs = jnp.asarray(segment_ids).astype(jnp.float32)
    mask = mask * qs          # the keys' segment ids, 0 on padding
  if n == 1:
    extra = {} if qs is None else {"segment_ids": jnp.asarray(segment_ids, jnp.int32),
                                   "key_segment_ids": mask.astype(jnp.int32)}
    out, _ = attention_with_lse(query, key, value, key_mask=mask, is_causal=is_causal,
                                implementation=implementation, block_size=block_size,
                                **extra)
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
  if t % (2 * n):
    layout = "contiguous"        # zig-zag splits each chunk in two halves
  row_tok = PartitionSpec(_spec_part(rows), axis)
  if qs is None:
    fn = jax.shard_map(
        lambda q_, k_, v_, m_: _ring_body(q_, k_, v_, m_, axis, n, layout,
                                          bool(is_causal), (implementation, block_size)),
        mesh=mesh, in_specs=(tok, tok, tok, row_tok), out_specs=tok, check_vma=False)
    return fn(query, key, value, mask).astype(query.dtype)
  packed_fn = jax.shard_map(
      lambda q_, k_, v_, m_, s_: _ring_body(q_, k_, v_, m_, axis, n, layout,
                                            bool(is_causal), (implementation, block_size),
                                            s_),
      mesh=mesh, in_specs=(tok, tok, tok, row_tok, row_tok), out_specs=tok,
      check_vma=False)
  return packed_fn(query, key, value, mask, qs).astype(query.dtype)


def ring_dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                               key_mask: ArrayLike | None = None, is_causal: bool = True,
                               query_offset: ArrayLike | None = None,
                               block_size: int | tuple[int, int] | None = None,
                               segment_ids: ArrayLike | None = None,
                               key_segment_ids: ArrayLike | None = None,
                               **unused: Any) -> jax.Array:
  """``dot_product_attention``'s signature over the ambient mesh's ``sequence`` axis.

  Registered as the ``"ring"`` implementation of
  :func:`jaxrl_llm.dot_product_attention` when :mod:`jaxrl_llm.parallel` is
  imported; the mesh is ``jax.sharding.get_abstract_mesh()`` (set it with
  ``jax.set_mesh(mesh)``, :func:`jaxrl_llm.parallel.ambient_mesh` or
  the train package's ``shard_train_step``). Without an ambient mesh holding a
  ``sequence`` axis, or for cross-length / offset attention (``S != T`` or a
  ``query_offset``: KV-cache prefill and decode), it is the plain blockwise attention.
  The ring uses :func:`ring_attention`'s default (zig-zag) layout. Packed rows
  (``segment_ids``) are self-attention: ``key_segment_ids``, if given, must be the same
  array.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if (mesh.empty or "sequence" not in mesh.axis_names or query_offset is not None
      or key.shape[1] != query.shape[1]):
    extra = {} if segment_ids is None else {"segment_ids": segment_ids,
                                            "key_segment_ids": key_segment_ids}
    out, _ = attention_with_lse(query, key, value, key_mask=key_mask,
                                is_causal=is_causal, implementation="blockwise",
                                block_size=block_size, query_offset=query_offset, **extra)
    return out.astype(query.dtype)
  if key_segment_ids is not None and key_segment_ids is not segment_ids:
    raise ValueError("ring attention over packed rows is self-attention: "
                     "`key_segment_ids` must be `segment_ids` (or None).")
  return ring_attention(query, key, value, mesh=mesh, key_mask=key_mask,
                        is_causal=is_causal, block_size=block_size, segment_ids=segment_ids)


register_attention("ring", ring_dot_product_attention)

__all__ = ["ring_attention", "ring_dot_product_attention"]
