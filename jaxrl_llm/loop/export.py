"""A trained run on a Hugging Face model, written back as Hugging Face folders.

:func:`export_run` restores the latest checkpoint of a run folder whose ``--model``
was a local Hugging Face checkpoint and writes, under ``dest`` (default: the run
folder):

* ``hf/``: the trained **policy** alone, a plain Hugging Face model folder
  (:func:`~jaxrl_llm.models.save_pretrained`: ``config.json`` and
  ``generation_config.json`` with the original ``bos``/``eos``/``pad`` token ids, else
  the tokenizer's, by :func:`~jaxrl_llm.models.hf.token_id_fields`; safetensors) plus
  the original tokenizer files
  (``tokenizer.json``, ``tokenizer_config.json`` with its chat template,
  ``generation_config.json``, ...) copied as they were, so
  ``transformers.AutoModelForCausalLM.from_pretrained(dest + "/hf")``,
  ``AutoTokenizer.from_pretrained`` and vLLM load it directly;
* the **value model**, kept out of ``hf/`` (it is not part of a Hugging Face causal
  LM), for recipes with one: ``value_head.safetensors`` for the policy's shared value
  head (``from_pretrained(dest + "/hf", value_head=dest + "/value_head.safetensors")``
  rebuilds the trained model with its head), or ``critic/`` for a separate critic (a
  model folder with its ``value_head.safetensors``: ``--critic dest/critic`` or
  ``from_pretrained(dest + "/critic", value_head=True)`` loads it).

A LoRA run (``--lora-rank``): ``adapter/`` holds the adapters in PEFT's format
(``adapter_model.safetensors`` + ``adapter_config.json``:
``peft.PeftModel.from_pretrained(base, dest + "/adapter")`` on the original
``--model``), and ``hf/`` is written only with ``merge_lora=True`` (``export
--merge-lora``): the adapters merged into the (dequantised) base weights, a plain
Hugging Face folder whose logits equal the adapter model's.

A run whose ``--model`` was a GGUF file (or a packaged model): ``hf/`` gets the
tokenizer read from the file (``tokenizer.json``, ``tokenizer_config.json`` with its
chat template) in place of copied files. ``gguf_type`` (``export --gguf
[--gguf-type T]``) also writes ``policy.gguf`` (:func:`~jaxrl_llm.models.gguf.save_gguf`,
adapters merged, with the run's tokenizer) for llama.cpp, Ollama and LM Studio.

``jaxrl-llm train --model PATH`` calls it at the end of the run (the summary names
the folders); ``jaxrl-llm export RUN [--out DEST]`` calls it on a finished or
interrupted run (its latest checkpoint).

Every output is written into a fresh folder first and then moved into ``dest``,
replacing what had its name there (:func:`_staged`): nothing is written through a link
a crafted run folder may hold (``hf -> elsewhere``, ``hf/model.safetensors -> F``), and
an export that fails leaves the previous outputs whole.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

# Files of a model folder that describe its tokenizer and generation, copied as is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt")


def restore_run(run_dir: str) -> tuple[Any, Any, Any, int]:
  """``(run, model, critic, step)``: a run's latest checkpoint as models.

  ``model`` is the policy :class:`~jaxrl_llm.models.Transformer` (with its value head
  when the recipe shares one) and ``critic`` the separate critic (or None).

  Raises:
    ValueError: ``run_dir`` is not a run folder, has no checkpoint, or its model is
      not a Hugging Face folder.
  """
  run, model, critic, step, _ = _restore(run_dir)
  return run, model, critic, step


def _policy_checksums(graphdef: Any, params: Any, critic: bool) -> list:
  """The checksums of the policy's own leaves (no value head, no critic) in
  :func:`~jaxrl_llm.checkpoint.fingerprint`: equal for bit-identical weights."""
  from jaxrl_llm.checkpoint import fingerprint
  from jaxrl_llm.models.critic import POLICY, drop_value_head
  policy = params[POLICY] if critic else drop_value_head(graphdef, params)[1]
  return fingerprint(policy)["checksums"]


def _return_freed_memory() -> None:
  """Hands the heap's freed pages back to the operating system (glibc's
  ``malloc_trim``; nothing elsewhere): a freed model's ~0.4 GB would otherwise stay in
  the process's resident set under the next one's."""
  import ctypes
  import ctypes.util
  import gc
  gc.collect()
  name = ctypes.util.find_library("c")
  libc = ctypes.CDLL(name) if name else None
  if libc is not None and hasattr(libc, "malloc_trim"):
    libc.malloc_trim(0)


def _restore(run_dir: str) -> tuple[Any, Any, Any, int, bool]:
  """:func:`restore_run` and whether the policy's weights are bit-identical to the
  starting ``--model``'s (no update changed them).

  Only the parameters are read from the checkpoint (never the optimizer state), and
  the starting weights are let go before they are: the comparison uses their exact
  checksums (:func:`~jaxrl_llm.checkpoint.fingerprint`), so the host holds one copy
  of the model at a time."""
  from flax import nnx

  from jaxrl_llm.checkpoint import abstract_like
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import (
    is_checkpoint,
    load_models,
    make_task,
    read_run,
    restore_params,
  )
  from jaxrl_llm.models.critic import CRITIC, POLICY

  run = read_run(run_dir)
  if not is_checkpoint(run.model):
    raise ValueError(f"the run in {run_dir} trained the preset model {run.model!r}; "
                     "export needs a run of a checkpoint --model (a Hugging Face folder, "
                     "a GGUF file or a packaged model).")
  task = make_task(run)
  graphdef, params, critic_graphdef = load_models(resolve(run, task), task)
  if run.lora_rank is not None:
    from jaxrl_llm.loop.setup import lora_model
    if critic_graphdef is None:
      graphdef, params = lora_model(run, graphdef, params)
    else:
      graphdef, policy_params = lora_model(run, graphdef, params[POLICY])
      params = {**params, POLICY: policy_params}
  critic = critic_graphdef is not None
  start = _policy_checksums(graphdef, params, critic)
  template = abstract_like(params)
  del params
  _return_freed_memory()
  params, step = restore_params(run_dir, template)
  unchanged = start == _policy_checksums(graphdef, params, critic)
  if not critic:
    return run, nnx.merge(graphdef, params), None, step, unchanged
  return (run, nnx.merge(graphdef, params[POLICY]),
          nnx.merge(critic_graphdef, params[CRITIC]), step, unchanged)


@contextlib.contextmanager
def _staged(dest: str, write: bool = True) -> Iterator[str]:
  """Within: a fresh, empty folder to write ``dest``'s outputs into (``mkdtemp`` in
  ``dest``: no link can be there before it). On a clean exit each entry it holds
  replaces the one of that name in ``dest``: a link or file there is unlinked (the
  name, never what it points to), an old folder removed whole (``rmtree`` follows no
  link). The staging folder is always removed. ``write`` False (a process other than
  0, which writes nothing): a path never created, and nothing moved."""
  if not write:
    yield os.path.join(dest, ".export-not-written")
    return
  os.makedirs(dest, exist_ok=True)
  stage = tempfile.mkdtemp(prefix=".export-", dir=dest)
  try:
    yield stage
    for name in sorted(os.listdir(stage)):
      target = os.path.join(dest, name)
      if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
      elif os.path.lexists(target):
        os.unlink(target)
      os.replace(os.path.join(stage, name), target)
  finally:
    shutil.rmtree(stage, ignore_errors=True)


def export_run(run_dir: str, dest: str | None = None, *, merge_lora: bool = False,
               gguf_type: str | None = None) -> dict:
  """Writes a run's latest checkpoint as Hugging Face folders (see the module doc).

  Args:
    run_dir: the run folder of a ``--model PATH`` run.
    dest: where to write (default ``run_dir``): ``dest/hf/`` and, with a value model,
      ``dest/value_head.safetensors`` or ``dest/critic/``.
    merge_lora: a LoRA run: also write ``dest/hf/`` with the adapters merged.
    gguf_type: also write the policy (adapters merged) as ``dest/policy.gguf`` in this
      :data:`~jaxrl_llm.models.gguf.WRITE_TYPES` type, with the run's tokenizer, for
      llama.cpp / Ollama / LM Studio.

  Returns:
    ``{"hf_model": ..., "value_model": ...}`` (paths; ``value_model`` only when the
    recipe has one), for the run summary; ``policy_weights`` says ``UNCHANGED`` when
    the exported policy is bit-identical to the starting ``--model`` (a run without
    learning signal: :mod:`jaxrl_llm.loop.signals`).

  Raises:
    ValueError: as :func:`restore_run`; ``merge_lora`` on a run without adapters
      (before anything is written).
  """
  import jax

  if merge_lora:
    from jaxrl_llm.loop.setup import read_run
    if read_run(run_dir).lora_rank is None:
      raise ValueError(f"--merge-lora: the run in {run_dir} trained no LoRA adapters "
                       "(no --lora-rank); export it without --merge-lora.")
  if gguf_type is not None:
    from jaxrl_llm.models.gguf import WRITE_TYPES
    if gguf_type not in WRITE_TYPES:
      raise ValueError(f"--gguf-type must be one of {', '.join(WRITE_TYPES)}, got "
                       f"{gguf_type!r}.")
  run, model, critic, step, unchanged = _restore(run_dir)
  dest = run_dir if dest is None else dest
  with _staged(dest, write=jax.process_index() == 0) as stage:
    out = _write_export(run, model, critic, step, stage, merge_lora, gguf_type)
  if unchanged:
    out["policy_weights"] = (
        f"UNCHANGED: bit-identical to {run.model} after {step} steps (every update was "
        "zero: see 'warning' in the run summary, or the rewards in metrics.jsonl)")
  # The paths the outputs have now, in dest.
  return {k: v.replace(stage, dest) for k, v in out.items()}


def _write_export(run: Any, model: Any, critic: Any, step: int, dest: str,
                  merge_lora: bool, gguf_type: str | None) -> dict:
  """Writes the outputs of :func:`export_run` into the folder ``dest``."""
  import jax
  from flax import nnx

  from jaxrl_llm.loop.setup import model_file
  from jaxrl_llm.model_files import is_gguf
  from jaxrl_llm.models.critic import drop_value_head
  from jaxrl_llm.models.hf import (
    read_hf_config,
    save_pretrained,
    save_value_head,
    token_id_fields,
  )
  from jaxrl_llm.models.transformer import split_model
  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  source = model_file(run.model)
  hf_dir = os.path.join(dest, "hf")
  # A GGUF source has no config.json or tokenizer files to carry over: its tokenizer
  # (read from the file) is saved by save_pretrained instead.
  from_gguf = is_gguf(source)
  original = {} if from_gguf else read_hf_config(source)
  tokenizer = None
  if from_gguf or os.path.isfile(os.path.join(source, "tokenizer.json")):
    tokenizer = HFTokenizer.from_pretrained(source)
  # The original config's ids, else the tokenizer's (the rule save_pretrained applies);
  # an original generation_config.json is copied over the written one below.
  extra = token_id_fields(tokenizer=tokenizer, config=original)
  out: dict[str, str] = {}
  if run.lora_rank is not None:
    from jaxrl_llm.models.lora import base_graphdef, save_lora_adapters
    from jaxrl_llm.models.lora import merge_lora as merged_params
    graphdef, params = split_model(model)
    adapter_dir = os.path.join(dest, "adapter")
    if jax.process_index() == 0:
      save_lora_adapters(params, model.lora_spec, model.config, adapter_dir,
                         base_model=os.path.abspath(source))
    out["adapter"] = f"{adapter_dir} (PEFT, step {step})"
    model = nnx.merge(base_graphdef(model), jax.jit(merged_params, static_argnums=0)(
        graphdef, params))
  policy = nnx.merge(*drop_value_head(*split_model(model)))
  if run.lora_rank is None or merge_lora:
    save_pretrained(policy, hf_dir, extra_config=extra,
                    tokenizer=tokenizer if from_gguf else None)
    if jax.process_index() == 0 and not from_gguf:
      for name in TOKENIZER_FILES:
        src = os.path.join(source, name)
        if os.path.isfile(src):
          shutil.copyfile(src, os.path.join(hf_dir, name))
    out["hf_model"] = f"{hf_dir} (step {step})"
  if gguf_type is not None:
    from jaxrl_llm.models.gguf import save_gguf
    gguf_file = os.path.join(dest, "policy.gguf")
    save_gguf(policy, gguf_file, gguf_type=gguf_type, tokenizer=tokenizer)
    out["gguf_model"] = (f"{gguf_file} ({gguf_type}, step {step}"
                         f"{'' if tokenizer is not None else ', no tokenizer'})")
  if critic is not None:
    critic_dir = os.path.join(dest, "critic")
    save_pretrained(critic, critic_dir, extra_config=extra)
    out["value_model"] = f"{critic_dir} (separate critic)"
  elif model.config.value_head:
    value_file = os.path.join(dest, "value_head.safetensors")
    save_value_head(model, value_file)
    out["value_model"] = f"{value_file} (value head of {hf_dir})"
  return out


__all__ = ["TOKENIZER_FILES", "export_run", "restore_run"]
