"""Multi-device checks on 8 forced CPU devices, run in one subprocess by test_parallel.py.

``python -m tests.parallel_worker OUT.json [CKPT_DIR]`` runs every case (so jax is
imported and the reference compiled once) and writes the measurements as JSON; the
test functions assert on them. Each case catches its own exception and records the
traceback, so one failure does not hide the others.
"""

from __future__ import annotations

from tests._devices import force_host_devices

force_host_devices(8)    # before jax is imported; the caller's other XLA flags kept

import json
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

# Compile fast (this is a 2-core CI box): sharding propagation and SPMD partitioning
# still run; the optimization level changes float rounding only, far below the 1e-5
# tolerance of the comparisons.
jax.config.update("jax_disable_most_optimizations", True)

from jaxrl_llm.advantages import gae
from jaxrl_llm.logprobs import token_logprobs_from_hidden
from jaxrl_llm.parallel import (
  gather_to_host,
  make_mesh,
  replicate,
  sequence_parallel_gae,
  sequence_parallel_token_logprobs,
  shard_batch,
  sharding_summary,
  split_batch,
  state_shardings,
)
from jaxrl_llm.train import (
  init_train_state,
  make_pmap_train_step,
  make_train_step,
  shard_apply_fn,
  shard_train_step,
)
from tests import parallel_setup as S
from tests.utils import random_mask

# name: (mesh sizes, build the step from shard_apply_fn (activation constraints)).
LAYOUTS = {
    "data8": (dict(data=8), False),
    "fsdp8": (dict(data=1, fsdp=8), True),
    "data2_fsdp2_tensor2": (dict(data=2, fsdp=2, tensor=2), True),
    "data4_tensor2": (dict(data=4, tensor=2), False),
}


def _shardings(tree):
  return [x.sharding for x in jax.tree_util.tree_leaves(tree)]


def case_layout(name, sizes, constrained, ref_params, ref_hist, results):
  apply_fn, params, optimizer, config, batch = S.build()
  mesh = make_mesh(**sizes)
  if constrained:
    apply_fn = shard_apply_fn(apply_fn, mesh)
  state = init_train_state(params, optimizer, config)
  step, state = shard_train_step(make_train_step(apply_fn, optimizer, config), state,
                                 mesh, batch=batch)
  before = _shardings(state)
  placed = shard_batch(batch, mesh)
  same_layout, hist = [], []
  for _ in range(S.STEPS):
    state, metrics = step(state, placed)
    same_layout.append(_shardings(state) == before)
    hist.append({k: float(x) for k, x in metrics.items()})
  summary = sharding_summary(state)
  out = dict(
      param_diff=S.max_abs_diff(S.flat_params(gather_to_host(state.params)), ref_params),
      metric_diff=max(abs(h[k] - r[k]) for h, r in zip(hist, ref_hist) for k in r),
      same_layout=all(same_layout), cache_size=step._cache_size(),
      embed_spec=summary[".params['embed'].value"],
      wq_spec=summary[".params['blocks'][0]['attn']['wq'].value"],
      w_down_spec=summary[".params['blocks'][0]['mlp']['w_down'].value"],
      momentum_wq_spec=summary[".opt_state[0].trace['blocks'][0]['attn']['wq'].value"],
      step_spec=summary[".step"], rng_spec=summary[".rng"],
      batch_spec=str(placed["tokens"].sharding.spec),
      skipped=sum(h["skipped"] for h in hist), loss=[h["loss"] for h in hist])
  results[name] = out
  if name == "fsdp8":
    results["_fsdp8_state"] = state


