"""Reference models: a causal transformer LM with a value head (Flax NNX), its
Hugging Face bridge (``from_pretrained`` / ``save_pretrained``: Llama, Qwen2, Qwen3) and
its GGUF bridge (``from_gguf`` / ``save_gguf``: llama.cpp files of the same families)."""

from jaxrl_llm.models.gguf import from_gguf, save_gguf
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
    "from_gguf",
    "from_pretrained",
    "rope",
    "rope_frequencies",
    "save_gguf",
    "save_pretrained",
    "split_model",
]
