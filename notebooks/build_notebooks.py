"""Writes the tutorial notebooks from the cell sources below and executes them.

Run from the repository root (edit the cells here, never the .ipynb)::

  python notebooks/build_notebooks.py             # write, execute, save with outputs
  python notebooks/build_notebooks.py --no-execute  # write the sources only

Execution runs each notebook in a fresh kernel of this interpreter, in a temporary
working folder (nothing is written next to the notebooks), at the notebook's own sizes
(``JAXRL_LLM_SMALL`` unset; the test-suite runs them again with ``JAXRL_LLM_SMALL=1``),
and saves the outputs (text and plots) so a reader sees them on GitHub. Figures are
saved at a low resolution to keep the files small.

Each notebook opens with an "Open in Colab" badge, the steps to select a TPU runtime,
and a setup cell that, on Colab, clones the repository and installs it (with
``jax[tpu]`` when the runtime has a TPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The GitHub repository the Colab badge and the clone cell point at (owner/name).
REPO = "jaxrl-llm/jaxrl_llm"
BRANCH = "main"
NOTEBOOKS = ("01_advantages_and_losses.ipynb", "02_ppo_vs_grpo.ipynb",
             "03_sharded_long_sequence_ppo.ipynb", "04_hf_checkpoint_ppo.ipynb")


def colab_intro(name: str) -> str:
  """The badge and the runtime instructions appended to a notebook's title cell."""
  url = f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/notebooks/{name}"
  return (
      f"\n\n[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
      f"({url})\n\n"
      "**On Colab**: *Runtime > Change runtime type > TPU* (or a GPU; CPU works too, "
      "more slowly), then *Runtime > Run all*. The first code cell clones the "
      "repository and installs it (with `jax[tpu]` on a TPU runtime); the next one "
      "prints the devices JAX sees. **Locally**: `pip install -e \".[plot]\"` in the "
      "repository and start Jupyter in `notebooks/`.")


COLAB = f'''\
# Colab: clone the repository and install it. Does nothing outside Colab.
import glob
import os
import subprocess
import sys

if "google.colab" in sys.modules:
  if not os.path.exists("/content/jaxrl_llm"):
    subprocess.check_call(["git", "clone", "--depth", "1", "--branch", "{BRANCH}",
                           "https://github.com/{REPO}.git", "/content/jaxrl_llm"])
  # A TPU runtime exposes /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e and later).
  tpu = bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e",
                         "/content/jaxrl_llm[plot]"] + (["jax[tpu]"] if tpu else []))
  sys.path.insert(0, "/content/jaxrl_llm")
  os.chdir("/content/jaxrl_llm/notebooks")
'''

SETUP = '''\
# Setup: make `jaxrl_llm` importable from a clone, read the SMALL switch.
import importlib.util
import os
import sys

if importlib.util.find_spec("jaxrl_llm") is None:
  root = os.path.abspath("..")
  if not os.path.exists(os.path.join(root, "jaxrl_llm", "__init__.py")):
    raise ImportError("jaxrl_llm is not installed: `pip install -e .` in the repository "
                      "(or start this notebook from its notebooks/ folder).")
  sys.path.insert(0, root)

# JAXRL_LLM_SMALL=1 shrinks every size so the notebook runs in seconds (the tests set it).
SMALL = os.environ.get("JAXRL_LLM_SMALL", "0") == "1"
print("SMALL =", SMALL)
'''

PLOTS = (
    "import matplotlib.pyplot as plt\n"
    "plt.rcParams['figure.dpi'] = 60  # small images keep the saved notebook small\n")

