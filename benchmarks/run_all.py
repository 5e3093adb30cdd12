"""Runs every benchmark, collects their JSON and writes a RESULTS.md.

Run: ``python -m benchmarks [--quick] [--only gae,logprobs,...] [--out DIR]
[--write-results] [--args NAME="ARGS"]``.

Each benchmark module ``benchmarks/<name>.py`` runs in its own subprocess as
``python -m benchmarks.<name> [--quick] --json OUT/<name>.json`` (a fresh process per
benchmark: JAX's device count flags, memory peaks and compile caches do not leak from
one benchmark into the next). Its printed output (markdown tables and notes) is kept in
``OUT/<name>.txt`` and in the ``RESULTS.md`` section written for it. A benchmark whose
module does not exist is reported as "missing"; one whose required optional
dependency is not installed (e.g. ``rlax`` for ``gae``) as "skipped"; one that fails as
"failed" with the tail of its output. The exit status is 1 when any benchmark failed.

``RESULTS.md`` goes to ``OUT/RESULTS.md`` (``OUT`` defaults to a fresh temporary
folder). Only a full run (no ``--quick``) with ``--write-results`` replaces the
committed ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCHMARKS = ("gae", "logprobs", "train_step", "sampler", "rollout", "sharding",
              "algorithms")
# Optional packages a benchmark cannot run without (others degrade inside the module).
REQUIRES = {"gae": ("rlax",)}
TITLES = {
    "gae": "GAE: scan / associative vs PyTorch loop vs rlax",
    "logprobs": "Chunked token log-probs: memory and speed",
    "train_step": "PPO train step: tokens/s and model FLOP utilisation",
    "sampler": "KV-cache sampler vs full recompute",
    "rollout": "Rollout engine (continuous batching, paged KV, shared prompts) vs sample",
    "sharding": "Sharded train step",
    "algorithms": "PPO, VAPO, GRPO, DAPO, RLOO (reverse or repeat task) and 2048-token "
                  "updates",
}


def machine_description() -> str:
  """Host, CPU count, Python and JAX versions and the default device (one process)."""
  code = ("import jax, platform, os; d = jax.devices()[0]; "
          "print(f'{platform.machine()} {os.cpu_count()} CPUs, Python "
          "{platform.python_version()}, jax {jax.__version__}, {len(jax.devices())} "
          "{d.platform} device(s) ({d.device_kind})')")
  try:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    desc = out.stdout.strip() or out.stderr.strip().splitlines()[-1]
  except (subprocess.SubprocessError, IndexError) as e:  # pragma: no cover
    desc = f"unknown ({e})"
  return f"{desc}; {platform.platform()}"


def status_of(name: str) -> str | None:
  """``None`` when runnable, else why not (``missing`` / ``skipped: ...``)."""
  if not os.path.exists(os.path.join(HERE, f"{name}.py")):
    return "missing"
  absent = [m for m in REQUIRES.get(name, ()) if importlib.util.find_spec(m) is None]
  if absent:
    return f"skipped (needs {', '.join(absent)}, not installed)"
  return None


def run_one(name: str, out_dir: str, quick: bool, extra: list[str], timeout: float):
  """Runs one benchmark; returns a record with its status, output and JSON payload."""
  record = {"name": name, "title": TITLES.get(name, name)}
  why = status_of(name)
  if why is not None:
    record.update(status=why.split(" ")[0], note=why)
    return record
  json_path = os.path.join(out_dir, f"{name}.json")
  cmd = [sys.executable, "-m", f"benchmarks.{name}", "--json", json_path]
  cmd += (["--quick"] if quick else []) + extra
  record["command"] = "python -m benchmarks.{} {}".format(
      name, " ".join(shlex.quote(a) for a in cmd[4:] if a != json_path and
                     a != "--json") + " --json " + os.path.basename(json_path)).replace(
                         "  ", " ")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)
    output, code = proc.stdout + proc.stderr, proc.returncode
  except subprocess.TimeoutExpired as e:
    output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    code = f"timeout after {timeout:.0f}s"
  record["seconds"] = round(time.perf_counter() - t0, 1)
  with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
    f.write(output)
  record["output"] = proc_stdout_only(output)
  if code == 0 and os.path.exists(json_path):
    record["status"] = "ok"
    with open(json_path) as f:
      record["json"] = json.load(f)
    record["json_path"] = json_path
  else:
    record["status"] = "failed"
    record["note"] = f"exit status {code}; last lines:\n" + "\n".join(
        output.strip().splitlines()[-15:])
  return record


def proc_stdout_only(text: str) -> str:
  """Drops JAX/absl warning lines from a benchmark's captured output."""
  keep = [ln for ln in text.splitlines()
          if not ln.startswith(("WARNING:", "W0", "I0", "E0"))
          and "UserWarning" not in ln and "warnings.warn" not in ln]
  return "\n".join(keep).strip()


