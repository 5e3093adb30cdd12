"""Ring-attention and sequence-sharded PPO checks on 8 forced CPU devices.

``python -m tests.ring_worker OUT.json`` runs every case in one process (jax imported
once, with ``XLA_FLAGS`` forcing 8 CPU devices) and writes the measurements as JSON;
``tests/parallel/test_ring.py`` asserts on them. Each case records its own traceback on failure.
"""

from __future__ import annotations

from tests._devices import force_host_devices

force_host_devices(8)    # before jax is imported; the caller's other XLA flags kept

import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

# Compile fast on a 2-core box: changes float rounding only (tolerances are 1e-5).
jax.config.update("jax_disable_most_optimizations", True)

from jaxrl_llm.attention import attention_with_lse, dot_product_attention, register_attention
from jaxrl_llm.parallel import (
  gather_to_host,
  make_mesh,
  ring_attention,
  ring_dot_product_attention,
  shard_batch,
)
from jaxrl_llm.train import init_train_state, make_train_step, shard_apply_fn, shard_train_step
from tests import ring_setup as R


def _max_diff(a, b):
  return float(max(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                   for x, y in zip(jax.tree_util.tree_leaves(a),
                                   jax.tree_util.tree_leaves(b))))


def case_ring(results):
  """ring_attention == single-device attention: values (vs NumPy) and gradients, in
  both layouts; ``layout_diff``: zig-zag against contiguous (values and gradients)."""
  q, k, val, mask, weights = R.attention_inputs(seed=0)

  def loss(fn, q_, k_, v_, mask_):
    return jnp.sum(fn(q_, k_, v_, mask_) * weights)

  def reference(causal):      # NumPy values, single-device gradients
    single = lambda q_, k_, v_, m_: attention_with_lse(
        q_, k_, v_, key_mask=m_, is_causal=causal, implementation="xla")[0]
    grads = jax.jit(jax.grad(lambda *a: loss(single, *a), argnums=(0, 1, 2)))(
        q, k, val, mask)
    return R.numpy_attention(q, k, val, mask, causal), grads

  references = {causal: reference(causal) for causal in (True, False)}
  out, layouts = {}, {}
  for kind, (causal, layout) in R.KINDS.items():
    expected, ref_grads = references[causal]
    for name in R.KIND_MESHES[kind]:
      mesh = make_mesh(**R.MESHES[name])
      ring = lambda q_, k_, v_, m_, c=causal, mesh=mesh, lay=layout: ring_attention(
          q_, k_, v_, mesh=mesh, key_mask=m_, is_causal=c, layout=lay)
      fwd = jax.jit(ring)
      got = fwd(q, k, val, mask)
      grads = jax.jit(jax.grad(lambda *a, ring=ring: loss(ring, *a), argnums=(0, 1, 2)))(
          q, k, val, mask)
      # New values, same shapes: no recompilation.
      q2, k2, v2, mask2, _ = R.attention_inputs(seed=1)
      got2 = fwd(q2, k2, v2, mask2)
      layouts[name, kind] = (got, grads)
      out[f"{name}/{kind}"] = dict(
          value_diff=_max_diff(got, expected),
          value_diff_new_inputs=_max_diff(got2, R.numpy_attention(q2, k2, v2, mask2,
                                                                  causal)),
          grad_diff=_max_diff(grads, ref_grads),
          grad_scale=float(max(np.abs(g).max() for g in ref_grads)),
          empty_row_zero=bool(np.all(np.asarray(got)[R.EMPTY_ROW] == 0)),
          finite=bool(all(np.all(np.isfinite(g)) for g in grads)),
          cache_size=fwd._cache_size(), spec=str(got.sharding.spec))
  for name in R.KIND_MESHES["causal_contiguous"]:
    out[f"{name}/causal"]["layout_diff"] = _max_diff(layouts[name, "causal"],
                                                     layouts[name, "causal_contiguous"])
  results["ring"] = out


