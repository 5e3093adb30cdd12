"""Types and input helpers shared by the loss modules (private)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxrl_llm import _validate as v

ArrayLike = jax.typing.ArrayLike
Coef = float | jax.Array  # a coefficient: a Python number, or a (traced) scalar array
LossAndMetrics = tuple[jax.Array, dict[str, jax.Array]]


def check_positive(name: str, x: Any) -> None:
  """``x > 0`` for a concrete number (traced values and None pass)."""
  v.check_range(name, x, low=0.0, low_open=True)


def check_nonnegative(name: str, x: Any) -> None:
  """``x >= 0`` for a concrete number (traced values and None pass)."""
  v.check_range(name, x, low=0.0)


def check_token_inputs(logp: ArrayLike, mask: ArrayLike,
                       others: Iterable[tuple[str, ArrayLike | None]] = ()) -> None:
  """Checks logp [B, T], mask [B, T] and extra same-shape float arrays."""
  v.check_rank("logp", logp, 2)
  v.check_float("logp", logp)
  v.check_same_shape(("logp", "mask"), (logp, mask))
  for name, x in others:
    if x is None:
      continue
    v.check_float(name, x)
    v.check_same_shape(("logp", name), (logp, x))


def masked_f32(x: ArrayLike, valid: ArrayLike) -> jax.Array:
  """float32 copy of x with masked entries replaced by 0 (so NaN/inf never leak)."""
  return jnp.where(valid, v.as_f32(x), 0.0)


def finish(loss: ArrayLike, valid: ArrayLike, dtype: DTypeLike) -> jax.Array:
  """``loss`` with 0 where ``mask`` is 0, cast to the output ``dtype``."""
  return jnp.where(valid, loss, 0.0).astype(dtype)
