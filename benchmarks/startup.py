"""Time to the first step of ``jaxrl-llm train`` with a cold and a warm compile cache.

Run: ``python -m benchmarks.startup [--pairs 2] [--json OUT.json] [-- TRAIN FLAGS]``.

Each pair makes a fresh cache folder and launches the same command twice in it
(``jaxrl-llm train --compile-cache DIR --no-progress FLAGS``, the main job's defaults
unless ``FLAGS`` say otherwise): first cold (nothing cached), then warm (the first
run's programs on disk). A run is timed from its launch (the Python and JAX imports
included) until its step-1 row is in ``metrics.jsonl``; then it gets SIGTERM (it
checkpoints and stops). Reported per run: that time, row 0's ``setup_s`` / ``eval_s``
/ ``compile_s``, step 1's ``step_s`` / ``update_s`` / ``compile_s``, the cache hits and
the peak RSS at step 1 (:mod:`jaxrl_llm.loop.accounting`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


def time_to_first_step(out: str, cache: str, flags: list[str]) -> dict:
  """Launches the run, waits for its step-1 row, stops it; its figures."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [sys.executable, "-m", "jaxrl_llm", "train", "--out", out, "--compile-cache",
         cache, "--no-progress", *flags]
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  path = os.path.join(out, "metrics.jsonl")
  first = None
  while proc.poll() is None:
    if any(r["step"] == 1 for r in _rows(path)):
      first = time.perf_counter() - start
      break
    time.sleep(0.02)
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=600)
  rows = {r["step"]: r for r in _rows(path)}
  if first is None or 1 not in rows:
    raise RuntimeError(f"{' '.join(cmd)} ended (status {proc.returncode}) before step 1")
  r0, r1 = rows[0], rows[1]
  return {"to_first_step_s": first, "setup_s": r0["setup_s"], "eval0_s": r0["eval_s"],
          "compile0_s": r0["compile_s"], "step1_s": r1["step_s"],
          "update1_s": r1["update_s"], "compile1_s": r1["compile_s"],
          "cache_hits": r0["compile_cache_hits"] + r1["compile_cache_hits"],
          "peak_rss_mb": r1["peak_rss_mb"], "cache_files": len(os.listdir(cache))}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--pairs", type=int, default=2)
  p.add_argument("--json", default=None)
  p.add_argument("flags", nargs="*", help="train flags (after --)")
  args = p.parse_args(argv)
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for pair in range(args.pairs):
      cache = os.path.join(tmp, f"cache{pair}")
      for kind in ("cold", "warm"):
        row = time_to_first_step(os.path.join(tmp, f"run{pair}_{kind}"), cache, args.flags)
        row.update(pair=pair, cache=kind, load=os.getloadavg()[0])
        results.append(row)
        print(json.dumps(row), flush=True)
  cols = ["pair", "cache", "to_first_step_s", "setup_s", "eval0_s", "compile0_s",
          "step1_s", "update1_s", "compile1_s", "cache_hits", "peak_rss_mb", "load"]
  print("| " + " | ".join(cols) + " |")
  print("|" + "---|" * len(cols))
  for r in results:
    print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                            for c in cols) + " |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
