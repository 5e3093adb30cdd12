"""Benchmark: ring attention forward + backward, zig-zag vs contiguous layout.

Times ``jax.value_and_grad`` of ``sum(out ** 2)`` with respect to query, key and value
for :func:`jaxrl_llm.parallel.ring_attention` (causal, blockwise per block) on a
``make_mesh(data=1, sequence=n)`` mesh, both layouts called in turn within each repeat
(a shared machine's load hits them alike), medians reported. On forced CPU devices the
``n`` "devices" share the host's cores, so the wall time follows the *total* work, which
the layouts share; zig-zag only lowers the slowest device's work (``n`` blocks ->
``(n + 1) / 2``), which shows on devices that run in parallel.

Usage::

  python -m benchmarks.ring_layouts                  # T = 4096 on 8 forced CPU devices
  python -m benchmarks.ring_layouts --quick          # T = 256, a few seconds
  python -m benchmarks.ring_layouts --seq-len 8192 --devices 8 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _force_cpu_devices(n: int) -> None:
  """``n`` CPU devices, set before jax is imported (a flag given by the caller wins)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def bench(t: int, n: int, repeats: int, *, b=1, heads=8, kv_heads=4, h=64) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxrl_llm.parallel import make_mesh, ring_attention
  mesh = make_mesh(data=1, sequence=n, devices=jax.devices()[:n])
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, m, h)), jnp.float32)
             for m in (heads, kv_heads, kv_heads))
  fns = {}
  for layout in ("contiguous", "zigzag"):
    loss = lambda q, k, v, lay=layout: jnp.sum(
        ring_attention(q, k, v, mesh=mesh, layout=lay) ** 2)
    fns[layout] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  outs = {name: jax.block_until_ready(f(q, k, v)) for name, f in fns.items()}
  diff = max(float(jnp.max(jnp.abs(a - c))) for a, c in
             zip(jax.tree.leaves(outs["zigzag"]), jax.tree.leaves(outs["contiguous"])))
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(repeats):
    for name, f in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(q, k, v))
      times[name].append(time.perf_counter() - t0)
  # Blocks of work on the slowest device: contiguous n, zig-zag 1 + (n - 1) / 2.
  slowest = {"contiguous": float(n), "zigzag": 1 + (n - 1) / 2}
  return [{"layout": name, "T": t, "devices": n,
           "fwd_bwd_ms": 1e3 * statistics.median(ts),
           "all_ms": [round(1e3 * x) for x in ts],
           "slowest_device_blocks": slowest[name], "max_diff_vs_contiguous": diff}
          for name, ts in times.items()]


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="T=256, 2 repeats")
  p.add_argument("--seq-len", type=int, default=4096)
  p.add_argument("--devices", type=int, default=8, help="forced CPU devices = sequence")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  _force_cpu_devices(args.devices)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from benchmarks._common import machine, markdown_table, write_json
  t, repeats = (256, 2) if args.quick else (args.seq_len, args.repeats)
  rows = bench(t, args.devices, repeats)
  print(f"# Ring attention layouts, causal fwd+bwd ({machine()})")
  print(markdown_table(rows, ["layout", "T", "devices", "fwd_bwd_ms", "all_ms",
                              "slowest_device_blocks", "max_diff_vs_contiguous"]))
  write_json(args.json, {"benchmark": "ring_layouts", "machine": machine(), "rows": rows})
  return rows


if __name__ == "__main__":
  main()
