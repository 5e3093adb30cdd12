r"""Rollout throughput: the continuous-batching engine vs the rectangular ``sample``.

Run: ``python -m benchmarks.rollout [--quick] [--json out.json]`` (flags scale every
size down; ``--no-hf`` skips the Hugging Face baseline, ``--no-group`` workload (c)).

One process, one model (a small reference transformer, random weights, float32; or
``--model NAME_OR_PATH``, a packaged model such as ``smollm2-135m-instruct`` or a
checkpoint folder / ``.gguf`` file, its vocabulary then drawing the prompts), the
same requests for every contender, sampling at temperature 1, stop ids off so that
every length is exact:

* (a) **heavy-tailed**: ``--requests`` prompts of ``--prompt`` tokens, 90% asking for
  ``--short`` new tokens and 10% for ``--long`` (shuffled).
* (b) **uniform**: the same prompts, all asking for ``--uniform`` new tokens.
* (c) **shared prompt**: ``--group`` samples of one ``--group-prompt``-token prompt
  (one request with ``n = G``) vs ``G`` distinct prompts of that length, each
  ``--group-new`` new tokens.

Contenders: :class:`jaxrl_llm.rollout.RolloutEngine` with ``--slots`` slots, and
:func:`jaxrl_llm.rollout.sample` on batches of ``--slots`` rows in request order (a
batch runs to its longest request), and Hugging Face ``transformers`` ``generate`` on
the same weights saved as a Llama checkpoint (batches of ``--slots`` rows, the first
``--hf-batches`` batches of each workload timed, tokens/s from those).
With ``--vllm``, also :class:`jaxrl_llm.rollout.vllm.VllmEngine` (vLLM in this process,
float32, prefix caching on, the same weights saved as a Llama checkpoint, the same
requests and seeds-per-sample; its KV cache is vLLM's preallocated pool, so only its
tokens/s is reported). On a small CPU run it with ``OMP_NUM_THREADS=1`` (set before
torch loads) and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB).
Useful tokens are the tokens the requests asked for; tokens/s = useful tokens / wall
time of the whole call (prefill included, compilation excluded: every contender runs
once untimed on the same shapes first). (a) and (b) are timed once, (c) is the median
of ``--group-repeats`` runs.

Also reported: slot utilisation (useful tokens / (slots x decode steps)), KV-cache
memory (the engine's pages in use, mean over decode steps and peak, against the
rectangular ``[rows, prompt + max_new]`` cache of one ``sample`` batch), and the
decode step time against the bytes a step must read (parameters + the KV of the
tokens in flight) over a memory-copy bandwidth measured in the same process (a
jitted ``x + 1`` over ``--copy-mb`` MB: read + write):

.. math::

  \text{bandwidth use} = \frac{(\text{param bytes} + \overline{\text{KV bytes in use}})
    / \text{copy bandwidth}}{\text{decode seconds} / \text{decode steps}}.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine, markdown_table, write_json
from jaxrl_llm.models import (
  Transformer,
  TransformerConfig,
  make_decode_fns,
  make_paged_decode_fns,
  split_model,
)
from jaxrl_llm.rollout import Request, RolloutEngine, sample


def _model(args):
  if args.model is not None:
    from jaxrl_llm.model_files import PACKAGED_MODELS, packaged_path
    from jaxrl_llm.models.sources import load_checkpoint
    path = packaged_path(args.model) if args.model in PACKAGED_MODELS else args.model
    model = load_checkpoint(path)
    args.vocab = model.config.vocab_size
    return model
  config = TransformerConfig(
      vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
      n_heads=args.heads, n_kv_heads=args.kv_heads, d_ff=args.d_ff,
      max_seq_len=max(args.prompt + max(args.long, args.uniform),
                      args.group_prompt + args.group_new),
      value_head=False, tie_embeddings=False)
  return Transformer(config, rngs=nnx.Rngs(0))


def _chunk(prompt_len: int) -> int:
  return min(128, 1 << max(3, (prompt_len - 1).bit_length()))


def heavy_tailed(args, count, seed=0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, args.vocab, args.prompt).tolist() for _ in range(count)]
  n_long = max(1, round(0.1 * count))
  lengths = np.array([args.long] * n_long + [args.short] * (count - n_long))
  rng.shuffle(lengths)
  return [Request(p, max_new_tokens=int(m)) for p, m in zip(prompts, lengths)]


def workloads(args):
  heavy = heavy_tailed(args, args.requests)
  uniform = [Request(r.prompt, max_new_tokens=args.uniform) for r in heavy]
  return {"heavy_tailed": heavy, "uniform": uniform}


# ----------------------------------------------------------------------------------
# Contenders
# ----------------------------------------------------------------------------------


def _batches(requests, rows):
  return [requests[i:i + rows] for i in range(0, len(requests), rows)]


def _left_pad(requests):
  width = max(len(r.prompt) for r in requests)
  tokens = np.zeros((len(requests), width), np.int32)
  mask = np.zeros((len(requests), width), np.float32)
  for row, r in enumerate(requests):
    tokens[row, width - len(r.prompt):] = r.prompt
    mask[row, width - len(r.prompt):] = 1
  return tokens, mask


def run_sample(run, params, requests, rows):
  """Rectangular batches of ``rows`` requests; returns (seconds, row-steps, rect KV
  tokens of the largest batch)."""
  def once():
    steps = kv = 0
    for i, batch in enumerate(_batches(requests, rows)):
      tokens, mask = _left_pad(batch)
      n = max(r.max_new_tokens for r in batch)
      out = run(params, tokens, mask, jax.random.key(i), max_new_tokens=n)
      jax.block_until_ready(out.completion)
      steps += len(batch) * n
      kv = max(kv, len(batch) * (tokens.shape[1] + n))
    return steps, kv

  once()                                    # compile every (shape, max_new)
  start = time.perf_counter()
  steps, kv = once()
  return time.perf_counter() - start, steps, kv


def run_engine(engine, params, requests, warmup, repeats=1):
  """(median seconds of ``repeats`` timed runs, the last run's stats)."""
  engine.generate(params, warmup, seed=1)   # compile on the same shapes
  if len(getattr(engine, "decode_widths", ())) > 1:
    engine.generate(params, requests, seed=1)   # every decode width the schedule uses
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = engine.generate(params, requests, seed=0)
    times.append(time.perf_counter() - start)
  seconds = float(np.median(times))
  assert [len(c.tokens) for c in out] == [r.max_new_tokens for r in requests
                                          for _ in range(r.n)]
  return seconds, dict(engine.stats)


def hf_model(model, folder):
  """The model as a transformers Llama in float32, or None when unavailable."""
  try:
    import torch
    import transformers

    from jaxrl_llm.models import save_pretrained
  except ImportError as e:
    print(f"(Hugging Face baseline skipped: {e})")
    return None
  save_pretrained(model, folder)
  torch.manual_seed(0)
  return transformers.AutoModelForCausalLM.from_pretrained(
      folder, dtype=torch.float32).eval()


def run_hf(hf, requests, rows, max_batches):
  """``generate`` on the first ``max_batches`` batches; (seconds, useful tokens)."""
  import torch
  seconds = useful = 0.0
  for i, batch in enumerate(_batches(requests, rows)[:max_batches]):
    tokens, mask = _left_pad(batch)
    n = max(r.max_new_tokens for r in batch)
    kwargs = {"input_ids": torch.tensor(tokens, dtype=torch.long),
              "attention_mask": torch.tensor(mask, dtype=torch.long), "do_sample": True,
              "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": n,
              "min_new_tokens": n, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
      if i == 0:   # warm-up on a short run
        hf.generate(**{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
      start = time.perf_counter()
      hf.generate(**kwargs)
      seconds += time.perf_counter() - start
    useful += sum(r.max_new_tokens for r in batch)
  return seconds, useful


def vllm_engine(model, folder, max_len):
  """The model in an in-process :class:`~jaxrl_llm.rollout.vllm.VllmEngine`, or None."""
  from jaxrl_llm.models import save_pretrained
  from jaxrl_llm.rollout.vllm import VllmEngine, VllmMissingError
  if not os.path.isfile(os.path.join(folder, "config.json")):
    save_pretrained(model, folder)
  try:
    return VllmEngine(folder, max_model_len=max_len, dtype="float32")
  except VllmMissingError as e:
    print(f"(vLLM column skipped: {e})")
    return None


def run_vllm(engine, requests, warmup, repeats=1):
  """Median seconds of ``repeats`` timed ``generate`` calls (after a warm-up)."""
  engine.generate(None, warmup, seed=1)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = engine.generate(None, requests, seed=0)
    times.append(time.perf_counter() - start)
  assert [len(c.tokens) for c in out] == [r.max_new_tokens for r in requests
                                          for _ in range(r.n)]
  return float(np.median(times))


def copy_bandwidth(mb: int) -> float:
  """Bytes/s of a jitted ``x + 1`` over ``mb`` MB of float32 (read + write)."""
  x = jnp.zeros((mb * 2 ** 20 // 4,), jnp.float32)
  f = jax.jit(lambda a: a + 1.0)
  jax.block_until_ready(f(x))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - start)
  return 2 * x.nbytes / float(np.median(times))


def group_workload(args, paged, run, params, vl, bytes_per_token):
  """(c): one prompt shared by ``--group`` samples vs as many distinct prompts; returns
  (rows, shared / distinct engine seconds)."""
  rng = np.random.default_rng(1)
  g, gp, gn = args.group, args.group_prompt, args.group_new
  group_engine = RolloutEngine(paged, max_slots=g, max_len=gp + gn,
                               page_size=args.page_size,
                               steps_per_call=args.steps_per_call, prefill_chunk=_chunk(gp))
  shared = [Request(rng.integers(1, args.vocab, gp).tolist(), n=g, max_new_tokens=gn)]
  distinct = [Request(rng.integers(1, args.vocab, gp).tolist(), max_new_tokens=gn)
              for _ in range(g)]
  warm = [Request([1] * gp, max_new_tokens=gn)]
  sh_s, sh_stats = run_engine(group_engine, params, shared, warm, args.group_repeats)
  di_s, di_stats = run_engine(group_engine, params, distinct, warm, args.group_repeats)
  sa_s, _, _ = run_sample(run, params, distinct, g)
  if vl is not None:
    vs_s = run_vllm(vl, shared, warm, args.group_repeats)
    vd_s = run_vllm(vl, distinct, warm, args.group_repeats)
  group_rows = [{"case": f"{g} samples of 1 prompt (engine, shared)", "seconds": sh_s,
                 "prefill_s": sh_stats["prefill_s"], "decode_s": sh_stats["decode_s"],
                 "prefill_tokens": sh_stats["prefill_tokens"],
                 "kv_peak_MiB": sh_stats["peak_pages"] * sh_stats["page_bytes"] / 2**20},
                {"case": f"{g} distinct prompts (engine)", "seconds": di_s,
                 "prefill_s": di_stats["prefill_s"], "decode_s": di_stats["decode_s"],
                 "prefill_tokens": di_stats["prefill_tokens"],
                 "kv_peak_MiB": di_stats["peak_pages"] * di_stats["page_bytes"] / 2**20},
                {"case": f"{g} distinct prompts (sample, one batch)", "seconds": sa_s,
                 "prefill_tokens": g * gp,
                 "kv_peak_MiB": g * (gp + gn) * bytes_per_token / 2**20}]
  if vl is not None:
    group_rows += [{"case": f"{g} samples of 1 prompt (vLLM, prefix cache)",
                    "seconds": vs_s},
                   {"case": f"{g} distinct prompts (vLLM)", "seconds": vd_s}]
  return group_rows, sh_s / di_s


# ----------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="smoke sizes")
  p.add_argument("--requests", type=int, default=256)
  p.add_argument("--prompt", type=int, default=32)
  p.add_argument("--short", type=int, default=32)
  p.add_argument("--long", type=int, default=512)
  p.add_argument("--uniform", type=int, default=128)
  p.add_argument("--slots", type=int, default=64)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--group-prompt", type=int, default=1024)
  p.add_argument("--group-new", type=int, default=64)
  p.add_argument("--group-repeats", type=int, default=3, help="median of this many runs")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--steps-per-call", type=int, default=16)
  p.add_argument("--vocab", type=int, default=2048)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--model", default=None,
                 help="a packaged model name or checkpoint path instead of the random model "
                      "(the size flags above are then ignored)")
  p.add_argument("--prefill-chunk", type=int, default=None,
                 help="the engine's prefill_chunk (None: the smallest power of two >= "
                      "--prompt, at most 128, as the RL loop picks it)")
  p.add_argument("--decode-widths", default=None,
                 help="the engine's decode_widths, comma-separated (e.g. 8,16; None: off)")
  p.add_argument("--prefill-rows", type=int, default=None,
                 help="the engine's prefill_rows (None: its default)")
  p.add_argument("--d-ff", type=int, default=512)
  p.add_argument("--util-requests", type=int, default=1024,
                 help="also run the engine alone on a heavy-tailed workload this large "
                      "(slot utilisation away from the single-long-request bound); 0: off")
  p.add_argument("--copy-mb", type=int, default=256)
  p.add_argument("--hf-batches", type=int, default=1,
                 help="batches of each workload timed through transformers.generate")
  p.add_argument("--no-hf", action="store_true")
  p.add_argument("--no-group", action="store_true", help="skip workload (c)")
  p.add_argument("--vllm", action="store_true", help="add vLLM (jaxrl_llm[vllm])")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if args.quick:
    args.requests, args.prompt, args.short, args.long, args.uniform = 20, 8, 4, 32, 8
    args.slots, args.group, args.group_prompt, args.group_new = 8, 4, 64, 8
    args.vocab, args.d_model, args.layers, args.d_ff, args.copy_mb = 256, 64, 2, 128, 16
    args.util_requests = 0

  model = _model(args)
  graphdef, params = split_model(model)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  paged = make_paged_decode_fns(graphdef)
  run = jax.jit(functools.partial(sample, make_decode_fns(graphdef)),
                static_argnames=("max_new_tokens",))
  bandwidth = copy_bandwidth(args.copy_mb)
  hf = None
  folder = tempfile.mkdtemp(prefix="rollout_bench_")
  if not args.no_hf:
    hf = hf_model(model, folder)
  vl = None
  if args.vllm:
    vl = vllm_engine(model, folder, max(args.prompt + max(args.long, args.uniform),
                                        args.group_prompt + args.group_new))
  print(f"machine: {machine()}")
  c = model.config
  print(f"model: {args.model or 'random'}: d_model {c.d_model}, {c.n_layers} layers, "
        f"{c.n_heads}/{c.n_kv_heads} heads, d_ff {c.d_ff}, vocab {c.vocab_size}: "
        f"{param_bytes / 2**20:.1f} MiB of parameters; memory copy "
        f"{bandwidth / 1e9:.1f} GB/s (read + write)")

  # An engine without these settings (an older checkout) runs with its own.
  settings = {} if args.prefill_rows is None else {"prefill_rows": args.prefill_rows}
  if args.decode_widths:
    settings["decode_widths"] = [int(x) for x in args.decode_widths.split(",")]
  engine = RolloutEngine(paged, max_slots=args.slots,
                         max_len=args.prompt + max(args.long, args.uniform),
                         page_size=args.page_size, steps_per_call=args.steps_per_call,
                         prefill_chunk=args.prefill_chunk or _chunk(args.prompt), **settings)
  bytes_per_token = None
  rows, memory_rows = [], []
  warmup = [Request([1] * args.prompt, max_new_tokens=2 * args.steps_per_call)] * 2
  for name, requests in workloads(args).items():
    useful = sum(r.max_new_tokens for r in requests)
    e_s, stats = run_engine(engine, params, requests, warmup)
    s_s, s_steps, s_kv = run_sample(run, params, requests, args.slots)
    row = {"workload": name, "requests": len(requests), "useful_tokens": useful,
           "engine_tok_s": useful / e_s, "sample_tok_s": useful / s_s,
           "speedup": s_s / e_s, "engine_util": stats["slot_utilisation"],
           "sample_util": useful / s_steps, "engine_s": e_s, "sample_s": s_s,
           "decode_steps": stats["decode_steps"], "decode_calls": stats["decode_calls"],
           "prefill_calls": stats["prefill_calls"], "prefill_s": stats["prefill_s"],
           "decode_s": stats["decode_s"]}
    if hf is not None:
      h_s, h_useful = run_hf(hf, requests, args.slots, args.hf_batches)
      row["hf_tok_s"] = h_useful / h_s
    if vl is not None:
      row["vllm_tok_s"] = useful / run_vllm(vl, requests, warmup)
    rows.append(row)
    bytes_per_token = stats["page_bytes"] / args.page_size
    step_s = stats["decode_s"] / stats["decode_steps"]
    kv_mean = stats["mean_pages_in_use"] * stats["page_bytes"]
    memory_rows.append({
        "workload": name, "kv_mean_MiB": kv_mean / 2**20,
        "kv_peak_MiB": stats["peak_pages"] * stats["page_bytes"] / 2**20,
        "sample_kv_MiB": s_kv * bytes_per_token / 2**20,
        "step_ms": 1e3 * step_s,
        "bytes_per_step_MiB": (param_bytes + kv_mean) / 2**20,
        "bandwidth_use": (param_bytes + kv_mean) / bandwidth / step_s})
    print(f"{name}: done ({e_s:.1f} s engine, {s_s:.1f} s sample)", flush=True)

  if args.util_requests:
    requests = heavy_tailed(args, args.util_requests, seed=2)
    e_s, stats = run_engine(engine, params, requests, warmup)
    useful = sum(r.max_new_tokens for r in requests)
    rows.append({"workload": f"heavy_tailed x{args.util_requests} (engine only)",
                 "requests": len(requests), "useful_tokens": useful,
                 "engine_tok_s": useful / e_s, "engine_util": stats["slot_utilisation"],
                 "engine_s": e_s, "decode_steps": stats["decode_steps"],
                 "decode_calls": stats["decode_calls"],
                 "prefill_calls": stats["prefill_calls"], "prefill_s": stats["prefill_s"],
                 "decode_s": stats["decode_s"]})
    print(f"heavy_tailed x{args.util_requests}: done ({e_s:.1f} s engine)", flush=True)

  group_rows, shared_over_distinct = ([], None) if args.no_group else group_workload(
      args, paged, run, params, vl, bytes_per_token)

  print(f"\nWorkloads: {args.requests} requests of {args.prompt} prompt tokens; "
        f"heavy-tailed 90% x {args.short} / 10% x {args.long} new tokens, uniform "
        f"{args.uniform}; {args.slots} slots vs batches of {args.slots} rows; "
        f"page {args.page_size}, K = {args.steps_per_call} steps per call.\n")
  cols = ["workload", "useful_tokens", "engine_tok_s", "sample_tok_s", "speedup",
          "engine_util", "sample_util", "decode_steps", "decode_calls", "prefill_calls",
          "prefill_s", "decode_s"]
  if hf is not None:
    cols.insert(4, "hf_tok_s")
  if vl is not None:
    cols.insert(4, "vllm_tok_s")
  print(markdown_table(rows, cols))
  print("\nKV cache and bandwidth (engine; sample's rectangular cache is one batch):\n")
  print(markdown_table(memory_rows, ["workload", "kv_mean_MiB", "kv_peak_MiB",
                                     "sample_kv_MiB", "step_ms", "bytes_per_step_MiB",
                                     "bandwidth_use"]))
  if group_rows:
    print(f"\nShared prompt: {args.group} samples of a {args.group_prompt}-token prompt, "
          f"{args.group_new} new tokens each:\n")
    print(markdown_table(group_rows, ["case", "seconds", "prefill_s", "decode_s",
                                      "prefill_tokens", "kv_peak_MiB"]))
    print(f"\nshared / distinct (engine) = {shared_over_distinct:.3f}")
  write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows,
                         "memory": memory_rows, "group": group_rows,
                         "shared_over_distinct": shared_over_distinct,
                         "copy_bandwidth_Bps": bandwidth, "param_bytes": param_bytes})


if __name__ == "__main__":
  main()