def case_pmap(ref_params, ref_hist, results):
  apply_fn, params, optimizer, config, batch = S.build()
  step = make_pmap_train_step(apply_fn, optimizer, config)
  state = replicate(init_train_state(params, optimizer, config))
  local = split_batch(batch)
  before = _shardings(state)
  hist, same_layout = [], []
  for _ in range(S.STEPS):
    state, metrics = step(state, local)
    same_layout.append(_shardings(state) == before)
    hist.append({k: float(np.asarray(x)[0]) for k, x in metrics.items()})
  results["pmap"] = dict(
      param_diff=S.max_abs_diff(S.flat_params(jax.tree_util.tree_map(
          lambda x: np.asarray(x)[0], state.params)), ref_params),
      metric_diff=max(abs(h[k] - r[k]) for h, r in zip(hist, ref_hist) for k in r),
      devices=int(jax.tree_util.tree_leaves(state.params)[0].shape[0]),
      same_layout=all(same_layout),
      metrics_identical_across_devices=bool(all(
          np.all(np.asarray(x) == np.asarray(x)[0]) for x in metrics.values())))


def case_sequence_gae(results):
  rng = np.random.default_rng(1)
  b, t = 6, 64
  out = {}
  # (mesh, batch axes, method, per-token gamma): each combination is one compilation.
  combos = (("seq8", dict(data=1, sequence=8), None, "scan", False),
            ("seq8", dict(data=1, sequence=8), None, "associative", False),
            ("seq8", dict(data=1, sequence=8), None, "scan", True),
            ("data2_seq4", dict(data=2, sequence=4), "data", "associative", True))
  for mesh_name, sizes, batch_axes, method, per_token in combos:
    mesh = make_mesh(**sizes)
    fn = jax.jit(lambda r, v, m, g, l, bt, method=method, mesh=mesh, axes=batch_axes:
                 sequence_parallel_gae(r, v, m, mesh=mesh, gamma=g, lam=l,
                                       bootstrap_value=bt, batch_axes=axes,
                                       method=method))
    for trial in range(2):
      r = rng.normal(size=(b, t)).astype(np.float32)
      val = rng.normal(size=(b, t)).astype(np.float32)
      mask = random_mask(rng, b, t, p_hole=0.3)
      mask[0] = 0.0
      mask[0, -1] = 1.0          # a row whose only valid token is the last one
      mask[1] = 0.0
      mask[1, 0] = 1.0           # ... and one whose only valid token is the first
      boot = rng.normal(size=b).astype(np.float32)
      gamma = (rng.uniform(0.8, 1.0, (b, t)).astype(np.float32) if per_token
               else np.float32(rng.uniform(0.9, 1.0)))
      lam = np.float32(rng.uniform(0.0, 1.0))   # new coefficient values: no recompile
      adv, ret = fn(r, val, mask, gamma, lam, boot)
      adv0, ret0 = gae(r, val, mask, gamma=gamma, lam=lam, bootstrap_value=boot)
      key = f"{mesh_name}/{method}/{'per_token' if per_token else 'scalar'}/{trial}"
      out[key] = dict(
          diff=float(max(np.abs(adv - adv0).max(), np.abs(ret - ret0).max())),
          masked_zero=bool(np.all(np.asarray(adv)[mask == 0] == 0)),
          spec=str(adv.sharding.spec), cache_size=fn._cache_size())
  results["sequence_gae"] = out


