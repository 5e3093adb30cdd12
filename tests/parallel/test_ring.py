"""Ring attention and the sequence-sharded PPO step (jaxrl_llm.parallel.ring).

* In this process (any device count): argument checks against ``AbstractMesh`` es, the
  one-device ring (a mesh whose ``sequence`` axis has size 1) against a NumPy
  reference, and the ``"ring"`` registration.
* On 8 forced CPU devices: ``tests/ring_worker.py`` runs every multi-device case in one
  subprocess and writes JSON; the tests below assert on it.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from jaxrl_llm.attention import ATTENTION_IMPLEMENTATIONS, dot_product_attention
from jaxrl_llm.parallel import MESH_AXES, make_mesh, ring_attention, ring_dot_product_attention
from jaxrl_llm.parallel.ring import _LAYOUTS, LAYOUTS, _case
from tests import ring_setup as R
from tests.utils import assert_close, run_worker


def _mesh(sequence=8, data=1, tensor=1):
  return AbstractMesh((data, 1, tensor, sequence), MESH_AXES)


# ------------------------------------------------------------------- in this process


def test_ring_is_registered_on_import():
  assert ATTENTION_IMPLEMENTATIONS["ring"] is ring_dot_product_attention


@pytest.mark.parametrize("causal", [True, False])
def test_one_device_ring_matches_numpy(causal):
  q, k, val, mask, _ = R.attention_inputs(seed=3)
  mesh = make_mesh(data=1, sequence=-1, devices=jax.devices()[:1])
  got = jax.jit(lambda *a: ring_attention(*a[:3], mesh=mesh, key_mask=a[3],
                                          is_causal=causal))(q, k, val, mask)
  assert_close(got, R.numpy_attention(q, k, val, mask, causal), atol=2e-5)
  assert np.all(np.asarray(got)[R.EMPTY_ROW] == 0)


def test_ring_implementation_without_ambient_mesh_is_plain_attention():
  q, k, val, mask, _ = R.attention_inputs(seed=4)
  got = dot_product_attention(q, k, val, key_mask=mask, implementation="ring")
  assert_close(got, R.numpy_attention(q, k, val, mask, True), atol=2e-5)


def test_bf16_inputs_give_bf16_outputs():
  q, k, val, mask, _ = R.attention_inputs(seed=5)
  mesh = make_mesh(data=1, sequence=-1, devices=jax.devices()[:1])
  got = ring_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, val)),
                       mesh=mesh, key_mask=mask)
  assert got.dtype == jnp.bfloat16
  assert_close(got, R.numpy_attention(q, k, val, mask, True), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("shapes,kwargs,match", [
    (((2, 12, 4, 8), (2, 12, 2, 8)), {}, r"`query` has shape \(2, 12, 4, 8\): its "
     r"sequence dimension 12 is not divisible by mesh axis 'sequence' of size 8"),
    (((2, 16, 3, 8), (2, 16, 2, 8)), {}, r"`query` has 3 heads .* not a multiple of the "
     r"2 heads of `key`"),
    (((2, 16, 4, 8), (2, 8, 2, 8)), {}, r"`key` must have shape \(2, 16, K, 8\)"),
    (((2, 16, 4, 8), (2, 16, 2, 8)), {"key_mask": (2, 8)},
     r"`key_mask` must have shape \(2, 16\).*got \(2, 8\)"),
    (((2, 16, 4, 8), (2, 16, 2, 8)), {"axis": "context"},
     r"`axis` 'context' is not an axis of the mesh"),
    (((2, 16, 4), (2, 16, 2, 8)), {}, r"`query` must have rank 4"),
    (((2, 16, 4, 8), (2, 16, 2, 8)), {"layout": "striped"},
     r"`layout` must be one of \['contiguous', 'zigzag'\], got 'striped'"),
])
def test_bad_input_raises_naming_argument_and_shapes(shapes, kwargs, match):
  q_shape, k_shape = shapes
  if "key_mask" in kwargs:
    kwargs = dict(kwargs, key_mask=jnp.ones(kwargs["key_mask"]))
  with pytest.raises(ValueError, match=match):
    ring_attention(jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(k_shape),
                   mesh=_mesh(8), **kwargs)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_causal_branch_table_is_exact_and_zigzag_balances_work(layout, n):
  """Pure Python over the branch rule: in half-chunks of ``2n`` (global ids), every
  causally visible (query, key) pair is computed exactly once over the ring, a
  non-causal branch only pairs keys strictly before queries, and the work per device,
  in ``[T/n, T/n]`` blocks, is ``i + 1`` (contiguous) or ``1 + (n - 1) / 2`` on every
  device (zig-zag)."""
  branches, chunks = _LAYOUTS[layout].branches, _LAYOUTS[layout].chunks
  covered, work = Counter(), []
  for i in range(n):
    blocks = 0.0
    for s in range(n):
      j = (i - s) % n
      part = branches[int(_case(s, i, branches))]
      assert (part is not None and part.causal) == (s == 0)
      if part is None:
        continue
      queries = chunks(n, i)[slice(*part.q)]
      keys = chunks(n, j)[slice(*part.k)]
      blocks += len(queries) * len(keys) / 4
      for qc in queries:
        for kc in keys:
          assert part.causal or kc < qc, (i, s, qc, kc)
          if kc <= qc:        # on the diagonal (causal, local order = global) pairs
            covered[qc, kc] += 1   # with kc > qc are masked away inside the block
    work.append(blocks)
  assert covered == Counter({(qc, kc): 1 for qc in range(2 * n) for kc in range(qc + 1)})
  if layout == "contiguous":
    assert work == [i + 1 for i in range(n)]
  else:
    assert work == [1 + (n - 1) / 2] * n


# ------------------------------------------------------------------ 8 forced devices


def on_8_devices(test):
  """The tests sharing the ``multi`` worker run: kept on one xdist worker, so the
  8-device subprocess runs once per test session."""
  return pytest.mark.slow(pytest.mark.xdist_group("ring_worker_8_devices")(test))


@pytest.fixture(scope="module")
def multi():
  """Runs tests/ring_worker.py once on 8 forced CPU devices; returns its JSON."""
  return run_worker("ring_worker")


def _no_error(multi, case):
  assert case not in multi["errors"], multi["errors"][case]


@on_8_devices
@pytest.mark.parametrize("mesh, kind", R.RING_CASES)
def test_ring_equals_single_device_attention(multi, mesh, kind):
  """``causal``: the default zig-zag layout; ``causal_contiguous``: layout="contiguous"."""
  _no_error(multi, "ring")
  r = multi["ring"][f"{mesh}/{kind}"]
  assert r["value_diff"] < 2e-5 and r["value_diff_new_inputs"] < 2e-5, r
  assert r["grad_diff"] < 2e-5 * max(1.0, r["grad_scale"]), r
  assert r["empty_row_zero"] and r["finite"], r
  assert r["cache_size"] == 1, r            # new values, same shapes: no recompile
  assert "'sequence'" in r["spec"], r       # the output stays split over the tokens


@on_8_devices
@pytest.mark.parametrize("mesh", R.KIND_MESHES["causal_contiguous"])
def test_zigzag_equals_contiguous(multi, mesh):
  _no_error(multi, "ring")
  r = multi["ring"][f"{mesh}/causal"]
  assert r["layout_diff"] < 2e-5 * max(1.0, r["grad_scale"]), r


@on_8_devices
def test_zigzag_falls_back_to_contiguous_when_2n_does_not_divide_t(multi):
  _no_error(multi, "fallback")
  assert multi["fallback"]["value_diff"] < 2e-5, multi["fallback"]


@on_8_devices
def test_ambient_sequence_mesh_selects_ring(multi):
  _no_error(multi, "auto")
  assert multi["auto"]["value_diff"] < 2e-5
  assert multi["auto"]["collective_permutes"] > 0


@on_8_devices
def test_sequence_not_divisible_raises_on_a_real_mesh(multi):
  _no_error(multi, "nondividing")
  raised = multi["nondividing"]["raised"]
  assert raised is not None and "(4, 60, 4, 8)" in raised and "size 8" in raised


@pytest.mark.parametrize("mesh,spec", [("seq8", "P(None, 'sequence')"),
                                       ("data2_seq4", "P('data', 'sequence')")])
@on_8_devices
def test_sequence_sharded_ppo_step_equals_single_device(multi, mesh, spec):
  _no_error(multi, "ppo")
  r = multi["ppo"][mesh]
  assert r["ring_calls"] > 0, r             # the model's attention ran as ring attention
  assert r["batch_spec"] == spec
  assert r["param_diff"] < 1e-5, r
  assert r["metric_diff"] < 1e-4, r
  assert r["skipped"] == 0 and r["cache_size"] == 1, r
  assert {"loss", "vf_loss", "explained_variance", "adv_std"} <= set(r["metric_keys"])
