"""The rollout engine with today's ``paged_attention`` vs the one of an earlier commit.

Run: ``python -m benchmarks.paged_attention_vs_commit [--rev 9aee752] [--rounds 5]``
(from a git checkout: the earlier function is read with ``git show REV:...``).

One process, the model of ``benchmarks/rollout.py`` (d_model 128, 4 layers, 4/2 heads,
d_ff 512, vocab 2048, random weights, float32), temperature 1, stop ids off. For each
implementation the model's ``paged_attention`` is swapped in before the engines are
built and compiled (each implementation gets its own decode functions, so its own
compilations); then the workloads run interleaved, round by round, and the median
wall time of each is reported:

* heavy-tailed: 128 requests of 32 prompt tokens, 90% x 32 / 10% x 512 new, 64 slots;
* uniform: 128 x 128 new tokens, 64 slots;
* shared prompt: 8 samples of one 1,024-token prompt, 64 new, 8 slots.

Both implementations generate the same tokens (the keyed draws; checked).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import machine, markdown_table, write_json


def _attention_at(rev: str):
  """``paged_attention`` as it was at commit ``rev``."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  source = subprocess.run(["git", "show", f"{rev}:jaxrl_llm/attention.py"], cwd=root,
                          capture_output=True, text=True, check=True).stdout
  path = os.path.join(tempfile.mkdtemp(), f"attention_{rev}.py")
  with open(path, "w") as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location(f"attention_{rev}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.paged_attention


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--rev", default="9aee752", help="the commit to compare with")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)

  from flax import nnx

  import jaxrl_llm.models.transformer as transformer
  from jaxrl_llm.models import Transformer, TransformerConfig, make_paged_decode_fns, split_model
  from jaxrl_llm.rollout import Request, RolloutEngine

  config = TransformerConfig(vocab_size=2048, d_model=128, n_layers=4, n_heads=4,
                             n_kv_heads=2, d_ff=512, max_seq_len=1100, value_head=False,
                             tie_embeddings=False)
  graphdef, params = split_model(Transformer(config, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)

  def requests(n, new, prompt=32, samples=1):
    return [Request(rng.integers(1, 2048, prompt).tolist(), n=samples,
                    max_new_tokens=new() if callable(new) else new, temperature=1.0)
            for _ in range(n)]

  workloads = {  # name: (requests, slots, max_len)
      "heavy-tailed": (requests(128, lambda: 512 if rng.random() < 0.1 else 32), 64, 544),
      "uniform": (requests(128, 128), 64, 544),
      "shared prompt": (requests(1, 64, prompt=1024, samples=8), 8, 1088)}
  implementations = {args.rev: _attention_at(args.rev), "today": transformer.paged_attention}
  engines, first = {}, {}
  for label, attention in implementations.items():
    transformer.paged_attention = attention     # read when the model is traced
    fns = make_paged_decode_fns(graphdef)
    for name, (reqs, slots, max_len) in workloads.items():
      engine = RolloutEngine(fns, max_slots=slots, max_len=max_len, page_size=16)
      first[label, name] = [c.tokens.tolist() for c in engine.generate(params, reqs, seed=0)]
      engines[label, name] = engine
  transformer.paged_attention = implementations["today"]
  same = all(first[args.rev, name] == first["today", name] for name in workloads)
  times: dict = {key: [] for key in engines}
  for r in range(args.rounds):
    for name, (reqs, _, _) in workloads.items():
      for label in implementations:
        start = time.perf_counter()
        engines[label, name].generate(params, reqs, seed=r + 1)
        times[label, name].append(time.perf_counter() - start)
  rows = []
  for name in workloads:
    before = statistics.median(times[args.rev, name])
    after = statistics.median(times["today", name])
    rows.append({"workload": name, f"{args.rev} s": round(before, 3),
                 "today s": round(after, 3), "speed-up": round(before / after, 2)})
  print(f"machine: {machine()}")
  print(f"medians of {args.rounds} interleaved rounds; same tokens: {same}\n")
  print(markdown_table(rows, list(rows[0])))
  if args.json:
    write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows,
                           "same_tokens": same})
  return rows


if __name__ == "__main__":
  main()