def case_sequence_logprobs(results):
  rng = np.random.default_rng(2)
  b, t, d, v = 4, 32, 16, 40
  hidden = rng.normal(size=(b, t, d)).astype(np.float32)
  head = (0.3 * rng.normal(size=(d, v))).astype(np.float32)
  targets = rng.integers(0, v, (b, t)).astype(np.int32)
  mask = random_mask(rng, b, t)
  weights = rng.normal(size=(b, t)).astype(np.float32)

  def value_and_grads(fn):
    def loss(h, w, temp):
      logp, ent = fn(h, w, temp)
      return jnp.sum(logp * weights) + 0.3 * jnp.sum(ent), (logp, ent)
    (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True))(hidden, head, jnp.float32(1.3))
    return logp, ent, grads

  ref = value_and_grads(lambda h, w, temp: token_logprobs_from_hidden(
      h, w, targets, mask=mask, chunk_size=3, return_entropy=True, temperature=temp))
  out = {}
  for name, sizes, batch_axes in (("seq8", dict(data=1, sequence=8), None),
                                  ("data2_seq4", dict(data=2, sequence=4), "data"),
                                  ("fsdp2_seq4", dict(data=1, fsdp=2, sequence=4), None)):
    mesh = make_mesh(**sizes)
    got = value_and_grads(lambda h, w, temp, mesh=mesh, batch_axes=batch_axes:
                          sequence_parallel_token_logprobs(
                              h, w, targets, mesh=mesh, mask=mask, batch_axes=batch_axes,
                              chunk_size=3, return_entropy=True, temperature=temp))
    out[name] = dict(
        logp_diff=float(np.abs(got[0] - ref[0]).max()),
        entropy_diff=float(np.abs(got[1] - ref[1]).max()),
        grad_hidden_diff=float(np.abs(got[2][0] - ref[2][0]).max()),
        grad_head_diff=float(np.abs(got[2][1] - ref[2][1]).max()),
        grad_head_scale=float(np.abs(ref[2][1]).max()),
        grad_temp_diff=float(abs(got[2][2] - ref[2][2])),
        grad_temp_scale=float(abs(ref[2][2])),
        spec=str(got[0].sharding.spec))
  results["sequence_logprobs"] = out


def case_nondividing(results):
  apply_fn, params, optimizer, config, _batch = S.build()
  state = init_train_state(params, optimizer, config)
  try:
    shard_train_step(make_train_step(apply_fn, optimizer, config), state,
                     make_mesh(data=1, tensor=8))
    results["nondividing"] = dict(raised=None)
  except ValueError as e:
    results["nondividing"] = dict(raised=str(e))


def case_checkpoint(results, directory):
  from jaxrl_llm.checkpoint import Checkpointer
  state = results.pop("_fsdp8_state")
  expected = gather_to_host(state)
  new_mesh = make_mesh(data=2, fsdp=2, tensor=2)
  new_shardings = state_shardings(state, new_mesh)
  template = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
      new_shardings)
  with Checkpointer(directory) as ckpt:
    ckpt.save(int(state.step), state, extra={"mesh": "fsdp8"})
    restored, extra = ckpt.restore(template)
  got = gather_to_host(restored)
  equal = all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(got),
                                                   jax.tree_util.tree_leaves(expected)))
  results["checkpoint"] = dict(
      values_equal=equal, extra=extra,
      shardings_new=_shardings(restored) == jax.tree_util.tree_leaves(new_shardings),
      saved_spec=sharding_summary(state)[".params['embed'].value"],
      restored_spec=sharding_summary(restored)[".params['embed'].value"],
      restored_wq_spec=sharding_summary(restored)[
          ".params['blocks'][0]['attn']['wq'].value"],
      restored_momentum_wq_spec=sharding_summary(restored)[
          ".opt_state[0].trace['blocks'][0]['attn']['wq'].value"])


def run(out_path, ckpt_dir):
  results = {"device_count": jax.device_count(), "errors": {}, "seconds": {}}

  def guarded(name, fn, *args):
    start = time.perf_counter()
    try:
      fn(*args)
    except Exception:  # recorded for the test to show
      results["errors"][name] = traceback.format_exc()
    results["seconds"][name] = round(time.perf_counter() - start, 2)

  ref = {}
  guarded("reference", lambda: ref.update(zip(("params", "hist"), S.reference_run())))
  for name, (sizes, constrained) in LAYOUTS.items():
    guarded(name, case_layout, name, sizes, constrained, ref.get("params"),
            ref.get("hist"), results)
  guarded("pmap", case_pmap, ref.get("params"), ref.get("hist"), results)
  guarded("sequence_gae", case_sequence_gae, results)
  guarded("sequence_logprobs", case_sequence_logprobs, results)
  guarded("nondividing", case_nondividing, results)
  guarded("checkpoint", case_checkpoint, results, ckpt_dir)
  results.pop("_fsdp8_state", None)
  results["reference_loss"] = [h["loss"] for h in ref.get("hist", [])]
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