def results_markdown(records, argv, machine: str, quick: bool) -> str:
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  lines = ["# Benchmark results", "",
           f"- Machine: {machine}",
           f"- Command: `python -m benchmarks {' '.join(shlex.quote(a) for a in argv)}`",
           f"- Date: {now}",
           f"- Mode: {'quick (smoke sizes, not for quoting)' if quick else 'full'}", "",
           "| benchmark | status | seconds |", "|---|---|---|"]
  for r in records:
    lines.append(f"| {r['name']} | {r['status']} | {r.get('seconds', '')} |")
  for r in records:
    lines += ["", f"## {r['title']}", ""]
    if r["status"] != "ok":
      lines += [f"**{r['status']}**: {r.get('note', '')}".rstrip()]
      continue
    lines += [f"Command: `{r['command']}`", "", r["output"]]
  return "\n".join(lines) + "\n"


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="smoke sizes (about a minute each)")
  p.add_argument("--only", default=None,
                 help=f"comma-separated subset of {','.join(BENCHMARKS)}")
  p.add_argument("--out", default=None, help="folder for JSON, logs and RESULTS.md "
                 "(default: a new temporary folder)")
  p.add_argument("--write-results", action="store_true",
                 help="full runs only: also replace benchmarks/RESULTS.md")
  p.add_argument("--args", action="append", default=[], metavar='NAME="ARGS"',
                 help='extra arguments for one benchmark, e.g. --args algorithms="--seeds 1"')
  p.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark")
  args = p.parse_args(argv)
  names = BENCHMARKS if args.only is None else tuple(
      n.strip() for n in args.only.split(",") if n.strip())
  extra = {}
  for item in args.args:
    name, _, rest = item.partition("=")
    extra[name.strip()] = shlex.split(rest)
  out_dir = args.out or tempfile.mkdtemp(prefix="jaxrl_llm_benchmarks_")
  os.makedirs(out_dir, exist_ok=True)

  machine = machine_description()
  print(f"machine: {machine}\noutput folder: {out_dir}", flush=True)
  records = []
  for name in names:
    print(f"\n=== {name} ===", flush=True)
    r = run_one(name, out_dir, args.quick, extra.get(name, []), args.timeout)
    records.append(r)
    if r["status"] == "ok":
      print(r["output"], flush=True)
    print(f"--> {name}: {r['status']}" + (f" ({r['seconds']}s)" if "seconds" in r else "")
          + (f": {r['note']}" if r.get("note") else ""), flush=True)

  text = results_markdown(records, argv, machine, args.quick)
  paths = [os.path.join(out_dir, "RESULTS.md")]
  if args.write_results and not args.quick:
    paths.append(os.path.join(HERE, "RESULTS.md"))
  elif args.write_results:
    print("note: --write-results is ignored with --quick (benchmarks/RESULTS.md "
          "keeps full-size figures only)")
  for path in paths:
    with open(path, "w") as f:
      f.write(text)
  summary = {r["name"]: r["status"] for r in records}
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump({"machine": machine, "quick": args.quick, "status": summary,
               "json": {r["name"]: r.get("json_path") for r in records}}, f, indent=2)
  print("\nsummary: " + ", ".join(f"{k}={val}" for k, val in summary.items()))
  print("wrote " + ", ".join(paths))
  return 1 if any(s == "failed" for s in summary.values()) else 0


if __name__ == "__main__":
  sys.exit(main())
