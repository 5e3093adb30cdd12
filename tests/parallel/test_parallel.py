"""jaxrl_llm.parallel: meshes, sharding rules, sharded / pmap steps, sequence parallelism.

Two kinds of tests:

* In this process (one CPU device): rules and specs against ``AbstractMesh`` es of any
  shape, error messages, and the sequence-parallel GAE algorithm itself, whose
  cross-device combination runs under ``jax.vmap(..., axis_name=...)`` (the same
  ``all_gather`` / ``axis_index`` code that ``shard_map`` runs).
* On 8 forced CPU devices: ``tests/parallel_worker.py`` runs every multi-device case in
  one subprocess (``XLA_FLAGS`` must be set before jax is imported, so it cannot run
  here) and writes JSON; the tests below assert on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxrl_llm.advantages import gae
from jaxrl_llm.logprobs import token_logprobs_from_hidden
from jaxrl_llm.models.transformer import Transformer, split_model
from jaxrl_llm.parallel import (
  DEFAULT_RULES,
  MESH_AXES,
  batch_specs,
  host_local_batch,
  initialize_multihost,
  logical_to_spec,
  make_mesh,
  make_rules,
  param_specs,
  replicate,
  resolve_multihost_args,
  sequence_parallel_gae,
  sequence_parallel_token_logprobs,
  shard_batch,
  split_batch,
  state_specs,
  unreplicate,
)
from jaxrl_llm.parallel.sequence import _gae_shard
from jaxrl_llm.train import TrainConfig, init_train_state, shard_apply_fn
from tests import parallel_setup as S
from tests.utils import assert_close, assert_no_recompile, random_mask, run_worker


def abstract_mesh(data=1, fsdp=1, tensor=1, sequence=1):
  return AbstractMesh((data, fsdp, tensor, sequence), MESH_AXES)


@functools.cache
def _params():
  """Abstract parameters (shapes, dtypes and logical names; no computation)."""
  model = nnx.eval_shape(lambda: Transformer(S.model_config(), rngs=nnx.Rngs(0)))
  return split_model(model)[1]


def _pure(specs):
  return nnx.to_pure_dict(specs)


def _devices(*sizes):
  """The first ``n`` devices, ``n`` the largest of ``sizes`` this host has.

  The suite runs on 1 device and on 8 (a GPU box, a TPU VM, or forced CPU devices):
  a test that needs a mesh dividing its small shapes builds it from this subset, and
  exercises a real multi-device mesh whenever the host has one.
  """
  n = max(size for size in sizes if size <= jax.device_count())
  return jax.devices()[:n]


# ------------------------------------------------------------------------------- mesh


def test_make_mesh_axes_and_free_axis():
  n = jax.device_count()
  mesh = make_mesh()              # data=-1: every device on the data axis
  assert mesh.axis_names == ("data", "fsdp", "tensor", "sequence")
  assert dict(mesh.shape) == {"data": n, "fsdp": 1, "tensor": 1, "sequence": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
  mesh = make_mesh(devices=jax.devices()[:1])
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1}
  assert list(mesh.devices.flat) == jax.devices()[:1]
  mesh = make_mesh(data=1, fsdp=-1, devices=jax.devices())
  assert dict(mesh.shape)["fsdp"] == n
  # A given device list is reshaped in order: (data, fsdp, tensor, sequence).
  devices = jax.devices() * 4 if n == 1 else jax.devices()[:4]
  mesh = make_mesh(data=2, fsdp=-1, devices=devices)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 1, "sequence": 1}
  assert list(mesh.devices.flat) == devices


def test_make_mesh_rejects_sizes_that_do_not_multiply_to_device_count():
  n = jax.device_count()
  with pytest.raises(ValueError, match=f"multiply to {2 * n} but there are {n} devices"):
    make_mesh(data=2 * n)
  with pytest.raises(ValueError, match="multiply to 2 but there are 1 devices"):
    make_mesh(data=2, devices=jax.devices()[:1])
  with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
    make_mesh(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="tensor"):
    make_mesh(tensor=0)
  with pytest.raises(ValueError, match="does not divide"):
    make_mesh(data=-1, tensor=3, devices=jax.devices() * 4)


# ------------------------------------------------------------------------------ rules


def test_rules_table_and_overrides():
  rules = make_rules()
  assert rules["embed"] == ("fsdp",) and rules["batch"] == ("data", "fsdp")
  assert rules["head_dim"] == ()
  assert set(DEFAULT_RULES) <= set(rules)
  custom = make_rules({"embed": None, "mlp": ("fsdp", "tensor")})
  assert custom["embed"] == () and custom["mlp"] == ("fsdp", "tensor")
  assert make_rules([("vocab", None)])["vocab"] == ()
  with pytest.raises(ValueError, match="embed"):
    make_rules({"embed": 3})


def test_logical_to_spec_maps_names_and_drops_size_one_axes():
  mesh = abstract_mesh(data=2, fsdp=2, tensor=2)
  assert logical_to_spec(("vocab", "embed"), (32, 64), mesh) == P("tensor", "fsdp")
  assert logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh) == P(
      "fsdp", "tensor", None)
  assert logical_to_spec(("batch", "sequence"), (8, 12), mesh) == P(("data", "fsdp"),
                                                                    None)
  only_data = abstract_mesh(data=8)
  assert logical_to_spec(("vocab", "embed"), (30, 7), only_data) == P(None, None)
  assert logical_to_spec(("batch",), (8,), only_data) == P("data")
  # A foreign mesh without the library's other axes: they count as size 1.
  foreign = AbstractMesh((4,), ("data",))
  assert logical_to_spec(("batch", "embed"), (8, 6), foreign) == P("data", None)


@pytest.mark.parametrize("names,shape,rules,match", [
    (("vocab", "embed"), (30, 64), None, r"dimension 0 \('vocab', size 30\) is not "
                                         r"divisible by mesh axis 'tensor' of size 4"),
    (("embed", "mlp"), (63, 64), None, r"dimension 0 \('embed', size 63\).*'fsdp' of "
                                       r"size 2"),
    (("batch",), (6,), None, r"dimension 0 \('batch', size 6\).*\('fsdp', 'tensor'\) "
                             "of size 8"),
    (("embed", "mystery"), (64, 4), None, "logical axis 'mystery'"),
    (("embed",), (64, 4), None, "1 logical axis names"),
    (("embed", "mlp"), (64, 64), {"embed": "tensor"}, "mesh axis 'tensor' is used by"),
    (("embed",), (64,), {"embed": "model"}, "'model' names a mesh axis that is not in"),
])
def test_logical_to_spec_errors_name_the_array_dimension_and_axis(names, shape, rules,
                                                                  match):
  mesh = abstract_mesh(fsdp=2, tensor=4)
  rules = make_rules({"batch": ("fsdp", "tensor"), **(rules or {})})
  with pytest.raises(ValueError, match=match) as info:
    logical_to_spec(names, shape, mesh, rules, where="parameter 'w'")
  assert "parameter 'w'" in str(info.value)


def test_param_specs_of_the_reference_transformer():
  specs = _pure(param_specs(_params(), abstract_mesh(data=2, fsdp=2, tensor=2)))
  attn, mlp = specs["blocks"][0]["attn"], specs["blocks"][0]["mlp"]
  assert specs["embed"] == P("tensor", "fsdp")
  assert attn["wq"] == P("fsdp", "tensor", None)
  assert attn["wk"] == P("fsdp", "tensor", None)
  assert attn["wo"] == P("tensor", None, "fsdp")
  assert mlp["w_gate"] == P("fsdp", "tensor") and mlp["w_down"] == P("tensor", "fsdp")
  assert specs["final_norm"]["scale"] == P("fsdp")
  assert specs["value_w"] == P("fsdp", None) and specs["value_b"] == P(None)
  # Overriding a rule changes only the dimensions with that logical name.
  no_fsdp = _pure(param_specs(_params(), abstract_mesh(data=2, fsdp=2, tensor=2),
                              {"embed": None}))
  assert no_fsdp["embed"] == P("tensor", None)
  assert no_fsdp["blocks"][0]["attn"]["wq"] == P(None, "tensor", None)


def test_param_specs_non_dividing_dimension_names_param_dim_and_axis():
  # kv_heads = 2 cannot be split over tensor = 8.
  with pytest.raises(ValueError, match=r"\['blocks'\]\[0\]\['attn'\]\['wk'\].*dimension "
                                       r"1 \('kv_heads', size 2\).*'tensor' of size 8"):
    param_specs(_params(), abstract_mesh(tensor=8))
  # d_model = 32 cannot be split over fsdp = 64.
  with pytest.raises(ValueError, match=r"dimension \d \('embed', size 32\).*'fsdp' of "
                                       "size 64"):
    param_specs(_params(), abstract_mesh(fsdp=64))


def test_param_specs_with_explicit_logical_specs_for_plain_pytrees():
  params = {"w": np.zeros((8, 4)), "b": np.zeros((4,))}
  logical = {"w": ("embed", "mlp"), "b": None}
  specs = param_specs(params, abstract_mesh(fsdp=2, tensor=4), logical_specs=logical)
  assert specs == {"w": P("fsdp", "tensor"), "b": P()}


@pytest.mark.parametrize("optimizer,moments", [(optax.sgd(0.1, momentum=0.9), 1),
                                               (optax.adamw(1e-3), 2)])
def test_state_specs_optimizer_moments_follow_params(optimizer, moments):
  mesh = abstract_mesh(data=2, fsdp=2, tensor=2)
  state = jax.eval_shape(lambda p: init_train_state(p, optimizer, TrainConfig()),
                         _params())
  specs = state_specs(state, mesh)
  is_spec = lambda x: isinstance(x, P)
  flat = {jax.tree_util.keystr(path): s for path, s in
          jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]}
  wq_moments = [s for k, s in flat.items() if k.startswith(".opt_state") and "'wq'" in k]
  assert wq_moments == [P("fsdp", "tensor", None)] * moments
  embed_moments = [s for k, s in flat.items()
                   if k.startswith(".opt_state") and "['embed']" in k]
  assert embed_moments == [P("tensor", "fsdp")] * moments
  assert jax.tree_util.tree_leaves(specs.params, is_leaf=is_spec) == \
      jax.tree_util.tree_leaves(param_specs(_params(), mesh), is_leaf=is_spec)
  # Everything that is not parameter-shaped is replicated.
  others = [s for k, s in flat.items() if not k.startswith((".params", ".opt_state"))]
  others += [s for k, s in flat.items() if "count" in k]
  assert others and all(s == P() for s in others)


def test_batch_specs_rows_tokens_and_errors():
  batch = {"tokens": np.zeros((8, 12), np.int32), "advantages": np.zeros((8,)),
           "extra": np.zeros((8, 12, 3))}
  specs = batch_specs(batch, abstract_mesh(data=2, fsdp=2, sequence=2))
  assert specs == {"tokens": P(("data", "fsdp"), "sequence"),
                   "advantages": P(("data", "fsdp")),
                   "extra": P(("data", "fsdp"), "sequence", None)}
  with pytest.raises(ValueError, match=r"batch\['tokens'\]: dimension 0 \('batch', "
                                       r"size 8\).*of size 16"):
    batch_specs({"tokens": np.zeros((8, 12))}, abstract_mesh(data=4, fsdp=4))
  with pytest.raises(ValueError, match=r"batch\['old_logp'\]: dimension 1 \('sequence'"):
    batch_specs({"old_logp": np.zeros((8, 12))}, abstract_mesh(sequence=8))


@pytest.mark.parametrize("n_devices", [1, 2])
def test_shard_batch_and_host_local_batch_single_process(n_devices):
  if jax.device_count() < n_devices:
    pytest.skip(f"needs {n_devices} devices (run with XLA_FLAGS="
                "--xla_force_host_platform_device_count=8)")
  mesh = make_mesh(devices=jax.devices()[:n_devices])
  batch = S.make_batch()
  assert all(np.array_equal(a, b) for a, b in zip(
      jax.tree_util.tree_leaves(host_local_batch(batch, mesh)),
      jax.tree_util.tree_leaves(batch)))
  placed = shard_batch(batch, mesh)
  for key, x in placed.items():
    assert isinstance(x, jax.Array) and x.shape == batch[key].shape
    np.testing.assert_array_equal(np.asarray(x), batch[key])
  expected = P(None, None) if n_devices == 1 else P("data", None)
  assert placed["tokens"].sharding.spec == expected
  assert {s.data.shape for s in placed["tokens"].addressable_shards} == {
      (S.B // n_devices, S.L)}


def test_shard_apply_fn_keeps_values_and_checks_microbatch_rows():
  from jaxrl_llm.models.transformer import make_apply_fn
  graphdef, params = split_model(Transformer(S.model_config(), rngs=nnx.Rngs(0)))
  apply_fn = make_apply_fn(graphdef)
  tokens = np.arange(24, dtype=np.int32).reshape(2, 12) % S.V
  mask = np.ones((2, 12), np.float32)
  expected = jax.jit(apply_fn)(params, tokens, None, mask)
  for devices in {len(d): d for d in (_devices(1), _devices(1, 2))}.values():
    # The 2 rows split over the data axis when the host has 2 devices.
    wrapped = shard_apply_fn(apply_fn, make_mesh(devices=devices))
    got = jax.jit(wrapped)(params, tokens, None, mask)
    tol = 0 if len(devices) == 1 else 1e-6   # another reduction order: rounding only
    assert_close(got, expected, atol=tol, rtol=tol)
  # 2 rows cannot be split over data * fsdp = 4 devices: named at trace time.
  bad = shard_apply_fn(apply_fn, abstract_mesh(data=2, fsdp=2))
  with pytest.raises(ValueError, match=r"model tokens: dimension 0 \('batch', size 2\)"):
    jax.eval_shape(bad, params, tokens, None, mask)


def test_pmap_helpers_split_replicate_unreplicate():
  batch = {"tokens": np.arange(12).reshape(6, 2), "advantages": np.arange(6.0)}
  split = split_batch(batch, 3)
  assert split["tokens"].shape == (3, 2, 2) and split["advantages"].shape == (3, 2)
  np.testing.assert_array_equal(split["tokens"][1], batch["tokens"][2:4])
  with pytest.raises(ValueError, match=r"batch\['advantages'\].*divisible by the 4"):
    split_batch(batch, 4)
  tree = {"w": jnp.arange(3.0), "step": jnp.int32(5)}
  rep = replicate(tree)
  assert rep["w"].shape == (jax.local_device_count(), 3)
  assert_close(unreplicate(rep), tree, atol=0, rtol=0)


# ------------------------------------------------------------------------ multi-host


def test_initialize_multihost_single_process_is_a_noop():
  assert initialize_multihost() is False
  assert initialize_multihost(num_processes=1) is False
  assert initialize_multihost("127.0.0.1:1", num_processes=1, process_id=0) is False
  assert jax.process_count() == 1


def test_resolve_multihost_args_reads_environment():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "2", "JAXRL_LOCAL_DEVICE_IDS": "0,1"}
  args = resolve_multihost_args(environ=env)
  assert args == dict(coordinator_address="10.0.0.1:1234", num_processes=4,
                      process_id=2, local_device_ids=[0, 1])
  # JAXRL_* wins over JAX_*; explicit arguments win over both.
  env["JAXRL_COORDINATOR"] = "head:99"
  assert resolve_multihost_args(environ=env)["coordinator_address"] == "head:99"
  assert resolve_multihost_args(process_id=0, environ=env)["process_id"] == 0
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
    resolve_multihost_args(environ={"JAX_NUM_PROCESSES": "four"})


def test_initialize_multihost_coordinator_needs_rank_and_size(monkeypatch):
  for name in ("JAXRL_NUM_PROCESSES", "JAX_NUM_PROCESSES", "JAXRL_PROCESS_ID",
               "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(ValueError, match="num_processes"):
    initialize_multihost("127.0.0.1:1", num_processes=2)


# --------------------------------------------------------- sequence-parallel GAE math


def numpy_gae(rewards, values, mask, gamma, lam, bootstrap):
  """Plain loop over the valid steps of each row (verl semantics)."""
  b, t = rewards.shape
  gamma = np.broadcast_to(gamma, (b, t))
  lam = np.broadcast_to(lam, (b, t))
  adv = np.zeros((b, t))
  for i in range(b):
    next_value, next_adv = float(bootstrap[i]), 0.0
    for j in reversed(range(t)):
      if mask[i, j] == 0:
        continue
      delta = rewards[i, j] + gamma[i, j] * next_value - values[i, j]
      next_adv = delta + gamma[i, j] * lam[i, j] * next_adv
      adv[i, j] = next_adv
      next_value = values[i, j]
  return adv, (adv + values) * mask


@functools.partial(jax.jit, static_argnames=("chunks", "method"))
def emulated_sequence_gae(rewards, values, mask, gamma, lam, boot, *, chunks, method):
  """The shard_map body on ``chunks`` chunks, the devices emulated by a named vmap."""
  b, t = rewards.shape
  split = lambda x: x.reshape(b, chunks, t // chunks).swapaxes(0, 1)
  merge = lambda x: x.swapaxes(0, 1).reshape(b, t)
  per_token = [jnp.ndim(gamma) == 2, jnp.ndim(lam) == 2]
  args = [split(rewards), split(values), split(mask),
          split(gamma) if per_token[0] else gamma, split(lam) if per_token[1] else lam,
          boot]
  fn = jax.vmap(functools.partial(_gae_shard, axis="seq", method=method),
                in_axes=(0, 0, 0, 0 if per_token[0] else None,
                         0 if per_token[1] else None, None), axis_name="seq")
  adv, ret = fn(*args)
  return merge(adv), merge(ret)


def test_sequence_gae_hand_fixture():
  # Two chunks of two tokens; the hole at t=2 is transparent, bootstrap 2 at the end.
  r = np.array([[0., 1., 5., 0.]], np.float32)
  val = np.array([[.5, .2, 7., .4]], np.float32)
  mask = np.array([[1., 1., 0., 1.]], np.float32)
  boot = np.array([2.], np.float32)
  # gamma = 0.5, lam = 1: A3 = 0 + .5*2 - .4 = .6; A1 = 1 + .5*.4 - .2 + .5*.6 = 1.3;
  # A0 = 0 + .5*.2 - .5 + .5*1.3 = .25.
  expected = [[0.25, 1.3, 0.0, 0.6]]
  for chunks in (1, 2, 4):
    adv, ret = emulated_sequence_gae(r, val, mask, np.float32(.5), np.float32(1.),
                                     boot, chunks=chunks, method="scan")
    assert_close(adv, expected, atol=1e-6)
    assert_close(ret, [[0.75, 1.5, 0.0, 1.0]], atol=1e-6)
  # On real devices: up to 4 sequence chunks (one token per device).
  adv, _ = jax.jit(lambda *a: sequence_parallel_gae(
      *a, mesh=make_mesh(data=1, sequence=-1, devices=_devices(1, 2, 4)), gamma=0.5,
      lam=1.0, bootstrap_value=boot))(r, val, mask)
  assert_close(adv, expected, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), chunks=st.sampled_from([1, 2, 4]),
       per_token=st.booleans(), method=st.sampled_from(["scan", "associative"]))
def test_sequence_gae_equals_numpy_loop_and_gae(seed, chunks, per_token, method):
  # At most 12 shapes/modes (compilations); the data varies freely.
  rng = np.random.default_rng(seed)
  batch, t = 3, chunks * 2
  r = rng.normal(size=(batch, t)).astype(np.float32)
  val = rng.normal(size=(batch, t)).astype(np.float32)
  mask = random_mask(rng, batch, t, p_hole=0.3)
  boot = rng.normal(size=batch).astype(np.float32)
  gamma = (rng.uniform(0.5, 1.0, (batch, t)) if per_token
           else np.float64(rng.uniform(0.5, 1.0))).astype(np.float32)
  lam = np.float32(rng.uniform(0.0, 1.0))
  adv, ret = emulated_sequence_gae(r, val, mask, gamma, lam, boot, chunks=chunks,
                                   method=method)
  adv_np, ret_np = numpy_gae(r, val, mask, gamma, lam, boot)
  assert_close(adv, adv_np, atol=2e-5, rtol=1e-5)
  assert_close(ret, ret_np, atol=2e-5, rtol=1e-5)
  adv_ref, _ = gae(r, val, mask, gamma=gamma, lam=lam, bootstrap_value=boot)
  assert_close(adv, adv_ref, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(adv)[mask == 0] == 0)


def test_sequence_gae_masked_inputs_never_change_valid_outputs():
  rng = np.random.default_rng(3)
  r, val = rng.normal(size=(2, 2, 8)).astype(np.float32)
  mask = random_mask(rng, 2, 8, p_hole=0.4, all_masked_row=False)
  for junk in (1e3, np.nan, np.inf, -np.inf):
    junk_r = np.where(mask > 0, r, junk).astype(np.float32)
    junk_v = np.where(mask > 0, val, -junk).astype(np.float32)
    out = [emulated_sequence_gae(a, b, mask, np.float32(.9), np.float32(.8),
                                 np.zeros(2, np.float32), chunks=4, method="scan")
           for a, b in ((r, val), (junk_r, junk_v))]
    for clean, dirty in zip(out[0], out[1]):   # selected away: bit-identical, 0 masked
      np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty))
      assert np.all(np.asarray(dirty)[mask == 0] == 0)


def test_sequence_parallel_gae_jit_grad_and_no_recompile():
  mesh = make_mesh(data=1, sequence=-1, devices=_devices(1, 2, 3))   # T = 6
  rng = np.random.default_rng(4)
  r, val = rng.normal(size=(2, 3, 6)).astype(np.float32)
  mask = random_mask(rng, 3, 6)
  fn = lambda g, l: sequence_parallel_gae(r, val, mask, mesh=mesh, gamma=g, lam=l)[0]
  assert_no_recompile(fn, (np.float32(.9), np.float32(.9)),
                      (np.float32(.5), np.float32(.1)))
  grad = jax.jit(jax.grad(lambda v: jnp.sum(sequence_parallel_gae(
      r, v, mask, mesh=mesh, gamma=0.9, lam=0.8)[0])))(val)
  grad_ref = jax.grad(lambda v: jnp.sum(gae(r, v, mask, gamma=0.9, lam=0.8)[0]))(val)
  assert_close(grad, grad_ref, atol=1e-5)
  bf16 = jax.jit(lambda x: sequence_parallel_gae(x, val, mask, mesh=mesh)[0])(
      r.astype(jnp.bfloat16))
  assert bf16.dtype == jnp.bfloat16


def test_sequence_parallel_gae_bad_inputs():
  mesh = abstract_mesh(sequence=8)
  r = np.zeros((2, 12), np.float32)
  with pytest.raises(ValueError, match=r"`rewards` has shape \(2, 12\).*12 is not "
                                       r"divisible by mesh axis 'sequence' of size 8"):
    sequence_parallel_gae(r, r, r, mesh=mesh)
  with pytest.raises(ValueError, match="values"):
    sequence_parallel_gae(r, r[:, :8], r, mesh=mesh)
  with pytest.raises(ValueError, match="bootstrap_value"):
    sequence_parallel_gae(r, r, r, mesh=make_mesh(), bootstrap_value=np.zeros(3))
  with pytest.raises(ValueError, match="gamma"):
    sequence_parallel_gae(r, r, r, mesh=make_mesh(), gamma=np.ones(2))
  with pytest.raises(ValueError, match="'tokens' is not in the mesh"):
    sequence_parallel_gae(r, r, r, mesh=make_mesh(), axis="tokens")
  with pytest.raises(ValueError, match="batch dimension 2 is not divisible"):
    sequence_parallel_gae(r, r, r, mesh=abstract_mesh(data=4), batch_axes="data")


def test_sequence_parallel_logprobs_single_device_and_errors():
  rng = np.random.default_rng(5)
  hidden = rng.normal(size=(2, 6, 4)).astype(np.float32)
  head = rng.normal(size=(4, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 6)).astype(np.int32)
  mask = random_mask(rng, 2, 6)
  mesh = make_mesh(data=1, sequence=-1, devices=_devices(1, 2, 3))   # T = 6

  def grads(fn):
    return jax.jit(jax.grad(lambda h, w: jnp.sum(fn(h, w)[0] * 1.5 + fn(h, w)[1]),
                            argnums=(0, 1)))(hidden, head)

  ref = lambda h, w: token_logprobs_from_hidden(h, w, targets, mask=mask, chunk_size=4,
                                                return_entropy=True)
  sp = lambda h, w: sequence_parallel_token_logprobs(h, w, targets, mesh=mesh, mask=mask,
                                                     chunk_size=4, return_entropy=True)
  assert_close(jax.jit(sp)(hidden, head), ref(hidden, head), atol=1e-6)
  assert_close(grads(sp), grads(ref), atol=1e-5)
  with pytest.raises(ValueError, match=r"`hidden` has shape \(2, 6, 4\).*'sequence' of "
                                       "size 4"):
    sequence_parallel_token_logprobs(hidden, head, targets, mesh=abstract_mesh(
        sequence=4))
  with pytest.raises(ValueError, match="targets"):
    sequence_parallel_token_logprobs(hidden, head, targets[:, :3], mesh=mesh)
  with pytest.raises(ValueError, match="lm_head"):
    sequence_parallel_token_logprobs(hidden, head[0], targets, mesh=mesh)


# ------------------------------------------------------------------- 8 forced devices


def on_8_devices(test):
  """The tests sharing the ``multi`` worker run: slow, kept on one xdist worker."""
  return pytest.mark.slow(pytest.mark.xdist_group("parallel_worker_8_devices")(test))


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
  """Runs tests/parallel_worker.py once on 8 forced CPU devices; returns its JSON."""
  return run_worker("parallel_worker", str(tmp_path_factory.mktemp("parallel") / "ckpt"))


def _no_error(multi, case):
  assert case not in multi["errors"], multi["errors"][case]


LAYOUTS = ["data8", "fsdp8", "data2_fsdp2_tensor2", "data4_tensor2"]
EXPECTED_SPECS = {   # (embed, wq, w_down, batch rows)
    "data8": ("P(None, None)", "P(None, None, None)", "P(None, None)", "P('data', None)"),
    "fsdp8": ("P(None, 'fsdp')", "P('fsdp', None, None)", "P(None, 'fsdp')",
              "P('fsdp', None)"),
    "data2_fsdp2_tensor2": ("P('tensor', 'fsdp')", "P('fsdp', 'tensor', None)",
                            "P('tensor', 'fsdp')", "P(('data', 'fsdp'), None)"),
    "data4_tensor2": ("P('tensor', None)", "P(None, 'tensor', None)",
                      "P('tensor', None)", "P('data', None)"),
}


@on_8_devices
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_ppo_steps_equal_single_device(multi, layout):
  _no_error(multi, "reference")
  _no_error(multi, layout)
  res = multi[layout]
  assert res["param_diff"] < 1e-5, res["param_diff"]
  assert res["metric_diff"] < 1e-5, res["metric_diff"]
  assert res["skipped"] == 0
  assert res["loss"][-1] < res["loss"][0]          # it does learn


@on_8_devices
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_state_keeps_its_layout_and_compiles_once(multi, layout):
  _no_error(multi, layout)
  res = multi[layout]
  assert res["same_layout"]          # every leaf's sharding after each step == before
  assert res["cache_size"] == 1      # the 2nd and 3rd calls did not recompile
  embed, wq, w_down, rows = EXPECTED_SPECS[layout]
  assert (res["embed_spec"], res["wq_spec"], res["w_down_spec"], res["batch_spec"]) == (
      embed, wq, w_down, rows)
  assert res["momentum_wq_spec"] == res["wq_spec"]    # optimizer state mirrors params
  assert res["step_spec"] == res["rng_spec"] == "P()"


@on_8_devices
def test_pmap_steps_equal_single_device(multi):
  _no_error(multi, "pmap")
  res = multi["pmap"]
  assert res["devices"] == 8
  assert res["param_diff"] < 1e-5 and res["metric_diff"] < 1e-5, res
  assert res["metrics_identical_across_devices"]
  assert res["same_layout"]     # replicate() lays out inputs as pmap returns outputs


@on_8_devices
def test_sequence_parallel_gae_on_8_devices_equals_gae(multi):
  _no_error(multi, "sequence_gae")
  cases = multi["sequence_gae"]
  assert len(cases) == 8
  for key, res in cases.items():
    assert res["diff"] < 1e-5, (key, res)
    assert res["masked_zero"], key
    assert res["cache_size"] == 1, key                 # new gamma/lam: no recompile
    expected = "P('data', 'sequence')" if key.startswith("data2") else \
        "P(None, 'sequence')"
    assert res["spec"] == expected, key


@on_8_devices
def test_sequence_parallel_logprobs_on_8_devices_values_and_grads(multi):
  _no_error(multi, "sequence_logprobs")
  for name, res in multi["sequence_logprobs"].items():
    assert res["logp_diff"] < 1e-5 and res["entropy_diff"] < 1e-5, (name, res)
    assert res["grad_hidden_diff"] < 1e-5, (name, res)
    # The head gradient is a psum over devices: same value, float32 rounding only.
    assert res["grad_head_diff"] < 1e-5 * max(1.0, res["grad_head_scale"]), (name, res)
    assert res["grad_temp_diff"] < 1e-5 * max(1.0, res["grad_temp_scale"]), (name, res)


@on_8_devices
def test_non_dividing_parameter_on_a_real_mesh_raises(multi):
  _no_error(multi, "nondividing")
  msg = multi["nondividing"]["raised"]
  assert msg is not None
  assert "['blocks'][0]['attn']['wk']" in msg and "dimension 1" in msg
  assert "'tensor' of size 8" in msg


@on_8_devices
def test_sharded_checkpoint_restores_onto_another_mesh(multi):
  _no_error(multi, "checkpoint")
  res = multi["checkpoint"]
  assert res["values_equal"] and res["extra"] == {"mesh": "fsdp8"}
  assert res["shardings_new"]
  assert res["saved_spec"] == "P(None, 'fsdp')"
  assert res["restored_spec"] == "P('tensor', 'fsdp')"
  assert res["restored_wq_spec"] == res["restored_momentum_wq_spec"] == \
      "P('fsdp', 'tensor', None)"