def nb01():
  cells = [
      new_markdown_cell(
          "# 01 - Advantages and losses\n\n"
          "The estimators and losses of `jaxrl_llm` are pure functions of `[B, T]` arrays "
          "with a `mask` (1 = valid token). This notebook draws them: GAE (sequential "
          "scan vs associative scan), group baselines (GRPO, Dr.GRPO, RLOO), the "
          "self-critical baseline, the clipped PPO surrogate with dual clip, and the KL "
          "estimators k1/k2/k3; then it composes a custom loss in a few lines."
          + colab_intro(NOTEBOOKS[0])),
      new_code_cell(COLAB),
      new_code_cell(SETUP),
      new_code_cell(
          "import jax\nimport jax.numpy as jnp\nimport numpy as np\n" + PLOTS +
          "import jaxrl_llm as rl\n"
          "print(jax.devices())"),
      new_markdown_cell(
          "## GAE: scan vs associative scan\n\n"
          "$\\delta_t = r_t + \\gamma V_{t+1} - V_t$, "
          "$A_t = \\delta_t + \\gamma\\lambda A_{t+1}$. `method='scan'` runs the "
          "recurrence right to left; `method='associative'` solves the same linear "
          "recurrence with `jax.lax.associative_scan` in $O(\\log T)$ depth. A sparse "
          "terminal reward (the usual RLHF case) with a random critic:"),
      new_code_cell(
          "B, T = (4, 32) if SMALL else (8, 256)\n"
          "rng = np.random.default_rng(0)\n"
          "lengths = rng.integers(T // 2, T + 1, B)\n"
          "mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)\n"
          "rewards = np.zeros((B, T), np.float32)\n"
          "rewards[np.arange(B), lengths - 1] = rng.uniform(size=B)\n"
          "values = (rng.normal(size=(B, T)) * 0.1).astype(np.float32) * mask\n"
          "adv_scan, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95)\n"
          "adv_assoc, _ = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95, "
          "method='associative')\n"
          "print('max |scan - associative| =', float(jnp.max(jnp.abs(adv_scan - adv_assoc))))\n"
          "fig, ax = plt.subplots(figsize=(8, 3))\n"
          "for lam in (0.0, 0.9, 0.95, 1.0):\n"
          "  a, _ = rl.gae(rewards, values, mask, gamma=1.0, lam=lam)\n"
          "  ax.plot(np.asarray(a[0, :lengths[0]]), label=f'lambda={lam}')\n"
          "ax.set_xlabel('token'); ax.set_ylabel('advantage (row 0)'); ax.legend()\n"
          "ax.set_title('GAE of a terminal reward: lambda spreads credit backwards')\n"
          "plt.show()"),
      new_markdown_cell(
          "## Group baselines and the self-critical baseline\n\n"
          "With G samples per prompt the group itself is the baseline: GRPO "
          "$(s_i-\\mu_g)/(\\sigma_g+\\epsilon)$, Dr.GRPO $s_i-\\mu_g$, RLOO "
          "$s_i - \\frac{1}{G-1}\\sum_{j\\ne i}s_j$. Self-critical subtracts the reward "
          "of the greedy decode of the same prompt."),
      new_code_cell(
          "G = 4\n"
          "scores = jnp.array([1.0, 0.0, 0.0, 1.0,   0.2, 0.4, 0.6, 0.8,   1., 1., 1., 1.])\n"
          "est = {'grpo': rl.grpo_advantages(scores, group_size=G),\n"
          "       'dr_grpo': rl.dr_grpo_advantages(scores, group_size=G),\n"
          "       'rloo': rl.rloo_advantages(scores, group_size=G),\n"
          "       'self-critical (greedy=0.5)': rl.self_critical_advantages(\n"
          "           scores, jnp.full_like(scores, 0.5))}\n"
          "fig, ax = plt.subplots(figsize=(9, 3))\n"
          "x = np.arange(len(scores))\n"
          "for k, (name, a) in enumerate(est.items()):\n"
          "  ax.bar(x + 0.2 * k - 0.3, np.asarray(a), width=0.2, label=name)\n"
          "ax.axhline(0, color='k', lw=0.5); ax.set_xticks(x); ax.legend(fontsize=8)\n"
          "ax.set_xlabel('sample (3 groups of 4)'); ax.set_ylabel('advantage')\n"
          "ax.set_title('A group with equal scores gets zero advantage: no signal')\n"
          "plt.show()\n"
          "# Per-sequence advantages become per-token ones by broadcasting over the mask:\n"
          "print(rl.broadcast_to_tokens(est['grpo'][:2], jnp.ones((2, 3))))"),
      new_markdown_cell(
          "## Clipped surrogate and dual clip\n\n"
          "$L = \\max(-A\\rho, -A\\,\\mathrm{clip}(\\rho, 1-\\epsilon, 1+\\epsilon))$; "
          "the dual clip bounds the loss of negative-advantage tokens by $-A c$ when "
          "the ratio $\\rho$ explodes."),
      new_code_cell(
          "ratio = jnp.linspace(0.01, 5.0, 200)\n"
          "logp = jnp.log(ratio)[None]\n"
          "old = jnp.zeros_like(logp)\n"
          "ones = jnp.ones_like(logp)\n"
          "fig, axes = plt.subplots(1, 2, figsize=(10, 3))\n"
          "for ax, a in zip(axes, (1.0, -1.0)):\n"
          "  for dual in (None, 3.0):\n"
          "    loss, _ = rl.ppo_policy_loss(logp, old, a * ones, ones, clip_low=0.2,\n"
          "                                 dual_clip=dual)\n"
          "    ax.plot(ratio, np.asarray(loss[0]), label=f'dual_clip={dual}',\n"
          "            ls='-' if dual is None else '--')\n"
          "  ax.set_title(f'A = {a:+.0f}'); ax.set_xlabel('ratio pi/pi_old')\n"
          "  ax.set_ylabel('per-token loss'); ax.legend()\n"
          "plt.tight_layout(); plt.show()"),
      new_markdown_cell(
          "## KL estimators\n\n"
          "With $x = \\log\\pi - \\log\\pi_{ref}$ on samples of $\\pi$: k1 $= x$ "
          "(unbiased, can be negative), k2 $= x^2/2$, k3 $= e^{-x} - 1 + x$ "
          "(unbiased and non-negative)."),
      new_code_cell(
          "x = jnp.linspace(-2.0, 2.0, 201)[None]\n"
          "fig, ax = plt.subplots(figsize=(6, 3))\n"
          "for kind in ('k1', 'k2', 'k3'):\n"
          "  ax.plot(x[0], np.asarray(rl.kl_penalty(x, jnp.zeros_like(x), kind)[0]),\n"
          "          label=kind)\n"
          "ax.axhline(0, color='k', lw=0.5); ax.legend()\n"
          "ax.set_xlabel('log pi - log pi_ref'); ax.set_ylabel('per-token KL estimate')\n"
          "plt.show()"),
      new_markdown_cell(
          "## A custom loss in a few lines\n\n"
          "Clipped surrogate with clip-higher (DAPO), a k3 KL to the reference and an "
          "entropy bonus, aggregated per sequence then averaged "
          "(`seq-mean-token-mean`); differentiable with `jax.grad`."),
      new_code_cell(
          "def my_loss(logp, old_logp, ref_logp, adv, mask, entropy):\n"
          "  pg, metrics = rl.ppo_policy_loss(logp, old_logp, adv, mask,\n"
          "                                   clip_low=0.2, clip_high=0.28)\n"
          "  kl = rl.kl_penalty(logp, ref_logp, 'k3', mask=mask)\n"
          "  per_token = pg + 0.01 * kl - 0.001 * entropy\n"
          "  return rl.aggregate(per_token, mask, 'seq-mean-token-mean'), metrics\n\n"
          "B, T = 4, 16\n"
          "key = jax.random.PRNGKey(0)\n"
          "logp = -jax.random.uniform(key, (B, T)) * 3\n"
          "mask = (jnp.arange(T)[None] < jnp.array([16, 12, 8, 4])[:, None]).astype(jnp.float32)\n"
          "adv = rl.broadcast_to_tokens(rl.grpo_advantages(jnp.array([1., 0., 1., 0.]),\n"
          "                                                group_size=4), mask)\n"
          "ent = jnp.ones((B, T))\n"
          "loss, grad = jax.value_and_grad(lambda lp: my_loss(lp, logp, logp - 0.1, adv,\n"
          "                                                   mask, ent)[0])(logp)\n"
          "print('loss', float(loss))\n"
          "print('grad is zero on masked tokens:', bool(jnp.all(grad * (1 - mask) == 0)))"),
  ]
  return cells


