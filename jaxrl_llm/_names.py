"""Mode names shared by the numerical modules and the configs, importable without JAX
(the ``jaxrl-llm`` command lists them in ``--help`` and checks flags against them
before importing JAX)."""

# The reductions of per-token losses (jaxrl_llm.losses.aggregate).
AGGREGATION_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# The solvers of the reverse linear recurrence behind GAE and returns
# (jaxrl_llm.advantages.reverse_linear_recurrence).
GAE_METHODS = ("scan", "associative")

# The levels of rollout correction (jaxrl_llm.rollout_correction_weights).
ROLLOUT_LEVELS = ("token", "sequence")

# The built-in task of a run without a dataset (jaxrl_llm.tasks.get_task, RunConfig.task).
DEFAULT_TASK = "reverse"

# Tokens sampled per completion of a JSONL dataset's prompt (JsonlTask.max_new_tokens,
# RunConfig.max_new_tokens: `jaxrl-llm train --dataset ... --max-new-tokens`).
DEFAULT_MAX_NEW_TOKENS = 64

# The reference transformer's size presets (jaxrl_llm.models.get_config).
MODEL_PRESETS = ("tiny", "small")

# How the RL loop generates completions (RunConfig.rollout): the continuous-batching
# engine (jaxrl_llm.rollout.RolloutEngine), the rectangular sampler (sample) or an
# in-process vLLM (jaxrl_llm.rollout.vllm.VllmEngine, weights pushed every step).
ROLLOUT_BACKENDS = ("engine", "simple", "vllm")

# LoRA targets (PEFT's `<name>_proj` modules) and the frozen base's storage
# (jaxrl_llm.models.lora; `jaxrl-llm train --lora-targets / --lora-base-dtype`).
LORA_TARGET_NAMES = ("q", "k", "v", "o", "gate", "up", "down")
LORA_BASE_DTYPES = ("bf16", "int8", "nf4")

# What a GGUF export stores its weight matrices as (jaxrl_llm.models.gguf.save_gguf;
# `jaxrl-llm export --gguf-type`).
GGUF_WRITE_TYPES = ("f32", "f16", "bf16", "q8_0")
