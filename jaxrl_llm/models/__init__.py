"""Reference models: a causal transformer LM with a value head (Flax NNX), and its
Hugging Face bridge (``from_pretrained`` / ``save_pretrained``: Llama, Qwen2, Qwen3)."""

from jaxrl_llm.models.hf import from_pretrained, save_pretrained
from jaxrl_llm.models.transformer import (
    PRESETS,
    KVCache,
    RopeScaling,
    Transformer,
    TransformerConfig,
    get_config,
    make_apply_fn,
    make_decode_fns,
    make_paged_decode_fns,
    rope,
    rope_frequencies,
    split_model,
)

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
