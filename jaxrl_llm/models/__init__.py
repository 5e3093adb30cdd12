"""Reference models: a causal transformer LM with a value head (Flax NNX)."""

from jaxrl_llm.models.transformer import DecodeFns
from jaxrl_llm.models.transformer import KVCache
from jaxrl_llm.models.transformer import PRESETS
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.models.transformer import TransformerConfig
from jaxrl_llm.models.transformer import get_config
from jaxrl_llm.models.transformer import make_apply_fn
from jaxrl_llm.models.transformer import make_decode_fns
from jaxrl_llm.models.transformer import rope
from jaxrl_llm.models.transformer import split_model

__all__ = [
    "DecodeFns",
    "KVCache",
    "PRESETS",
    "Transformer",
    "TransformerConfig",
    "get_config",
    "make_apply_fn",
    "make_decode_fns",
    "rope",
    "split_model",
]
