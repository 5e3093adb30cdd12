"""A fixed character-level tokenizer for the built-in tasks (nothing to download).

Every character is one token. Ids ``0, 1, 2`` are the special tokens ``<pad>``,
``<bos>`` and ``<eos>``; the characters of ``chars`` follow, in order. The default
alphabet holds what the built-in tasks need (digits and ``+-*=(),`` and space), 21
tokens in all, so a policy trained from scratch starts with a small action space.
Pass your own ``chars`` (for example ``DIGITS + SYMBOLS + LETTERS``) for tasks that
need more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
DIGITS = "0123456789"
SYMBOLS = "+-*=(), "
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DEFAULT_CHARS = DIGITS + SYMBOLS

#: What `decode` writes for an id outside the vocabulary (e.g. sampled from a model
#: whose embedding table is padded past `vocab_size`). No task accepts it.
UNKNOWN_CHAR = "\ufffd"


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """One token per character, with ``pad=0``, ``bos=1``, ``eos=2``.

  Args:
    chars: the characters of the vocabulary, each once; ids ``3, 4, ...`` in order.

  Examples:
    >>> tok = CharTokenizer()
    >>> tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id
    (21, 0, 1, 2)
    >>> ids = tok.encode("12+3=", add_eos=True)
    >>> ids
    [4, 5, 13, 6, 16, 2]
    >>> tok.decode(ids + [7, 8])  # stops at the first eos
    '12+3='
    >>> tokens, mask = tok.encode_batch(["1+2=", "10+20="], length=6)
    >>> tokens.tolist()
    [[0, 0, 4, 13, 5, 16], [4, 3, 13, 5, 3, 16]]
    >>> mask.tolist()
    [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
  """

  chars: str = DEFAULT_CHARS

  def __post_init__(self) -> None:
    if not isinstance(self.chars, str) or not self.chars:
      raise ValueError(f"`chars` must be a non-empty string, got {self.chars!r}.")
    if len(set(self.chars)) != len(self.chars):
      dup = sorted({c for c in self.chars if self.chars.count(c) > 1})
      raise ValueError(f"`chars` must not repeat a character, got repeats {dup}.")
    object.__setattr__(self, "_to_id", {c: i + 3 for i, c in enumerate(self.chars)})

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  @property
  def vocab_size(self) -> int:
    return len(self.chars) + 3

  def id_to_token(self, i: int) -> str:
    """The string of one id: a character, ``<pad>``/``<bos>``/``<eos>`` or `UNKNOWN_CHAR`."""
    i = int(i)
    if 0 <= i < 3:
      return (PAD, BOS, EOS)[i]
    if 3 <= i < self.vocab_size:
      return self.chars[i - 3]
    return UNKNOWN_CHAR

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Ids of ``text``, one per character.

    Raises:
      ValueError: if ``text`` holds a character outside the vocabulary.
    """
    try:
      ids = [self._to_id[c] for c in text]  # type: ignore[attr-defined]
    except KeyError as e:
      raise ValueError(
          f"`text` {text!r} holds {e.args[0]!r}, which is not in the vocabulary "
          f"{self.chars!r}.") from None
    return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ``ids``: stops at the first eos, skips pad and bos.

    Ids outside ``[0, vocab_size)`` decode to `UNKNOWN_CHAR` (so no reward accepts
    them) instead of raising, since a model's sampler may emit them.
    """
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
      if i == self.eos_id:
        break
      if i in (self.pad_id, self.bos_id):
        continue
      out.append(self.id_to_token(i))
    return "".join(out)

  def decode_batch(self, ids: ArrayLike, mask: ArrayLike | None = None) -> list[str]:
    """`decode` of each row of ``ids`` [B, T]; positions where ``mask`` is 0 are skipped.

    Raises:
      ValueError: if ``ids`` is not rank 2 or ``mask`` has another shape.
    """
    ids = np.asarray(ids)
    if ids.ndim != 2:
      raise ValueError(f"`ids` must have rank 2 [B, T], got shape {ids.shape}.")
    if mask is not None:
      mask = np.asarray(mask)
      if mask.shape != ids.shape:
        raise ValueError(
            f"`mask` must have the shape of `ids` {ids.shape}, got {mask.shape}.")
      return [self.decode(row[m.astype(bool)]) for row, m in zip(ids, mask)]
    return [self.decode(row) for row in ids]

  def encode_batch(
      self,
      prompts: Sequence[str],
      length: int,
      left_pad: bool = True,
      *,
      add_bos: bool = False,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Encodes and pads ``prompts`` to ``length`` tokens.

    Left padding (the default) puts every prompt's last token in the last column, so a
    KV-cache sampler decodes the whole batch from the same position.

    Args:
      prompts: B strings.
      length: the padded length T.
      left_pad: pad on the left (True) or on the right (False).
      add_bos: start every prompt with the bos token (counts towards ``length``).

    Returns:
      ``(tokens, mask)``, both ``np.int32`` of shape [B, T]; ``mask`` is 1 on prompt
      tokens and 0 on padding (where ``tokens`` holds ``pad_id``).

    Raises:
      ValueError: if a prompt is longer than ``length`` tokens, ``length`` is not a
        positive int, or a prompt holds a character outside the vocabulary.
    """
    return pad_encoded(self.encode, prompts, length, pad_id=self.pad_id,
                       left_pad=left_pad, add_bos=add_bos)


def pad_encoded(encode: Callable[..., list[int]], prompts: Sequence[str], length: int, *,
                pad_id: int, left_pad: bool = True,
                add_bos: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Encodes ``prompts`` with ``encode(text, add_bos=...)`` and pads them to ``length``.

  The shared body of every tokenizer's ``encode_batch``: ``(tokens, mask)``, both
  ``np.int32`` ``[B, length]``, ``mask`` 1 on prompt tokens, ``tokens`` ``pad_id``
  elsewhere; left padding puts each prompt's last token in the last column.

  Examples:
    >>> pad_encoded(lambda t, add_bos: [ord(c) - 96 for c in t], ["ab", "c"], 3,
    ...             pad_id=0)[0].tolist()
    [[0, 1, 2], [0, 0, 3]]
  """
  if isinstance(prompts, str):
    raise ValueError("`prompts` must be a sequence of strings, got a single string.")
  if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 1:
    raise ValueError(f"`length` must be a positive int, got {length!r}.")
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), np.int32)
  for b, p in enumerate(prompts):
    ids = encode(p, add_bos=add_bos)
    if len(ids) > length:
      raise ValueError(
          f"`prompts`[{b}] {p!r} is {len(ids)} tokens, longer than `length`={length}.")
    sl = slice(length - len(ids), length) if left_pad else slice(0, len(ids))
    tokens[b, sl] = ids
    mask[b, sl] = 1
  return tokens, mask