def nb02():
  cells = [
      new_markdown_cell(
          "# 02 - PPO vs GRPO vs RLOO\n\n"
          "Trains the tiny reference transformer on the default task (reverse a digit "
          "string) with each algorithm through `jaxrl_llm.loop.run.run_training`, under the same "
          "budget (prompts per step x group size samples per step, same steps), into a "
          "temporary folder, and plots the reward, the advantage variance and the KL to "
          "the reference side by side. `python -m benchmarks.algorithms` measures the "
          "same comparison over several seeds." + colab_intro(NOTEBOOKS[1])),
      new_code_cell(COLAB),
      new_code_cell(SETUP),
      new_code_cell(
          "import json\nimport tempfile\n" + PLOTS +
          "from jaxrl_llm.loop.config import RunConfig\n"
          "from jaxrl_llm.loop.run import format_summary, run_training\n\n"
          "tmp = tempfile.TemporaryDirectory(prefix='jaxrl_llm_nb02_')\n"
          "size = (dict(steps=3, prompts_per_step=4, group_size=2, eval_every=3, eval_size=8)\n"
          "        if SMALL else\n"
          "        dict(steps=120, prompts_per_step=32, group_size=8, eval_every=20,\n"
          "             eval_size=256))\n"
          "print(size)"),
      new_code_cell(
          "histories, summaries = {}, {}\n"
          "for algo in ('ppo', 'grpo', 'rloo'):\n"
          "  run = RunConfig(algo=algo, out=os.path.join(tmp.name, algo), progress=False,\n"
          "                  save_every=10**9, **size)\n"
          "  summaries[algo] = run_training(run)\n"
          "  with open(os.path.join(run.out, 'metrics.jsonl')) as f:\n"
          "    histories[algo] = [json.loads(line) for line in f if line.strip()]\n"
          "  print(algo)\n"
          "  print(format_summary(summaries[algo]))"),
      new_markdown_cell(
          "`adv_raw_var` is the advantage variance per token *before* PPO's whitening: "
          "PPO's GAE advantages are in reward units, GRPO's are already divided by the "
          "group std, so the raw values of different algorithms are in different units "
          "(see `benchmarks/algorithms.py` for a variance normalised by the score "
          "variance)."),
      new_code_cell(
          "keys = [('reward', 'train reward'), ('adv_raw_var', 'advantage variance (raw)'),\n"
          "        ('kl_ref', 'KL to reference'), ('eval_accuracy', 'eval accuracy')]\n"
          "fig, axes = plt.subplots(1, len(keys), figsize=(16, 3.2))\n"
          "for ax, (key, title) in zip(axes, keys):\n"
          "  for algo, rows in histories.items():\n"
          "    pts = [(r['step'], r[key]) for r in rows if key in r]\n"
          "    if pts:\n"
          "      xs, ys = zip(*pts)\n"
          "      ax.plot(xs, ys, label=algo, marker='o' if key.startswith('eval') else None)\n"
          "  ax.set_title(title); ax.set_xlabel('step')\n"
          "axes[0].legend(); plt.tight_layout(); plt.show()"),
      new_code_cell("tmp.cleanup()"),
  ]
  return cells


