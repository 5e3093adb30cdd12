"""GAE throughput: jaxrl_llm (scan, associative) vs rlax vs a PyTorch per-token loop.

Run: ``python benchmarks/gae.py [--quick] [--rounds N] [--sizes 16x32768 ...] [--json out.json]``.

All compute the same advantages (gamma=1, lam=0.95, full mask, f32) in one process on
the same inputs and are checked to agree before timing. The PyTorch loop is the pattern
of verl/TRL/OpenRLHF (a Python ``for t in reversed(range(T))`` with a few [B]-vector ops
per step). rlax's ``truncated_generalized_advantage_estimation`` handles one trajectory,
so it is batched with ``jax.vmap`` as rlax users do. The copy baseline moves the same
number of bytes as GAE must (read rewards, values, mask; write advantages, returns) with
``numpy.copyto`` (on a GPU: one jitted elementwise pass over those bytes on the device):
``copy/ours`` is the fraction of memory bandwidth GAE reaches. On a GPU the torch loop
runs on CUDA tensors, as verl does there.

Timing on a shared machine: the JAX candidates and the copy are timed *interleaved*
(one call of each per round, ``--rounds`` rounds), so load spikes from other processes
hit all of them alike; the tables report the median over rounds, and each ratio is the
median of the per-round ratios. The torch loop (seconds per call) is timed on its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jaxrl_llm as rl
from benchmarks._common import machine, markdown_table, timeit, write_json

GAMMA, LAM = 1.0, 0.95


def torch_gae_loop(rewards, values, mask, gamma=GAMMA, lam=LAM):
  import torch
  with torch.no_grad():
    nextvalues = torch.zeros(rewards.shape[0], device=rewards.device)
    lastgaelam = torch.zeros(rewards.shape[0], device=rewards.device)
    out = []
    for t in reversed(range(rewards.shape[1])):
      delta = rewards[:, t] + gamma * nextvalues - values[:, t]
      lastgaelam_ = delta + gamma * lam * lastgaelam
      nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
      lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
      out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    if adv.is_cuda:
      torch.cuda.synchronize()
    return adv, adv + values


def make_rlax_gae():
  """rlax's GAE batched with vmap, or None where rlax does not import (e.g. its
  tensorflow-probability dependency does not match this jax)."""
  try:
    import rlax
  except Exception as e:  # noqa: BLE001 - any import failure means "no baseline"
    print(f"rlax unavailable ({type(e).__name__}: {e}); its columns are NaN", flush=True)
    return None

  def one(r, v, boot):
    values = jnp.concatenate([v, boot[None]])
    discount = jnp.full_like(r, GAMMA)
    adv = rlax.truncated_generalized_advantage_estimation(r, discount, LAM, values)
    return adv, adv + v

  return jax.jit(jax.vmap(one))


def numpy_gae(rewards, values, gamma=GAMMA, lam=LAM):
  """Unmasked GAE in float64 NumPy, bootstrapping 0 after the last step (the reference
  every candidate must match before it is timed)."""
  adv = np.zeros(rewards.shape, np.float64)
  last = np.zeros(rewards.shape[0], np.float64)
  next_value = np.zeros(rewards.shape[0], np.float64)
  for t in reversed(range(rewards.shape[1])):
    last = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last
    adv[:, t], next_value = last, values[:, t]
  return adv


def on_accelerator() -> bool:
  return jax.default_backend() != "cpu"


def copy_of_gae_bytes(size: int):
  """A candidate moving the bytes GAE must (3 arrays read + 2 written = a copy of 2.5
  arrays of ``size`` float32): ``numpy.copyto`` on the host, or one jitted elementwise
  pass on an accelerator's memory."""
  n = int(2.5 * size)
  if on_accelerator():
    src = jnp.ones((n,), jnp.float32)
    return jax.jit(lambda x: x * 2.0), (src,)
  src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
  return (lambda: np.copyto(dst, src)), ()


def interleaved(fns: dict, rounds: int) -> dict:
  """Per-candidate lists of wall times (s), one call of each candidate per round."""
  for fn, args in fns.values():
    jax.block_until_ready(fn(*args))
  times = {k: [] for k in fns}
  for _ in range(rounds):
    for k, (fn, args) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[k].append(time.perf_counter() - t0)
  return times


