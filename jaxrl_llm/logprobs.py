"""Per-token log-probabilities (and entropies) of target tokens.

Two entry points:

* :func:`token_logprobs` takes logits ``[B, T, V]`` that the caller already has.
* :func:`token_logprobs_from_hidden` takes the last hidden states ``[B, T, D]`` and the
  LM-head matrix ``[D, V]`` and never materialises the ``[B, T, V]`` logits: it scans
  over the sequence in chunks and, in the backward pass (a ``jax.custom_vjp``),
  recomputes each chunk's logits from the hidden states. Forward + backward memory
  therefore grows with ``B * chunk_size * V`` instead of ``B * T * V``: the full-logits
  tensor is the most reported out-of-memory in LLM RL trainers (float32 logits are
  4.2 GB per sequence at T=32768, V=32000).

Both return float32 results whatever the input dtype (log-probabilities in bf16 carry
only 8 bits of mantissa, too few for importance ratios), with 0 at masked positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm import _validate as v

ArrayLike = jax.typing.ArrayLike

# Default number of tokens (batch rows x sequence positions) per chunk.
_DEFAULT_TOKENS_PER_CHUNK = 1024


def _check_targets(targets, batch_time, name="targets"):
  v.check_rank(name, targets, 2)
  if not jnp.issubdtype(jnp.result_type(targets), jnp.integer):
    raise ValueError(
        f"`{name}` must be an integer array of token ids, got dtype "
        f"{jnp.result_type(targets)} with shape {v.shape_of(targets)}.")
  if v.shape_of(targets) != tuple(batch_time):
    raise ValueError(
        f"`{name}` must have shape {tuple(batch_time)} (the [B, T] of the inputs), "
        f"got {v.shape_of(targets)}.")


def _prepare_mask_targets(mask, targets, vocab):
  """Float mask, boolean validity and in-range int32 targets (0 where masked)."""
  if mask is None:
    mask = jnp.ones(jnp.shape(targets), jnp.float32)
  v.check_same_shape(("targets", "mask"), (targets, mask))
  valid = v.as_f32(mask) > 0
  safe_targets = jnp.where(valid, jnp.clip(targets, 0, vocab - 1), 0).astype(jnp.int32)
  return valid, safe_targets


def _check_vocab(name, vocab, shape):
  if vocab < 1:
    raise ValueError(f"`{name}` must have a non-empty vocabulary (last axis), got shape "
                     f"{shape}.")


def _check_temperature(temperature):
  if jnp.ndim(temperature) != 0:
    raise ValueError(
        f"`temperature` must be a scalar, got shape {v.shape_of(temperature)}.")
  # A concrete temperature <= 0 would give inf/NaN log-probs; traced values can't raise.
  v.check_range("temperature", temperature, low=0.0, low_open=True)


def _shift_and_normalizer(z):
  """Returns ``(z - max, log sum exp(z - max))`` over the last axis (both keepdims).

  ``log q = (z - max) - log_norm`` is accurate to the ulp of ``log q`` itself, whereas
  ``z - logsumexp(z)`` loses the ulp of ``|z|`` (about 4e-6 at ``|z| = 50``). The max is
  a constant shift, so it carries no gradient; an all ``-inf`` row uses a shift of 0.
  """
  m = jnp.max(z, axis=-1, keepdims=True)
  m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  shifted = z - m
  return shifted, jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))


def token_logprobs(logits: ArrayLike, targets: ArrayLike, mask: ArrayLike | None = None,
                   *, return_entropy: bool = False
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
  r"""Log-probability of each target token under ``softmax(logits)``.

  .. math::

    \log p_{b,t} = z_{b,t,y_{b,t}} - \log\sum_{v} e^{z_{b,t,v}}, \qquad
    H_{b,t} = -\sum_v p_{b,t,v} \log p_{b,t,v}

  computed in float32 with a max-shifted log-sum-exp. The logits must already be aligned
  with the targets (for a causal LM, ``logits[:, :-1]`` against ``tokens[:, 1:]``) and
  already divided by any sampling temperature.

  Logits equal to ``-inf`` (banned tokens) are supported: they get probability 0 and
  contribute 0 to the entropy and its gradient (a valid row needs at least one finite
  logit; a target whose logit is ``-inf`` gets ``logp = -inf``, as in ``log_softmax``).
  At masked positions both outputs are 0 and the gradient is 0, whatever the logits hold
  there (NaN included). Targets at valid positions outside ``[0, V)`` are clipped into
  range (a data fault, not an error, since data cannot raise under jit).

  Args:
    logits: ``[B, T, V]`` floating logits (any float dtype; math is float32).
    targets: ``[B, T]`` integer token ids.
    mask: optional ``[B, T]`` mask, 1 = valid. ``None`` means all valid.
    return_entropy: also return the per-token entropy of ``softmax(logits)``.

  Returns:
    ``logp`` ``[B, T]`` float32, or ``(logp, entropy)`` when ``return_entropy``.

  Examples:
    >>> import jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    >>> logp = token_logprobs(logits, jnp.array([[0, 2]]))
    >>> [round(float(x), 4) for x in jnp.exp(logp[0])]
    [0.5, 0.8]
  """
  v.check_rank("logits", logits, 3)
  v.check_float("logits", logits)
  batch, time, vocab = v.shape_of(logits)
  _check_vocab("logits", vocab, v.shape_of(logits))
  _check_targets(targets, (batch, time))
  valid, safe_targets = _prepare_mask_targets(mask, targets, vocab)

  z = jnp.where(valid[..., None], v.as_f32(logits), 0.0)
  shifted, log_norm = _shift_and_normalizer(z)
  shifted_target = jnp.take_along_axis(shifted, safe_targets[..., None], axis=-1)
  logp = jnp.where(valid, (shifted_target - log_norm)[..., 0], 0.0)
  if not return_entropy:
    return logp
  # -inf logits have p = 0: replace log p by a finite value there so that p log p is 0
  # and its gradient is not 0 * inf.
  probs = jnp.exp(shifted - log_norm)
  log_probs = jnp.where(jnp.isneginf(z), 0.0, shifted - log_norm)
  entropy = -jnp.sum(probs * log_probs, axis=-1)
  return logp, jnp.where(valid, entropy, 0.0)


def _compute_dtype(hidden, lm_head):
  return jnp.promote_types(jnp.result_type(hidden), jnp.result_type(lm_head))


def _chunk_logits(h_chunk, w, inv_temperature, cdt):
  """Logits of one chunk, [B, c, D] x [D, V] -> [B, c, V], accumulated in float32."""
  s = jnp.einsum("bcd,dv->bcv", h_chunk.astype(cdt), w,
                 preferred_element_type=jnp.float32)
  return s.astype(jnp.float32) * inv_temperature


def _chunked_forward(hs, w, ys, temperature, with_entropy):
  """Scans over chunks; returns per-token log p and entropy as [n, B, c] arrays."""
  cdt = _compute_dtype(hs, w)
  wc = w.astype(cdt)
  inv_t = 1.0 / temperature

  def body(_, xs):
    h_c, y_c = xs
    z = _chunk_logits(h_c, wc, inv_t, cdt)
    shifted, log_norm = _shift_and_normalizer(z)
    shifted_target = jnp.take_along_axis(shifted, y_c[..., None], axis=-1)
    logp = (shifted_target - log_norm)[..., 0]
    if with_entropy:
      log_q = shifted - log_norm
      entropy = -jnp.sum(jnp.exp(log_q) * log_q, axis=-1)
    else:
      entropy = None
    return None, (logp, entropy)

  _, (logp, entropy) = lax.scan(body, None, (hs, ys))
  return (logp, entropy) if with_entropy else logp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_logprobs(hs, w, ys, temperature, with_entropy):
  return _chunked_forward(hs, w, ys, temperature, with_entropy)


def _fused_logprobs_fwd(hs, w, ys, temperature, with_entropy):
  out = _chunked_forward(hs, w, ys, temperature, with_entropy)
  # Residuals are the inputs only: no [..., V] array survives the forward pass.
  return out, (hs, w, ys, temperature)


def _fused_logprobs_bwd(with_entropy, res, g):
  hs, w, ys, temperature = res
  g_logp, g_ent = g if with_entropy else (g, None)
  cdt = _compute_dtype(hs, w)
  wc = w.astype(cdt)
  inv_t = 1.0 / temperature
  vocab = w.shape[1]

  def body(carry, xs):
    dw, dtemp = carry
    if with_entropy:
      h_c, y_c, g_c, g_ent_c = xs
    else:
      h_c, y_c, g_c = xs
    z = _chunk_logits(h_c, wc, inv_t, cdt)
    # The normaliser (and entropy) are recomputed from these very logits instead of
    # being saved by the forward pass, so q is normalised for the logits differentiated
    # here even if the recomputed matmul rounds differently.
    shifted, log_norm = _shift_and_normalizer(z)
    log_q = shifted - log_norm
    q = jnp.exp(log_q)
    onehot = lax.broadcasted_iota(jnp.int32, z.shape, 2) == y_c[..., None]
    # d logp / dz = onehot - q;  d H / dz = -q (log q + H).
    dz = g_c[..., None] * (onehot.astype(jnp.float32) - q)
    if with_entropy:
      entropy = -jnp.sum(q * log_q, axis=-1, keepdims=True)
      dz = dz - g_ent_c[..., None] * q * (log_q + entropy)
    # z = s / tau  =>  ds = dz / tau  and  dtau = -sum(dz * z) / tau.
    dtemp = dtemp - jnp.sum(dz * z) * inv_t
    ds = (dz * inv_t).astype(cdt)
    dh_c = jnp.einsum("bcv,dv->bcd", ds, wc, preferred_element_type=jnp.float32)
    dw = dw + jnp.einsum("bcd,bcv->dv", h_c.astype(cdt), ds,
                         preferred_element_type=jnp.float32)
    return (dw, dtemp), dh_c.astype(hs.dtype)

  xs = (hs, ys, g_logp) + ((g_ent,) if with_entropy else ())
  init = (jnp.zeros((hs.shape[-1], vocab), jnp.float32), jnp.zeros((), jnp.float32))
  (dw, dtemp), dhs = lax.scan(body, init, xs)
  return dhs, dw.astype(w.dtype), None, dtemp.astype(jnp.result_type(temperature))


_fused_logprobs.defvjp(_fused_logprobs_fwd, _fused_logprobs_bwd)


def default_chunk_size(batch: int, time: int) -> int:
  """Sequence positions per chunk when ``chunk_size=None``: about 1024 tokens per step.

  Returns ``min(T, max(1, 1024 // B))``.

  Examples:
    >>> default_chunk_size(8, 4096), default_chunk_size(1, 100), default_chunk_size(4096, 8)
    (128, 100, 1)
  """
  return max(1, min(time, max(1, _DEFAULT_TOKENS_PER_CHUNK // max(batch, 1))))


def token_logprobs_from_hidden(hidden: ArrayLike, lm_head: ArrayLike, targets: ArrayLike,
                               *, mask: ArrayLike | None = None,
                               chunk_size: int | None = None, return_entropy: bool = False,
                               temperature: float | ArrayLike = 1.0
                               ) -> jax.Array | tuple[jax.Array, jax.Array]:
  r"""Target-token log-probs from hidden states and LM head, never forming [B, T, V] logits.

  .. math::

    z_{b,t} = h_{b,t} W / \tau, \qquad
    \log p_{b,t} = z_{b,t,y_{b,t}} - \log\sum_v e^{z_{b,t,v}}, \qquad
    H_{b,t} = -\sum_v p_{b,t,v}\log p_{b,t,v}

  The sequence is split into ``ceil(T / chunk_size)`` chunks (the last one padded and
  the padding dropped) and a ``lax.scan`` computes one ``[B, chunk_size, V]`` block of
  logits at a time. A ``jax.custom_vjp`` saves nothing but its inputs; the backward pass
  scans the chunks again, recomputes each chunk's logits, softmax and entropy, and
  accumulates

  .. math::

    \frac{\partial L}{\partial z} = g^{\log p}\,(\mathrm{onehot}(y) - p)
      - g^{H}\, p\,(\log p + H), \quad
    \frac{\partial L}{\partial W} = \sum_{\text{chunks}} h_c^\top
      \frac{\partial L}{\partial z_c} / \tau, \quad
    \frac{\partial L}{\partial h_c} = \frac{\partial L}{\partial z_c} W^\top / \tau,

  so the peak memory of forward + backward grows with ``B * chunk_size * V`` (plus the
  ``[D, V]`` float32 gradient accumulator), not with ``T``. Gradients are exact (same
  math as the full log-softmax) for ``hidden``, ``lm_head``, ``temperature`` and through
  the entropy, which can therefore be used in an entropy bonus. The cost is one extra
  ``[B, T, D] x [D, V]`` matmul in the backward pass (four instead of three).

  Dtypes: the matmuls take their operands in the promoted input dtype and accumulate in
  float32 (``preferred_element_type``), so bf16 ``hidden``/``lm_head`` are multiplied
  exactly and summed in float32; log-sum-exp, softmax, entropy and all reductions are
  float32. In the backward pass of bf16 inputs the logit cotangent is rounded to bf16
  before the two matmuls (as autodiff of a bf16 head would do); the ``lm_head`` gradient
  is accumulated over chunks in float32 and cast to ``lm_head.dtype`` once; the
  ``hidden`` gradient has ``hidden.dtype``. Outputs are float32.

  Masking: outputs at masked positions are 0, their hidden states are zeroed before the
  matmul (NaN or garbage there never reaches a valid output or a gradient) and their
  targets may hold any value (e.g. -100). Targets at valid positions outside ``[0, V)``
  are clipped into range (a data fault, not an error). ``temperature`` must be > 0:
  a Python number <= 0 raises ``ValueError``; a traced one is not checked (0 gives
  non-finite log-probs).

  Args:
    hidden: ``[B, T, D]`` float hidden states aligned with ``targets`` (for a causal
      LM, the states at positions ``0..T-1`` predicting ``tokens[:, 1:]``).
    lm_head: ``[D, V]`` float output projection (pass ``embedding.T`` for tied
      embeddings).
    targets: ``[B, T]`` integer token ids.
    mask: optional ``[B, T]`` mask, 1 = valid. ``None`` means all valid.
    chunk_size: static number of sequence positions per chunk; ``None`` picks
      :func:`default_chunk_size` (about 1024 tokens per step). Values above ``T`` are
      clamped to ``T``. Need not divide ``T``.
    return_entropy: also return the per-token entropy of ``softmax(z)``.
    temperature: traced scalar :math:`\tau > 0`; changing it does not recompile.
      A Python number <= 0 raises ``ValueError``.

  Returns:
    ``logp`` ``[B, T]`` float32, or ``(logp, entropy)`` when ``return_entropy``.

  Raises:
    ValueError: at trace time, on wrong ranks, dtypes or mismatched shapes, or a
      Python ``temperature <= 0``, naming the argument.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> hidden = jnp.ones((1, 3, 2))
    >>> lm_head = jnp.array([[0., 1., 0.], [0., 1., 0.]])
    >>> logp = token_logprobs_from_hidden(hidden, lm_head, jnp.array([[1, 0, 2]]),
    ...                                   chunk_size=2)
    >>> [round(float(x), 4) for x in logp[0]]
    [-0.2395, -2.2395, -2.2395]
    >>> grad_w = jax.grad(lambda w: token_logprobs_from_hidden(
    ...     hidden, w, jnp.array([[1, 0, 2]])).sum())(lm_head)
    >>> grad_w.shape
    (2, 3)
  """
  v.check_rank("hidden", hidden, 3)
  v.check_float("hidden", hidden)
  v.check_rank("lm_head", lm_head, 2)
  v.check_float("lm_head", lm_head)
  batch, time, dim = v.shape_of(hidden)
  if v.shape_of(lm_head)[0] != dim:
    raise ValueError(
        f"`lm_head` must have shape [D, V] with D = hidden.shape[-1] = {dim}, got "
        f"{v.shape_of(lm_head)} (hidden {v.shape_of(hidden)}).")
  _check_vocab("lm_head", v.shape_of(lm_head)[1], v.shape_of(lm_head))
  vocab = v.shape_of(lm_head)[1]
  _check_targets(targets, (batch, time))
  _check_temperature(temperature)
  if chunk_size is not None and (isinstance(chunk_size, bool)
                                 or not isinstance(chunk_size, int) or chunk_size < 1):
    raise ValueError(f"`chunk_size` must be a positive int or None, got {chunk_size!r}.")
  valid, safe_targets = _prepare_mask_targets(mask, targets, vocab)

  if time == 0 or batch == 0:
    zeros = jnp.zeros((batch, time), jnp.float32)
    return (zeros, zeros) if return_entropy else zeros

  chunk = default_chunk_size(batch, time) if chunk_size is None else min(chunk_size, time)
  n_chunks = -(-time // chunk)
  pad = n_chunks * chunk - time

  h = jnp.where(valid[..., None], hidden, jnp.zeros((), jnp.result_type(hidden)))
  y = safe_targets
  if pad:
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(y, ((0, 0), (0, pad)))
  # [B, n*c, D] -> [n, B, c, D]: scan over chunks of the sequence, batch kept whole (so a
  # batch-sharded input stays sharded inside the scan).
  hs = h.reshape(batch, n_chunks, chunk, dim).swapaxes(0, 1)
  ys = y.reshape(batch, n_chunks, chunk).swapaxes(0, 1)
  temperature = jnp.asarray(temperature, jnp.float32)

  out = _fused_logprobs(hs, lm_head, ys, temperature, bool(return_entropy))

  def unchunk(x):
    x = x.swapaxes(0, 1).reshape(batch, n_chunks * chunk)[:, :time]
    return jnp.where(valid, x, 0.0)

  if return_entropy:
    logp, entropy = out
    return unchunk(logp), unchunk(entropy)
  return unchunk(out)