SETUP_03 = SETUP + '''
# Expose 8 CPU devices when no accelerator is used: XLA reads this flag when JAX starts,
# so it must be set before `import jax`. It changes nothing on GPU/TPU backends.
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
'''


def nb03():
  cells = [
      new_markdown_cell(
          "# 03 - Sharded, long-sequence PPO\n\n"
          "Builds a mesh from the devices that exist (a TPU slice, GPUs, or 8 CPU devices "
          "forced with `XLA_FLAGS`), shards the PPO train step with "
          "`jaxrl_llm.train.shard_train_step` (parameters, optimizer state and batch "
          "laid out by their logical axis names), shows the memory each device holds, "
          "and compares the chunked log-prob path with a full-vocabulary log-softmax at a "
          "long sequence length." + colab_intro(NOTEBOOKS[2])),
      new_code_cell(COLAB),
      new_code_cell(SETUP_03),
      new_code_cell(
          "import jax\nimport jax.numpy as jnp\nimport numpy as np\nimport optax\n"
          "from flax import nnx\n"
          "import jaxrl_llm as rl\n"
          "from jaxrl_llm import parallel\n"
          "from jaxrl_llm.train import shard_train_step\n"
          "from jaxrl_llm.models.transformer import (Transformer, get_config, "
          "make_apply_fn, split_model)\n"
          "print(jax.default_backend(), len(jax.devices()), 'devices:', jax.devices()[:4])"),
      new_markdown_cell(
          "## Mesh\n\n`make_mesh` has axes `(data, fsdp, tensor, sequence)`. We split the "
          "devices between data parallelism and FSDP (parameters and optimizer state "
          "sharded over `fsdp`)."),
      new_code_cell(
          "n = len(jax.devices())\n"
          "fsdp = 2 if n % 2 == 0 else 1\n"
          "mesh = parallel.make_mesh(data=-1, fsdp=fsdp)\n"
          "print(parallel.mesh_axis_sizes(mesh))"),
      new_code_cell(
          "vocab = 256\n"
          "B, L = (8, 64) if SMALL else (16, 512)\n"
          "cfg = get_config('tiny' if SMALL else 'small', vocab, value_head=True, max_seq_len=L)\n"
          "graphdef, params = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))\n"
          "config = rl.TrainConfig(use_value=True, kl_mode='none')\n"
          "optimizer = optax.adam(1e-4)\n"
          "step_fn = rl.make_ppo_train_step(make_apply_fn(graphdef), optimizer, config)\n"
          "state = rl.init_train_state(params, optimizer, config)\n\n"
          "rng = np.random.default_rng(0)\n"
          "loss_mask = np.zeros((B, L), np.float32); loss_mask[:, L // 2:] = 1\n"
          "rewards = np.zeros((B, L), np.float32); rewards[:, -1] = rng.uniform(size=B)\n"
          "host_batch = dict(tokens=rng.integers(1, vocab, (B, L)).astype(np.int32),\n"
          "                  attention_mask=np.ones((B, L), np.float32), loss_mask=loss_mask,\n"
          "                  old_logp=np.full((B, L), -np.log(vocab), np.float32) * loss_mask,\n"
          "                  old_values=np.zeros((B, L), np.float32), rewards=rewards)\n"
          "step, sharded_state = shard_train_step(step_fn, state, mesh, batch=host_batch)\n"
          "batch = parallel.shard_batch(host_batch, mesh)\n"
          "for _ in range(2):\n"
          "  sharded_state, metrics = step(sharded_state, batch)\n"
          "print('step', int(sharded_state.step), 'loss', float(metrics['loss']))"),
      new_markdown_cell(
          "## Where the data lives\n\nThe sharding spec of a few parameters and the bytes "
          "each device holds (parameters + optimizer state, from the addressable shards)."),
      new_code_cell(
          "summary = parallel.sharding_summary(sharded_state.params)\n"
          "for k in list(summary)[:6]:\n"
          "  print(f'{k:<60} {summary[k]}')\n\n"
          "def bytes_per_device(tree):\n"
          "  out = {}\n"
          "  for x in jax.tree_util.tree_leaves(tree):\n"
          "    for shard in x.addressable_shards:\n"
          "      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes\n"
          "  return out\n\n"
          "total = sum(x.nbytes for x in jax.tree_util.tree_leaves((sharded_state.params,\n"
          "                                                          sharded_state.opt_state)))\n"
          "per = bytes_per_device((sharded_state.params, sharded_state.opt_state))\n"
          "print(f'unsharded size: {total / 2**20:.2f} MiB')\n"
          "for d, nbytes in sorted(per.items(), key=lambda kv: kv[0].id):\n"
          "  print(f'  {d}: {nbytes / 2**20:.2f} MiB')\n"
          "stats = jax.devices()[0].memory_stats()  # None on CPU\n"
          "if stats:\n"
          "  print('device 0 bytes in use:', stats.get('bytes_in_use'))"),
      new_markdown_cell(
          "## Chunked log-probs at long T\n\n"
          "`token_logprobs_from_hidden` computes "
          "$\\log\\mathrm{softmax}(h W)[y]$ chunk by chunk, never forming the "
          "`[B, T, V]` logits. XLA's compiled memory analysis shows the temporary "
          "memory of forward + backward for both paths."),
      new_code_cell(
          "T, D, V = (1024, 64, 4096) if SMALL else (16384, 256, 32000)\n"
          "key = jax.random.PRNGKey(0)\n"
          "hidden = jax.random.normal(key, (1, T, D), jnp.float32)\n"
          "lm_head = jax.random.normal(key, (D, V), jnp.float32) / np.sqrt(D)\n"
          "targets = jax.random.randint(key, (1, T), 0, V)\n\n"
          "def naive(h, w):\n"
          "  logits = jnp.einsum('btd,dv->btv', h, w)\n"
          "  lp = jax.nn.log_softmax(logits, -1)\n"
          "  return jnp.sum(jnp.take_along_axis(lp, targets[..., None], -1))\n\n"
          "def chunked(h, w):\n"
          "  return jnp.sum(rl.token_logprobs_from_hidden(h, w, targets, chunk_size=256))\n\n"
          "def temp_mib(fn):\n"
          "  compiled = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(hidden, lm_head).compile()\n"
          "  analysis = compiled.memory_analysis()\n"
          "  return None if analysis is None else analysis.temp_size_in_bytes / 2**20\n\n"
          "print(f'T={T}, D={D}, V={V}: full logits would be {T * V * 4 / 2**20:.0f} MiB')\n"
          "print('naive   temp MiB:', temp_mib(naive))\n"
          "print('chunked temp MiB:', temp_mib(chunked))\n"
          "# Same values (checked on the first 1024 tokens, to keep host memory small):\n"
          "n = 1024\n"
          "lp_full = jax.nn.log_softmax(hidden[:, :n] @ lm_head, -1)\n"
          "lp_full = jnp.take_along_axis(lp_full, targets[:, :n, None], -1)[..., 0]\n"
          "lp_chunk = rl.token_logprobs_from_hidden(hidden[:, :n], lm_head, targets[:, :n],\n"
          "                                         chunk_size=256)\n"
          "print('max |full - chunked| =', float(jnp.max(jnp.abs(lp_full - lp_chunk))))\n"
          "np.testing.assert_allclose(lp_chunk, lp_full, atol=1e-4)"),
  ]
  return cells


