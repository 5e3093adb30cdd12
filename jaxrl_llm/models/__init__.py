"""Reference models: a causal transformer LM with a value head (Flax NNX), and its
Hugging Face bridge (``from_pretrained`` / ``save_pretrained``: Llama, Qwen2, Qwen3)."""

from jaxrl_llm.models.hf import from_pretrained
from jaxrl_llm.models.hf import save_pretrained
from jaxrl_llm.models.transformer import KVCache
from jaxrl_llm.models.transformer import PRESETS
from jaxrl_llm.models.transformer import RopeScaling
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.models.transformer import TransformerConfig
from jaxrl_llm.models.transformer import get_config
from jaxrl_llm.models.transformer import make_apply_fn
from jaxrl_llm.models.transformer import make_decode_fns
from jaxrl_llm.models.transformer import make_paged_decode_fns
from jaxrl_llm.models.transformer import rope
from jaxrl_llm.models.transformer import rope_frequencies
from jaxrl_llm.models.transformer import split_model

__all__ = [
    "KVCache",
    "PRESETS",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "get_config",
    "make_apply_fn",
    "make_decode_fns",
    "make_paged_decode_fns",
    "from_pretrained",
    "rope",
    "rope_frequencies",
    "save_pretrained",
    "split_model",
]