def bench(batch, time_steps, rounds, torch_repeats):
  rng = np.random.default_rng(0)
  r = (rng.normal(size=(batch, time_steps)) * 0.01).astype(np.float32)
  r[:, -1] += 1.0
  v = rng.normal(size=(batch, time_steps)).astype(np.float32)
  m = np.ones((batch, time_steps), np.float32)
  boot = np.zeros((batch,), np.float32)
  rj, vj, mj, bj = map(jnp.asarray, (r, v, m, boot))

  ours_scan = jax.jit(lambda r, v, m: rl.gae(r, v, m, gamma=GAMMA, lam=LAM))
  ours_assoc = jax.jit(lambda r, v, m: rl.gae(r, v, m, gamma=GAMMA, lam=LAM,
                                              method="associative"))
  rlax_fn = make_rlax_gae()
  ref = np.asarray(numpy_gae(r, v))
  candidates = {"ours_scan": (ours_scan, (rj, vj, mj)),
                "ours_assoc": (ours_assoc, (rj, vj, mj))}
  if rlax_fn is not None:
    candidates["rlax_vmap"] = (rlax_fn, (rj, vj, bj))
  for f, args in candidates.values():
    np.testing.assert_allclose(np.asarray(f(*args)[0]), ref, atol=2e-3, rtol=1e-4)
  candidates["copy"] = copy_of_gae_bytes(batch * time_steps)
  times = interleaved(candidates, rounds)
  row = {"B": batch, "T": time_steps, "rounds": rounds, "rlax_vmap_ms": float("nan")}
  for k, ts in times.items():
    row[f"{k}_ms"] = 1e3 * statistics.median(ts)
  try:
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if on_accelerator() and torch.cuda.is_available() else "cpu"
    tr, tv, tm = (torch.from_numpy(a).to(device) for a in (r, v, m))
    np.testing.assert_allclose(torch_gae_loop(tr, tv, tm)[0].cpu().numpy(), ref, atol=2e-3)
    row["torch_device"] = device
    row["torch_loop_ms"] = 1e3 * timeit(lambda: torch_gae_loop(tr, tv, tm),
                                        repeats=torch_repeats)
  except ImportError:
    row["torch_loop_ms"] = float("nan")

  def ratio(num, den):
    if num not in times:
      return float("nan")
    return statistics.median(a / b for a, b in zip(times[num], times[den]))

  best = "ours_scan" if row["ours_scan_ms"] <= row["ours_assoc_ms"] else "ours_assoc"
  row["best_ours"] = best.removeprefix("ours_")
  row["rlax/scan"] = ratio("rlax_vmap", "ours_scan")
  row["rlax/assoc"] = ratio("rlax_vmap", "ours_assoc")
  row["torch/ours"] = row["torch_loop_ms"] / row[f"{best}_ms"]
  row["copy/ours"] = ratio("copy", best)
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
  p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
  p.add_argument("--sizes", nargs="+", default=None, metavar="BxT",
                 help="(batch, time) sizes, e.g. 16x32768 (default: 64x2048 16x32768 "
                      "256x4096; --quick: 8x256 4x1024)")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if args.sizes:
    sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes]
  else:
    sizes = [(8, 256), (4, 1024)] if args.quick else [(64, 2048), (16, 32768), (256, 4096)]
  rounds = args.rounds or (3 if args.quick else 31)
  torch_repeats = 1 if args.quick else 3
  rows = []
  for b, t in sizes:
    rows.append(bench(b, t, rounds, torch_repeats))
    print(rows[-1], flush=True)
  cols = ["B", "T", "ours_scan_ms", "ours_assoc_ms", "rlax_vmap_ms", "torch_loop_ms",
          "torch_device",
          "copy_ms", "best_ours", "rlax/scan", "rlax/assoc", "torch/ours", "copy/ours"]
  print(f"# GAE benchmark ({machine()})")
  print(markdown_table(rows, cols))
  write_json(args.json, {"benchmark": "gae", "machine": machine(), "rows": rows})
  return rows


if __name__ == "__main__":
  main()