# Notebook 04 reads Hugging Face folders: the [hf] extra (Colab has transformers).
COLAB_HF = COLAB.replace("/content/jaxrl_llm[plot]", "/content/jaxrl_llm[plot,hf]")


def nb04():
  cells = [
      new_markdown_cell(
          "# 04 - A Hugging Face checkpoint: load, train with PPO, save back\n\n"
          "Builds a tiny local Hugging Face model folder (a random Qwen3 with a byte-level "
          "BPE tokenizer, a chat template and two end-of-turn ids, as Llama-3 and Qwen "
          "checkpoints have), loads it with `jaxrl_llm.models.from_pretrained`, trains a "
          "few PPO steps on a small JSONL dataset with the `math` reward through "
          "`jaxrl_llm.loop.run.run_training`, writes the trained policy back with "
          "`save_pretrained` and reloads it to show the logits match. Everything is "
          "local: with a real checkpoint, point `MODEL` at its folder (e.g. a downloaded "
          "`Qwen/Qwen3-0.6B`) and skip the cell that builds the tiny one. transformers is "
          "optional: when it is installed the notebook builds the model with it and "
          "compares logits with it, else it writes the random model with "
          "`save_pretrained`." + colab_intro(NOTEBOOKS[3])),
      new_code_cell(COLAB_HF),
      new_code_cell(SETUP),
      new_code_cell(
          "import json\nimport tempfile\n\n"
          "import jax\nimport jax.numpy as jnp\nimport numpy as np\n" + PLOTS +
          "from flax import nnx\n"
          "from jaxrl_llm.models import from_pretrained, save_pretrained, split_model\n"
          "from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer\n\n"
          "try:\n"
          "  import warnings\n"
          "  warnings.filterwarnings('ignore', message='IProgress not found')  # tqdm, no widgets\n"
          "  import torch\n"
          "  import transformers\n"
          "  transformers.utils.logging.disable_progress_bar()\n"
          "except ImportError:\n"
          "  transformers = None\n"
          "# Full float32 matmuls, so the logit comparisons below hold on TPU/GPU too.\n"
          "jax.config.update('jax_default_matmul_precision', 'highest')\n"
          "tmp = tempfile.TemporaryDirectory(prefix='jaxrl_llm_nb04_')\n"
          "MODEL = os.path.join(tmp.name, 'tiny-qwen3')\n"
          "print(jax.devices(), '| transformers:', getattr(transformers, '__version__', None))"),
      new_markdown_cell(
          "## A tiny local checkpoint\n\n"
          "A model folder as the Hub has them: `tokenizer.json` (here a byte-level BPE "
          "trained on a few sentences with the `tokenizers` package), "
          "`tokenizer_config.json` with the special tokens and the chat template, "
          "`config.json` + `model.safetensors`, and `generation_config.json` whose "
          "`eos_token_id` is a *list*: a completion ends at `<|endoftext|>` or at "
          "`<|im_end|>`, and the sampler stops a row at either."),
      new_code_cell(
          "from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers\n\n"
          "CHAT = ('{% for m in messages %}<|im_start|>{{ m[\"role\"] }}\\n'\n"
          "        '{{ m[\"content\"] }}<|im_end|>\\n{% endfor %}'\n"
          "        '{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}')\n"
          "bpe = Tokenizer(models.BPE())\n"
          "bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)\n"
          "bpe.decoder = decoders.ByteLevel()\n"
          "corpus = [f'what is {a} + {b}? The answer is {a + b}.' for a in range(20)\n"
          "          for b in range(20)]\n"
          "bpe.train_from_iterator(corpus, trainers.BpeTrainer(\n"
          "    vocab_size=320, special_tokens=['<|endoftext|>', '<|im_start|>', '<|im_end|>'],\n"
          "    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))\n"
          "os.makedirs(MODEL, exist_ok=True)\n"
          "bpe.save(os.path.join(MODEL, 'tokenizer.json'))\n"
          "with open(os.path.join(MODEL, 'tokenizer_config.json'), 'w') as f:\n"
          "  json.dump({'tokenizer_class': 'PreTrainedTokenizerFast',\n"
          "             'eos_token': '<|endoftext|>', 'pad_token': '<|endoftext|>',\n"
          "             'chat_template': CHAT}, f)\n\n"
          "vocab = bpe.get_vocab_size()\n"
          "eos_ids = [bpe.token_to_id('<|endoftext|>'), bpe.token_to_id('<|im_end|>')]\n"
          "if transformers is not None:      # built (randomly initialised) by transformers\n"
          "  torch.manual_seed(0)\n"
          "  cfg = transformers.Qwen3Config(\n"
          "      vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
          "      num_attention_heads=4, num_key_value_heads=2, head_dim=16,\n"
          "      max_position_embeddings=128, tie_word_embeddings=False,\n"
          "      eos_token_id=eos_ids[0])\n"
          "  transformers.Qwen3ForCausalLM(cfg).save_pretrained(MODEL)\n"
          "else:                             # the same architecture, saved by jaxrl_llm\n"
          "  from jaxrl_llm.models import Transformer, TransformerConfig\n"
          "  cfg = TransformerConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4,\n"
          "                          n_kv_heads=2, d_ff=128, head_dim=16, max_seq_len=128,\n"
          "                          qk_norm=True, tie_embeddings=False, value_head=False)\n"
          "  save_pretrained(Transformer(cfg, rngs=nnx.Rngs(0)), MODEL,\n"
          "                  extra_config={'eos_token_id': eos_ids[0]})\n"
          "with open(os.path.join(MODEL, 'generation_config.json'), 'w') as f:\n"
          "  json.dump({'eos_token_id': eos_ids}, f)       # two end-of-turn ids\n"
          "print(sorted(os.listdir(MODEL)))"),
      new_markdown_cell(
          "## Load it\n\n"
          "`from_pretrained` maps the Hugging Face tensors onto the reference "
          "`Transformer` (pass `mesh=` to read each tensor straight into its sharded "
          "layout); `HFTokenizer` reads the tokenizer, its chat template and every eos "
          "id (tokenizer, `generation_config.json`, `config.json`)."),
      new_code_cell(
          "model = from_pretrained(MODEL, dtype=jnp.float32)\n"
          "tok = HFTokenizer.from_pretrained(MODEL)\n"
          "print(model.config)\n"
          "print('eos ids:', tok.eos_ids)\n"
          "prompt = tok.apply_chat_template([{'role': 'user', 'content': 'what is 2 + 3?'}])\n"
          "print(repr(prompt))\n"
          "tokens = jnp.asarray([tok.encode(prompt)])\n\n\n"
          "def logits_of(m, tokens):\n"
          "  hidden, _ = m(tokens)\n"
          "  return np.asarray(m.logits(hidden))\n\n\n"
          "def hf_logits(folder, tokens):\n"
          "  hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()\n"
          "  with torch.no_grad():\n"
          "    return hf(torch.tensor(np.asarray(tokens))).logits.float().numpy()\n\n\n"
          "initial_logits = logits_of(model, tokens)\n"
          "if transformers is not None:\n"
          "  diff = np.abs(initial_logits - hf_logits(MODEL, tokens)).max()\n"
          "  print(f'max |ours - transformers| = {diff:.2e}')"),
      new_markdown_cell(
          "## A JSONL dataset and a few PPO steps\n\n"
          "One `{\"prompt\": ..., \"answer\": ...}` per line; the prompts go through the "
          "chat template, the `math` reward extracts the final answer of a completion "
          "(`\\boxed{}`, `#### n`, or the last number) and compares it numerically. "
          "`run_training` is what `jaxrl-llm train --model MODEL --dataset DATA "
          "--reward math --algo ppo` runs: rollouts with the KV-cache sampler, GAE with "
          "the value head (initialised to zeros), the clipped PPO update, a KL "
          "reference that keeps only the policy's weights, and orbax checkpoints. A "
          "random model rarely answers right: with a zero reward and a zero-initialised "
          "value head GAE gives zero advantages, so the policy moves only on steps "
          "where some completion earned a reward (with a real checkpoint, most steps)."),
      new_code_cell(
          "from jaxrl_llm.loop.config import RunConfig\n"
          "from jaxrl_llm.loop.run import format_summary, run_training\n\n"
          "DATA = os.path.join(tmp.name, 'train.jsonl')\n"
          "rng = np.random.default_rng(0)\n"
          "with open(DATA, 'w') as f:\n"
          "  for a, b in rng.integers(0, 20, (20, 2)):\n"
          "    f.write(json.dumps({'prompt': f'what is {a} + {b}?', 'answer': int(a + b)}) "
          "+ '\\n')\n"
          "size = (dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4,\n"
          "             eval_size=4, eval_every=2) if SMALL else\n"
          "        dict(steps=20, prompts_per_step=8, group_size=4, max_new_tokens=8,\n"
          "             eval_size=16, eval_every=5))\n"
          "run = RunConfig(algo='ppo', model=MODEL, dataset=DATA, reward='math', lr=1e-3,\n"
          "                out=os.path.join(tmp.name, 'run'), progress=False,\n"
          "                save_every=10**9, **size)\n"
          "summary = run_training(run)\n"
          "print(format_summary(summary))"),
      new_code_cell(
          "with open(os.path.join(run.out, 'metrics.jsonl')) as f:\n"
          "  rows = [json.loads(line) for line in f if line.strip()][1:]\n"
          "keys = [('reward', 'train reward'), ('kl_ref', 'KL to reference'),\n"
          "        ('vf_loss', 'value loss')]\n"
          "fig, axes = plt.subplots(1, len(keys), figsize=(12, 2.8))\n"
          "for ax, (key, title) in zip(axes, keys):\n"
          "  ax.plot([r['step'] for r in rows], [r[key] for r in rows], marker='o')\n"
          "  ax.set_title(title); ax.set_xlabel('step')\n"
          "plt.tight_layout(); plt.show()"),
      new_markdown_cell(
          "## Save it back and reload\n\n"
          "`restore_run` rebuilds the models of the run's last checkpoint. The Hugging "
          "Face model is the policy alone, so the value head is dropped before "
          "`save_pretrained` (`save_value_head` writes it to a file of its own). "
          "`jaxrl-llm train --model` does all of this at the end of a run (the folder "
          "`RUN/hf`, with the tokenizer files), and `jaxrl-llm export RUN` does it for "
          "an existing run."),
      new_code_cell(
          "from jaxrl_llm.loop.export import restore_run\n"
          "from jaxrl_llm.models.critic import drop_value_head\n\n"
          "_, trained, _, step = restore_run(run.out)\n"
          "policy = nnx.merge(*drop_value_head(*split_model(trained)))\n"
          "OUT = os.path.join(tmp.name, 'trained-hf')\n"
          "save_pretrained(policy, OUT, tokenizer=tok, extra_config={'eos_token_id': eos_ids})\n"
          "print(f'step {step} ->', sorted(os.listdir(OUT)))\n\n"
          "reloaded = from_pretrained(OUT, dtype=jnp.float32)\n"
          "trained_logits = logits_of(policy, tokens)\n"
          "diff = np.abs(logits_of(reloaded, tokens) - trained_logits).max()\n"
          "print(f'max |reloaded - trained| = {diff:.2e}')\n"
          "moved = np.abs(trained_logits - initial_logits).max()\n"
          "print(f'max |trained - initial|  = {moved:.2e}  (rewarded steps: '\n"
          "      f'{sum(r[\"reward\"] > 0 for r in rows)} of {len(rows)})')\n"
          "assert diff < 1e-5\n"
          "if transformers is not None:\n"
          "  diff = np.abs(hf_logits(OUT, tokens) - trained_logits).max()\n"
          "  print(f'max |transformers(OUT) - trained| = {diff:.2e}')\n"
          "  hf_tok = transformers.AutoTokenizer.from_pretrained(OUT)\n"
          "  print('AutoTokenizer ids match:', hf_tok(prompt)['input_ids'] == tok.encode(prompt))"),
      new_code_cell("tmp.cleanup()"),
  ]
  return cells


