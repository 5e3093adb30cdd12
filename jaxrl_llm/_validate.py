"""Trace-time argument checks shared by every public function.

All checks look only at static metadata (shape, dtype), so they are safe under
``jax.jit`` and raise a ``ValueError`` that names the offending argument.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp


def shape_of(x) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def check_rank(name: str, x, rank: int) -> None:
  if jnp.ndim(x) != rank:
    raise ValueError(
        f"`{name}` must have rank {rank}, got shape {shape_of(x)} (rank {jnp.ndim(x)})."
    )


def check_same_shape(names: Sequence[str], arrays: Sequence) -> None:
  """Raises unless every array in `arrays` has the shape of the first one."""
  first_name, first = names[0], arrays[0]
  for name, x in zip(names[1:], arrays[1:]):
    if x is not None and shape_of(x) != shape_of(first):
      raise ValueError(
          f"`{name}` must have the shape of `{first_name}` {shape_of(first)}, "
          f"got {shape_of(x)}."
      )


def check_float(name: str, x) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(
        f"`{name}` must be a floating-point array, got dtype {jnp.result_type(x)} "
        f"with shape {shape_of(x)}."
    )


def check_choice(name: str, value, choices: Sequence) -> None:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


def check_batch_vector(name: str, x, batch: int) -> None:
  """Checks a per-sequence array of shape [B]."""
  if shape_of(x) != (batch,):
    raise ValueError(f"`{name}` must have shape ({batch},), got {shape_of(x)}.")


def as_f32(x):
  return jnp.asarray(x, dtype=jnp.float32)


def out_dtype(*xs):
  """The float dtype results are cast back to: that of the first float input."""
  for x in xs:
    if x is not None and jnp.issubdtype(jnp.result_type(x), jnp.floating):
      return jnp.result_type(x)
  return jnp.float32


def is_concrete_number(x) -> bool:
  """True for a Python or NumPy real scalar (not bool): a value we can check now.

  Traced values (and JAX arrays) are not checked: data cannot raise under ``jax.jit``.
  """
  import numbers  # local imports keep the module's import block untouched for merges
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_number_range(name: str, x, *, low=None, high=None, low_inclusive=True,
                       high_inclusive=True) -> None:
  """Raises ``ValueError`` naming ``name`` if a concrete number is outside a range.

  ``None``, traced values and arrays pass unchecked (only Python/NumPy scalars are
  known at trace time). NaN is always out of range. ``low``/``high`` may be None
  (unbounded on that side).
  """
  if not is_concrete_number(x):
    return
  import math  # local imports keep the module's import block untouched for merges
  ok = True
  if low is not None:
    ok = ok and (x >= low if low_inclusive else x > low)
  if high is not None:
    ok = ok and (x <= high if high_inclusive else x < high)
  if ok and not math.isnan(x):
    return
  lo = "" if low is None else f"{'[' if low_inclusive else '('}{low}"
  hi = "" if high is None else f"{high}{']' if high_inclusive else ')'}"
  if low is not None and high is not None:
    want = f"in {lo}, {hi}"
  elif low is not None:
    want = f"{'>=' if low_inclusive else '>'} {low}"
  else:
    want = f"{'<=' if high_inclusive else '<'} {high}"
  raise ValueError(f"`{name}` must be {want}, got {x!r}.")
