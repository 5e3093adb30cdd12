"""Benchmark: target-token log-probs, forward + backward, naive full logits vs chunked.

Times ``jax.grad`` of ``sum(logp)`` with respect to ``hidden`` [B, T, D] and ``lm_head``
[D, V] for

* ``naive``: ``log_softmax(hidden @ lm_head)`` gathered at the targets (the whole
  [B, T, V] float32 logits exist in the forward pass and again in the backward pass);
* ``ours``: :func:`jaxrl_llm.logprobs.token_logprobs_from_hidden` (chunked scan with a
  custom VJP that recomputes each chunk's logits).

For every T it reports the compiled temp memory from ``memory_analysis()`` (a
deterministic compile-time number), the median wall time per call, and the peak RSS of
a fresh worker process that ran only that one variant. It also finds the largest T
(doubling) whose compiled arguments + outputs + temps fit in a budget (16 GB), without
running anything. Naive runs whose compiled temps exceed a fraction of this machine's
RAM are skipped and marked so.

Usage::

  python benchmarks/logprobs.py                # B=1, D=256, V=32000, T in 2048 8192 32768
  python benchmarks/logprobs.py --quick        # tiny sizes, a few seconds
  python benchmarks/logprobs.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
  sys.path.insert(0, str(_REPO))  # run as a plain script from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_llm.logprobs import default_chunk_size, token_logprobs_from_hidden  # noqa: E402

MIB = 2**20
GB = 10**9


def naive_logprobs(hidden, lm_head, targets):
  logits = jnp.einsum("btd,dv->btv", hidden, lm_head)
  log_q = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(log_q, targets[..., None], axis=-1)[..., 0]


def make_grad_fn(variant, chunk_size):
  if variant == "naive":
    fn = naive_logprobs
  else:
    def fn(h, w, y):
      return token_logprobs_from_hidden(h, w, y, chunk_size=chunk_size)
  return jax.jit(jax.grad(lambda h, w, y: jnp.sum(fn(h, w, y)), argnums=(0, 1)))


def shapes(batch, time_, dim, vocab):
  return (jax.ShapeDtypeStruct((batch, time_, dim), jnp.float32),
          jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
          jax.ShapeDtypeStruct((batch, time_), jnp.int32))


def compiled_memory(variant, batch, time_, dim, vocab, chunk_size):
  """(temp, total = args + outputs + temps - aliased) bytes of the compiled fwd+bwd."""
  compiled = make_grad_fn(variant, chunk_size).lower(
      *shapes(batch, time_, dim, vocab)).compile()
  ma = compiled.memory_analysis()
  total = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
           - ma.alias_size_in_bytes)
  return int(ma.temp_size_in_bytes), int(total)


def largest_fitting_t(variant, batch, dim, vocab, chunk_size, budget, t_start, t_max):
  """Doubles T from t_start until the compiled total exceeds `budget` (or t_max)."""
  best, best_total, time_ = None, None, t_start
  while time_ <= t_max:
    _, total = compiled_memory(variant, batch, time_, dim, vocab, chunk_size)
    if total > budget:
      return best, best_total, time_, total
    best, best_total = time_, total
    time_ *= 2
  return best, best_total, None, None


def run_worker(cfg):
  """Runs one variant at one size in this (fresh) process; prints a JSON line."""
  batch, time_, dim, vocab = cfg["batch"], cfg["time"], cfg["dim"], cfg["vocab"]
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(batch, time_, dim)), jnp.float32)
  lm_head = jnp.asarray(rng.normal(size=(dim, vocab)) / np.sqrt(dim), jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, size=(batch, time_)), jnp.int32)
  rss_inputs = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  compiled = make_grad_fn(cfg["variant"], cfg["chunk_size"]).lower(
      hidden, lm_head, targets).compile()
  jax.block_until_ready(compiled(hidden, lm_head, targets))  # warm-up
  times = []
  while len(times) < cfg["repeats"]:
    start = time.perf_counter()
    jax.block_until_ready(compiled(hidden, lm_head, targets))
    times.append(time.perf_counter() - start)
    if sum(times) > cfg["max_seconds"]:
      break
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
  print(json.dumps({"median_s": statistics.median(times), "runs": len(times),
                    "peak_rss": peak, "rss_after_inputs": rss_inputs}))


def spawn_worker(cfg):
  proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)],
                        capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else
            f"exit code {proc.returncode}"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def check_agreement(batch, dim, vocab, chunk_size):
  """Small-size sanity check that both variants give the same gradients."""
  time_ = 64
  rng = np.random.default_rng(1)
  hidden = jnp.asarray(rng.normal(size=(batch, time_, dim)), jnp.float32)
  lm_head = jnp.asarray(rng.normal(size=(dim, vocab)) / np.sqrt(dim), jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, size=(batch, time_)), jnp.int32)
  small_chunk = min(chunk_size or 24, 24)
  g_naive = make_grad_fn("naive", None)(hidden, lm_head, targets)
  g_ours = make_grad_fn("ours", small_chunk)(hidden, lm_head, targets)
  return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g_naive, g_ours))


def total_ram_bytes():
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fmt_mib(x):
  return "-" if x is None else f"{x / MIB:,.0f}"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
  parser.add_argument("--json", type=Path, default=None, help="write results here")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dim", type=int, default=None, help="D (default 256; quick 64)")
  parser.add_argument("--vocab", type=int, default=None,
                      help="V (default 32000; quick 4096)")
  parser.add_argument("--seq", type=int, nargs="+", default=None,
                      help="sequence lengths T (default 2048 8192 32768; quick 256 1024)")
  parser.add_argument("--chunk-size", type=int, default=None,
                      help="ours' chunk_size (default: the library default)")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls after warm-up")
  parser.add_argument("--max-seconds", type=float, default=60.0,
                      help="stop timing a config once this much time is spent (min 1 run)")
  parser.add_argument("--budget-gb", type=float, default=None,
                      help="memory budget for the largest-T search, GB = 1e9 bytes "
                           "(default 16; quick 0.25)")
  parser.add_argument("--ram-fraction", type=float, default=0.4,
                      help="skip running naive when its compiled temps exceed this "
                           "fraction of the machine RAM")
  parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args.worker is not None:
    run_worker(json.loads(args.worker))
    return

  dim = args.dim or (64 if args.quick else 256)
  vocab = args.vocab or (4096 if args.quick else 32000)
  seqs = args.seq or ([256, 1024] if args.quick else [2048, 8192, 32768])
  batch = args.batch
  ram = total_ram_bytes()
  budget_gb = args.budget_gb or (0.25 if args.quick else 16.0)
  budget = int(budget_gb * GB)
  t_max = 2**14 if args.quick else 2**23

  print(f"# token log-probs fwd+bwd: naive vs chunked (jax {jax.__version__}, "
        f"{jax.default_backend()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"RAM {ram / GB:.1f} GB)")
  print(f"B={batch}, D={dim}, V={vocab}, float32, grad of sum(logp) wrt hidden and lm_head")
  max_diff = check_agreement(batch, dim, vocab, args.chunk_size)
  print(f"agreement check (T=64): max |grad_naive - grad_ours| = {max_diff:.2e}\n")

  rows = []
  for time_ in seqs:
    chunk = args.chunk_size or default_chunk_size(batch, time_)
    per_t = {}
    for variant in ("naive", "ours"):
      temp, total = compiled_memory(variant, batch, time_, dim, vocab, chunk)
      row = {"T": time_, "variant": variant,
             "chunk_size": chunk if variant == "ours" else None,
             "temp_bytes": temp, "total_bytes": total}
      if variant == "naive" and temp > args.ram_fraction * ram:
        row["skipped"] = (f"compiled temps {temp / GB:.1f} GB > {args.ram_fraction:.0%} of "
                          f"RAM ({ram / GB:.1f} GB)")
      else:
        result = spawn_worker({"variant": variant, "batch": batch, "time": time_,
                               "dim": dim, "vocab": vocab, "chunk_size": chunk,
                               "repeats": args.repeats, "max_seconds": args.max_seconds})
        row.update(result)
      per_t[variant] = row
      rows.append(row)
      print(f"  T={time_:>6} {variant:>5}: temp {fmt_mib(temp)} MiB, "
            + (f"skipped ({row['skipped']})" if "skipped" in row else
               f"error {row['error']}" if "error" in row else
               f"{row['median_s']:.3f} s/call ({row['runs']} runs), "
               f"peak RSS {fmt_mib(row['peak_rss'])} MiB"), flush=True)
    naive, ours = per_t["naive"], per_t["ours"]
    ours["temp_ratio"] = ours["temp_bytes"] / naive["temp_bytes"]
    ours["total_ratio"] = ours["total_bytes"] / naive["total_bytes"]
    if "median_s" in naive and "median_s" in ours:
      ours["time_ratio"] = ours["median_s"] / naive["median_s"]
      ours["rss_ratio"] = ours["peak_rss"] / naive["peak_rss"]

  fits = {}
  chunk_fit = args.chunk_size or default_chunk_size(batch, 2**30)
  for variant in ("naive", "ours"):
    best, best_total, over_t, over_total = largest_fitting_t(
        variant, batch, dim, vocab, chunk_fit, budget, t_start=min(seqs), t_max=t_max)
    fits[variant] = {"largest_T": best, "total_bytes_at_largest": best_total,
                     "first_T_over": over_t, "total_bytes_first_over": over_total}

  print("\n| T | variant | time / call (s) | runs | compiled temp (MiB) | "
        "args+out+temp (MiB) | peak RSS (MiB) | ours/naive time | ours/naive temp | "
        "ours/naive RSS |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for row in rows:
    name = row["variant"] + (f" (chunk {row['chunk_size']})" if row["chunk_size"] else "")
    if "skipped" in row:
      timing = ("not run: " + row["skipped"], "-", "-")
    elif "error" in row:
      timing = ("failed: " + row["error"], "-", "-")
    else:
      timing = (f"{row['median_s']:.3f}", str(row["runs"]), fmt_mib(row["peak_rss"]))
    ratios = ("", "", "")
    if row["variant"] == "ours":
      ratios = (f"{row['time_ratio']:.2f}" if "time_ratio" in row else "-",
                f"{row['temp_ratio']:.3f}",
                f"{row['rss_ratio']:.2f}" if "rss_ratio" in row else "-")
    print(f"| {row['T']} | {name} | {timing[0]} | {timing[1]} | "
          f"{fmt_mib(row['temp_bytes'])} | {fmt_mib(row['total_bytes'])} | {timing[2]} | "
          f"{ratios[0]} | {ratios[1]} | {ratios[2]} |")
  print(f"\nLargest T (doubling from {min(seqs)}) whose compiled args+outputs+temps fit in "
        f"{budget_gb:g} GB (memory_analysis, nothing run):\n")
  print("| variant | largest T | MiB at that T | next T | MiB at next T |")
  print("|---|---:|---:|---:|---:|")
  for variant, fit in fits.items():
    name = variant + (f" (chunk {chunk_fit})" if variant == "ours" else "")
    print(f"| {name} | {fit['largest_T'] or '< ' + str(min(seqs))} | "
          f"{fmt_mib(fit['total_bytes_at_largest'])} | "
          f"{fit['first_T_over'] or '> ' + str(t_max)} | "
          f"{fmt_mib(fit['total_bytes_first_over'])} |")

  if args.json is not None:
    args.json.write_text(json.dumps({
        "config": {"batch": batch, "dim": dim, "vocab": vocab, "seqs": seqs,
                   "repeats": args.repeats, "budget_gb": budget_gb,
                   "ram_bytes": ram, "jax": jax.__version__,
                   "backend": jax.default_backend(), "cpus": os.cpu_count()},
        "agreement_max_abs_diff": max_diff, "rows": rows, "largest_t": fits}, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
  main()