def build(name: str, cells) -> nbformat.NotebookNode:
  nb = new_notebook(cells=cells)
  for i, cell in enumerate(nb.cells):
    cell.id = f"cell-{i:02d}"                          # stable ids: clean diffs
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                               "language": "python"}
  nb.metadata["language_info"] = {"name": "python"}
  nb.metadata["accelerator"] = "TPU"                   # Colab opens it on a TPU runtime
  nb.metadata["colab"] = {"name": name, "provenance": []}
  nbformat.validate(nb)
  return nb


def sources() -> dict:
  """``{file name: notebook without outputs}`` (the tests compare the saved cells)."""
  return {name: build(name, cells) for name, cells in zip(NOTEBOOKS, (nb01(), nb02(),
                                                                      nb03(), nb04()))}


def execute(nb: nbformat.NotebookNode, *, small: bool, timeout: int = 1800) -> None:
  """Runs ``nb`` in place in a fresh kernel of this interpreter, in a temporary folder."""
  import nbclient
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("JAXRL_LLM_SMALL", None)
  env.pop("MPLBACKEND", None)            # the kernel's inline backend saves the figures
  if small:
    env["JAXRL_LLM_SMALL"] = "1"
  with tempfile.TemporaryDirectory(prefix="jaxrl_llm_nb_") as cwd:
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": cwd}},
                                     record_timing=False)
    # jupyter_client starts the kernel with the environment it is given.
    client.execute(env=env)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--no-execute", action="store_true", help="write the sources only")
  p.add_argument("--small", action="store_true",
                 help="execute at JAXRL_LLM_SMALL=1 sizes (a quick check, not for saving)")
  p.add_argument("--only", default=None, help="comma-separated notebook names")
  args = p.parse_args(argv)
  for name, nb in sources().items():
    if args.only and not any(part in name for part in args.only.split(",")):
      continue
    if not args.no_execute:
      execute(nb, small=args.small)
    path = os.path.join(HERE, name)
    with open(path, "w") as f:
      nbformat.write(nb, f)
    print(path, file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
