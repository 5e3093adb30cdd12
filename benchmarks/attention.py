"""Benchmark: causal attention forward + backward, ``"blockwise"`` vs ``"xla"`` (and
``"cudnn"`` on a GPU with bf16/fp16 inputs).

Times ``jax.grad`` of ``sum(out * w)`` (a fixed random cotangent) with respect to
query, key and value for :func:`jaxrl_llm.dot_product_attention` with
``implementation="xla"`` (the plain softmax, ``[B, N, T, T]`` float32 scores in both
passes) and ``"blockwise"`` (online softmax over query/key blocks with a recomputing
custom VJP) at several block sizes, side by side in one process: the variants are
called in turn within each repeat, so a shared machine's load hits them alike, and the
medians are reported. Memory is the compiled temp size from ``memory_analysis()`` of the
AOT-compiled gradient function (deterministic; nothing is run for it). An ``"xla"``
variant whose temps exceed half the memory it runs in (host RAM on CPU, the device's
memory limit on an accelerator) is compiled but not run.

Usage::

  python benchmarks/attention.py                      # T = 2048 8192, N=8, K=4, H=64
  python benchmarks/attention.py --quick              # T = 256, a few seconds
  python benchmarks/attention.py --seq-lens 2048 --block-sizes 64 128 256
  python benchmarks/attention.py --json out.json
  python benchmarks/attention.py --dtype bfloat16 --heads 16 --kv-heads 8 \
      --head-dim 128 --seq-lens 2048 8192 32768     # on a GPU: cudnn too
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
  sys.path.insert(0, str(_REPO))  # run as a plain script from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._common import machine, markdown_table, write_json  # noqa: E402
from jaxrl_llm.attention import dot_product_attention, select_implementation  # noqa: E402

MIB = 2**20
COLUMNS = ["T", "impl", "block", "fwd_bwd_ms", "speed_vs_xla", "temp_MiB"]


def _memory_bytes() -> int:
  """Memory the benchmark runs in: the device's limit on an accelerator, else RAM."""
  stats = jax.devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError):
    return 16 * 2**30


def _grad_fn(impl: str, block: int | None, segments=None, skip: bool = True):
  """``segments`` ``[B, T]``: packed rows. ``skip=False`` passes them as explicit key
  ids too, which makes ``"blockwise"`` visit (and mask) every causal block."""
  extra = {}
  if segments is not None:
    extra = {"segment_ids": segments, "key_segment_ids": None if skip else segments + 0}

  def loss(q, k, v, w):
    out = dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                block_size=block, **extra)
    return jnp.sum(out * w)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def bench_one_length(t: int, *, b: int, n: int, kh: int, h: int, block_sizes, repeats: int,
                     dtype, max_temp_bytes: int | None = None,
                     segments: int | None = None) -> list[dict]:
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(b, t, n, h)), dtype)
  k = jnp.asarray(rng.normal(size=(b, t, kh, h)), dtype)
  v = jnp.asarray(rng.normal(size=(b, t, kh, h)), dtype)
  w = jnp.asarray(rng.normal(size=(b, t, n, h)), dtype)
  args = (q, k, v, w)
  seg = None
  variants = [("xla", None)] + [("blockwise", bs) for bs in block_sizes]
  if segments:    # packed rows of `segments` equal sequences: blockwise masked vs skipping
    seg = jnp.asarray(np.repeat(np.arange(1, segments + 1), -(-t // segments))[:t][None]
                      .repeat(b, 0), jnp.int32)
    variants += [("blockwise (masked)", bs) for bs in block_sizes]
  if select_implementation(q, k) == "cudnn":
    variants.append(("cudnn", None))
  rows, runnable = [], []
  cap = _memory_bytes() // 2 if max_temp_bytes is None else max_temp_bytes
  for impl, block in variants:
    row = {"T": t, "impl": impl, "block": block if block is not None else "-"}
    rows.append(row)
    scores_bytes = 2 * 4 * b * n * t * t  # float32 scores and probabilities
    if impl == "xla" and scores_bytes > cap:
      # Not even compiled: a GPU compile autotunes on buffers of that size.
      row["fwd_bwd_ms"] = f"skipped ([T, T] scores > {cap / 2**30:.1f} GiB)"
      continue
    fn = _grad_fn(impl.split(" ")[0], block, seg, skip=not impl.endswith("(masked)"))
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = int(mem.temp_size_in_bytes) if mem is not None else -1
    row["temp_MiB"] = temp / MIB
    if temp > cap:
      row["fwd_bwd_ms"] = f"skipped (temps > {cap / 2**30:.1f} GiB)"
      continue
    jax.block_until_ready(compiled(*args))  # warm up
    runnable.append((row, compiled))
  times: dict[int, list[float]] = {id(r): [] for r, _ in runnable}
  for _ in range(repeats):
    for row, compiled in runnable:
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times[id(row)].append(time.perf_counter() - t0)
  xla_ms = None
  for row, _ in runnable:
    row["fwd_bwd_ms"] = 1e3 * statistics.median(times[id(row)])
    if row["impl"] == "xla":
      xla_ms = row["fwd_bwd_ms"]
  for row, _ in runnable:
    if xla_ms is not None:
      row["speed_vs_xla"] = xla_ms / row["fwd_bwd_ms"]
  return rows


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
  parser.add_argument("--block-sizes", type=int, nargs="+", default=[128, 256, 512])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--segments", type=int, default=None,
                      help="packed rows of this many equal sequences (segment ids): adds "
                      "blockwise without skipping other segments' blocks")
  parser.add_argument("--quick", action="store_true", help="T=256, 2 repeats")
  parser.add_argument("--max-temp-gib", type=float, default=None,
                      help="skip running a variant whose temps exceed this (default: half "
                      "the RAM, or of the device memory on an accelerator)")
  parser.add_argument("--json", default=None, help="write the rows to this JSON file")
  args = parser.parse_args(argv)
  if args.quick:
    args.seq_lens, args.block_sizes, args.repeats = [256], [64, 128], 2
  rows = []
  for t in args.seq_lens:
    rows += bench_one_length(t, b=args.batch, n=args.heads, kh=args.kv_heads,
                             h=args.head_dim, block_sizes=args.block_sizes,
                             repeats=args.repeats, dtype=jnp.dtype(args.dtype),
                             max_temp_bytes=None if args.max_temp_gib is None
                             else int(args.max_temp_gib * 2**30), segments=args.segments)
    print(markdown_table([r for r in rows if r["T"] == t], COLUMNS), flush=True)
  packed = f", rows of {args.segments} packed sequences" if args.segments else ""
  header = (f"causal attention fwd+bwd, B={args.batch} N={args.heads} K={args.kv_heads} "
            f"H={args.head_dim} {args.dtype}{packed}, median of {args.repeats}; {machine()}")
  print(header)
  print(markdown_table(rows, COLUMNS))
  payload = {"machine": machine(), "config": vars(args), "rows": rows}
  write_json(args.json, payload)
  return payload


if __name__ == "__main__":
  main()