def case_fallback(results):
  """T = 56 on sequence=8: 56 % 16 != 0, so the zig-zag default runs contiguous."""
  q, k, val, mask, _ = (x[:, :56] for x in R.attention_inputs(seed=0))
  got = jax.jit(lambda *a: ring_attention(*a[:3], mesh=make_mesh(data=1, sequence=8),
                                          key_mask=a[3]))(q, k, val, mask)
  results["fallback"] = dict(value_diff=_max_diff(got, R.numpy_attention(q, k, val, mask,
                                                                         True)))


def case_auto(results):
  """dot_product_attention(implementation=None) under an ambient sequence mesh = ring."""
  q, k, val, mask, _ = R.attention_inputs(seed=2)
  mesh = make_mesh(data=1, sequence=8)
  fn = jax.jit(lambda q_, k_, v_, m_: dot_product_attention(q_, k_, v_, key_mask=m_))
  with jax.set_mesh(mesh):
    hlo = fn.lower(q, k, val, mask).compile().as_text()
    got = fn(q, k, val, mask)
  results["auto"] = dict(
      value_diff=_max_diff(got, R.numpy_attention(q, k, val, mask, True)),
      collective_permutes=hlo.count("collective-permute"))


def case_nondividing(results):
  q, k, val, mask, _ = R.attention_inputs(seed=0)
  try:
    ring_attention(q[:, :60], k[:, :60], val[:, :60], mesh=make_mesh(data=1, sequence=8),
                   key_mask=mask[:, :60])
    results["nondividing"] = dict(raised=None)
  except ValueError as e:
    results["nondividing"] = dict(raised=str(e))


def case_ppo(results):
  """A sequence-sharded PPO step equals the single-device step."""
  ref_params, ref_hist = R.reference_run()
  calls = []

  def counting_ring(*args, **kwargs):   # counts traces of the model's ring attention
    calls.append(1)
    return ring_dot_product_attention(*args, **kwargs)

  register_attention("ring", counting_ring)
  out = {}
  for name in ("seq8", "data2_seq4"):
    calls.clear()
    apply_fn, params, optimizer, config, batch = R.build()
    mesh = make_mesh(**R.MESHES[name])
    step, state = shard_train_step(
        make_train_step(shard_apply_fn(apply_fn, mesh), optimizer, config),
        init_train_state(params, optimizer, config), mesh, batch=batch)
    placed = shard_batch(batch, mesh)
    hlo = step.lower(state, placed).compile().as_text()
    hist = []
    for _ in range(R.STEPS):
      state, metrics = step(state, placed)
      hist.append({k: float(x) for k, x in metrics.items()})
    out[name] = dict(
        param_diff=R.max_abs_diff(R.flat_params(gather_to_host(state.params)),
                                  ref_params),
        metric_diff=max(abs(h[k] - r[k]) for h, r in zip(hist, ref_hist) for k in r),
        metric_keys=sorted(ref_hist[0]),
        collective_permutes=hlo.count("collective-permute"),
        batch_spec=str(placed["tokens"].sharding.spec),
        skipped=sum(h["skipped"] for h in hist), loss=[h["loss"] for h in hist],
        cache_size=step._cache_size(), ring_calls=len(calls))
  register_attention("ring", ring_dot_product_attention)
  out["reference_loss"] = [h["loss"] for h in ref_hist]
  results["ppo"] = out


def run(out_path):
  results = {"device_count": jax.device_count(), "errors": {}, "seconds": {}}
  for name, fn in (("ring", case_ring), ("auto", case_auto),
                   ("nondividing", case_nondividing), ("fallback", case_fallback),
                   ("ppo", case_ppo)):
    start = time.perf_counter()
    try:
      fn(results)
    except Exception:  # recorded for the test to show
      results["errors"][name] = traceback.format_exc()
    results["seconds"][name] = round(time.perf_counter() - start, 2)
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  run(sys.argv[1])
