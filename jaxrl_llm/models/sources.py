"""Loading a pretrained checkpoint whatever its kind (a Hugging Face folder or a GGUF
file; :mod:`jaxrl_llm.model_files` finds it, packaged models included).

Examples:
  >>> from jaxrl_llm.model_files import checkpoint_path
  >>> checkpoint_path("tiny") is None           # a preset: nothing to load from disk
  True
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.model_files import is_gguf
from jaxrl_llm.models.transformer import Transformer, TransformerConfig


def load_checkpoint(path: str, **kwargs: Any) -> Transformer:
  """:func:`~jaxrl_llm.models.gguf.from_gguf` for a ``.gguf`` file, else
  :func:`~jaxrl_llm.models.hf.from_pretrained` (``kwargs``: ``dtype``, ``mesh``,
  ``rules``, ``value_head``)."""
  if is_gguf(path):
    from jaxrl_llm.models.gguf import from_gguf
    return from_gguf(path, **kwargs)
  from jaxrl_llm.models.hf import from_pretrained
  return from_pretrained(path, **kwargs)


def checkpoint_config(path: str) -> TransformerConfig:
  """The architecture of the checkpoint at ``path`` (no weight is read)."""
  if is_gguf(path):
    from jaxrl_llm.models.gguf import read_gguf
    return read_gguf(path)[0]
  from jaxrl_llm.models.hf import config_from_hf, read_hf_config
  return config_from_hf(read_hf_config(path))


__all__ = ["checkpoint_config", "load_checkpoint"]
