"""LoRA / QLoRA through qwix (jaxrl_llm.models.lora): exactness at init, what trains,
optimizer-state size, merged weights, QLoRA error, bad options, the PEFT round trip."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("qwix")

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_llm.models import Transformer, TransformerConfig, make_apply_fn, split_model
from jaxrl_llm.models.lora import (
  apply_lora,
  base_graphdef,
  lora_reference_apply,
  lora_spec,
  lora_trainable,
  merge_lora,
  num_lora_params,
)
from jaxrl_llm.train import TrainConfig, make_train_step

V = 32


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


def _model(**overrides):
  return Transformer(TransformerConfig.tiny(V, n_layers=2, **overrides), rngs=nnx.Rngs(0))


def _tokens(b=3, t=7, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (b, t)).astype(np.int32)
  mask = np.ones((b, t), np.float32)
  mask[0, :2] = 0
  return jnp.asarray(tokens), jnp.asarray(mask)


def _perturb_b(params, value=0.05):
  """Every B adapter set to a seeded random matrix (B = 0 at init)."""
  key = [jax.random.PRNGKey(1)]

  def f(path, x):
    if jax.tree_util.keystr(path).endswith("_lora_b']"):
      key[0], k = jax.random.split(key[0])
      return x.replace(value=value * jax.random.normal(k, x.shape, x.dtype))
    return x
  return jax.tree_util.tree_map_with_path(f, params,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.parametrize("scan", [True, False])
def test_b_zero_equals_base_exactly(scan):
  base = _model(scan_layers=scan)
  lora = apply_lora(base, rank=4)
  tokens, mask = _tokens()
  h0, v0 = base(tokens, attention_mask=mask)
  g, p = split_model(lora)
  h1, v1, _ = jax.jit(make_apply_fn(g))(p, tokens, None, mask)
  np.testing.assert_array_equal(np.asarray(h1), np.asarray(h0))
  np.testing.assert_array_equal(np.asarray(v1), np.asarray(v0))


def test_adapter_shapes_count_and_sharding_names():
  lora = apply_lora(_model(), rank=3, alpha=6.0, targets="q,o,down")
  c = lora.config
  attn = lora.blocks[0].attn
  assert attn.wq_lora_a.shape == (c.d_model, 3)
  assert attn.wq_lora_b.shape == (3, c.n_heads, c.dim_per_head)
  assert attn.wo_lora_a.shape == (c.n_heads, c.dim_per_head, 3)
  assert not hasattr(attn, "wk_lora_a") and not hasattr(lora.blocks[0].mlp, "w_up_lora_a")
  # Adapters carry the adapted weight's logical axes (None on the rank axis).
  assert attn.wq_lora_a.get_metadata()["out_sharding"] == ("embed", None)
  assert attn.wq_lora_b.get_metadata()["out_sharding"] == (None, "heads", "head_dim")
  n = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(lora, nnx.LoRAParam)))
  assert n == num_lora_params(c, lora.lora_spec) == 2 * 3 * (
      (64 + 64) + (64 + 64) + (128 + 64))
  assert lora.lora_spec.scale == 2.0


def _batch(b=4, t=6, seed=0):
  rng = np.random.default_rng(seed)
  ones = np.ones((b, t), np.float32)
  return dict(tokens=rng.integers(0, V, (b, t)).astype(np.int32), attention_mask=ones,
              loss_mask=ones, old_logp=np.full((b, t), -3.4, np.float32),
              advantages=rng.normal(size=b).astype(np.float32),
              old_values=np.zeros((b, t), np.float32),
              rewards=rng.normal(size=(b, t)).astype(np.float32))


@pytest.mark.parametrize("base_dtype", ["bf16", "nf4"])
def test_only_adapters_train_and_optimizer_state_is_adapter_sized(base_dtype):
  lora = apply_lora(_model(), rank=4, targets="q,v,down", base_dtype=base_dtype)
  g, params = split_model(lora)
  step = make_train_step(make_apply_fn(g), optax.adam(1e-2), TrainConfig(),
                         trainable=lora_trainable)
  state = step.init(params)
  value_head = lora.config.d_model + 1
  adapters = num_lora_params(lora.config, lora.lora_spec)
  # Adam: mu and nu for the adapters and the value head, and one step count.
  opt_size = sum(x.size for x in jax.tree_util.tree_leaves(state.opt_state))
  assert opt_size == 2 * (adapters + value_head) + 1
  before = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
  new, metrics = jax.jit(step)(state, _batch())
  assert float(metrics["skipped"]) == 0 and float(metrics["grad_norm"]) > 0
  for name, a, b in zip(names, before, jax.tree_util.tree_leaves(new.params)):
    moved = not np.array_equal(a, np.asarray(b))
    # B gets the gradient at B = 0 (A's is x^T g B^T = 0); the value head trains.
    should_move = name.count("_lora_b") or "value_" in name
    assert moved == bool(should_move), name
    if not should_move:
      assert a.dtype == np.asarray(b).dtype and a.tobytes() == np.asarray(b).tobytes(), name


def test_trainable_masks_are_bools_of_the_params_structure():
  # A mask was read by truthiness: "no" or 0.5 on a base weight trained the frozen base.
  g, params = split_model(apply_lora(_model(value_head=False), rank=2, targets="q"))

  def marking(value=None, drop=False):
    def trainable(p):
      mask = lora_trainable(p)
      if drop:
        del mask["blocks"][0]["attn"]["wq"]
      else:
        mask["blocks"][0]["attn"]["wq"] = value
      return mask
    return trainable

  def opt_size(trainable):
    step = make_train_step(make_apply_fn(g), optax.adam(1e-2), TrainConfig(),
                           trainable=trainable)
    return sum(x.size for x in jax.tree_util.tree_leaves(step.init(params).opt_state))

  assert opt_size(marking(np.bool_(False))) == opt_size(lora_trainable)
  assert opt_size(marking(True)) > opt_size(lora_trainable)
  for value, shown in (("no", "str 'no'"), (0.5, "float 0.5"), (1, "int 1")):
    with pytest.raises(ValueError, match=rf"^`trainable\(params\)` must hold bools, got "
                       rf"{shown} at \['blocks'\]\[0\]\['attn'\]\['wq'\]\.$"):
      opt_size(marking(value))
  with pytest.raises(ValueError, match=r"^`trainable\(params\)` must have a prefix of the "
                     r"structure of `params`: at \['blocks'\]\[0\]\['attn'\] it has .* "
                     r"where `params` has .*\['wq'\]"):
    opt_size(marking(drop=True))


def test_second_step_moves_a_too():
  lora = apply_lora(_model(value_head=False), rank=2, targets="q")
  g, params = split_model(lora)
  config = TrainConfig(use_value=False, whiten_advantages=False)
  step = jax.jit(make_train_step(make_apply_fn(g), optax.sgd(0.5), config,
                                 trainable=lora_trainable))
  state = make_train_step(make_apply_fn(g), optax.sgd(0.5), config,
                          trainable=lora_trainable).init(params)
  a0 = np.asarray(lora.blocks[0].attn.wq_lora_a[...])
  state, _ = step(state, _batch())
  state, _ = step(state, _batch(seed=1))
  a2 = np.asarray(state.params["blocks"][0]["attn"]["wq_lora_a"][...])
  assert np.abs(a2 - a0).max() > 0


def test_reference_is_the_base_on_shared_params():
  base = _model()
  lora = apply_lora(base, rank=4)
  g, p = split_model(lora)
  p = _perturb_b(p)
  tokens, mask = _tokens()
  apply = make_apply_fn(g)
  h_ref = jax.jit(lora_reference_apply(apply))(p, tokens, None, mask)[0]
  np.testing.assert_array_equal(np.asarray(h_ref),
                                np.asarray(base(tokens, attention_mask=mask)[0]))
  h_pol = jax.jit(apply)(p, tokens, None, mask)[0]
  assert float(jnp.abs(h_pol - h_ref).max()) > 1e-3


@pytest.mark.parametrize("base_dtype", ["bf16", "int8", "nf4"])
def test_merged_weights_equal_the_adapter_forward(base_dtype):
  lora = apply_lora(_model(), rank=4, alpha=8.0, base_dtype=base_dtype)
  g, p = split_model(lora)
  p = _perturb_b(p)
  tokens, mask = _tokens()
  h_lora = jax.jit(make_apply_fn(g))(p, tokens, None, mask)[0]
  merged = jax.jit(merge_lora, static_argnums=0)(g, p)
  h_merged = jax.jit(make_apply_fn(base_graphdef(lora)))(merged, tokens, None, mask)[0]
  np.testing.assert_allclose(np.asarray(h_merged), np.asarray(h_lora), atol=2e-5)


def test_adapters_apply_on_sequences_longer_than_the_mlp_chunk():
  """The MLP runs over chunks of ``mlp_chunk_size`` positions on long sequences (its
  weights inside a scan, where qwix cannot see them): a LoRA model runs it unchunked,
  so the adapters of gate/up/down apply at every length."""
  lora = apply_lora(_model(mlp_chunk_size=2), rank=4, alpha=8.0, targets=("gate", "up",
                                                                        "down"))
  g, p = split_model(lora)
  p = _perturb_b(p)
  tokens, mask = _tokens()                      # T = 7 > the chunk of 2
  h_lora = jax.jit(make_apply_fn(g))(p, tokens, None, mask)[0]
  merged = jax.jit(merge_lora, static_argnums=0)(g, p)
  h_merged = jax.jit(make_apply_fn(base_graphdef(lora)))(merged, tokens, None, mask)[0]
  np.testing.assert_allclose(np.asarray(h_merged), np.asarray(h_lora), atol=2e-5)


def test_qlora_forward_is_close_to_the_base():
  # head_dim 64 and d_ff 128: nf4 in blocks of 64 inputs (the QLoRA paper's block).
  base = _model(n_heads=1, n_kv_heads=1, d_ff=128)
  tokens, mask = _tokens()
  ref = np.asarray(base.logits(base(tokens, attention_mask=mask)[0]))
  errors, kls = {}, {}
  for dtype in ("int8", "nf4"):
    q = apply_lora(base, rank=2, base_dtype=dtype)
    out = np.asarray(q.logits(q(tokens, attention_mask=mask)[0]))
    errors[dtype] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    lp, lq = jax.nn.log_softmax(ref), jax.nn.log_softmax(out)
    kls[dtype] = float((jnp.exp(lp) * (lp - lq)).sum(-1).mean())
  # Measured on this random tiny model: relative RMS logit error int8 1.7%, nf4 24%
  # (16 levels vs 255: the ratio of their steps); KL(base || QLoRA) 2e-4 and 0.036.
  assert errors["int8"] < 0.03 and errors["nf4"] < 0.35, errors
  assert kls["int8"] < 1e-3 and kls["nf4"] < 0.06, kls


def test_separate_critic_masks():
  policy = split_model(apply_lora(_model(value_head=False), rank=2))[1]
  critic_full = split_model(_model())[1]
  critic_lora = split_model(apply_lora(_model(), rank=2))[1]
  for critic, all_trainable in ((critic_full, True), (critic_lora, False)):
    mask = lora_trainable({"policy": policy, "critic": critic})
    assert mask["policy"]["blocks"][0]["attn"]["wq_lora_b"]
    assert not mask["policy"]["embed"]
    assert bool(mask["critic"]["embed"]) == all_trainable
    assert mask["critic"]["value_w"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "`rank`"), (dict(rank=2, alpha=-1.0), "`alpha`"),
    (dict(rank=2, targets="q,x"), "`targets`"), (dict(rank=2, targets=""), "`targets`"),
    (dict(rank=2, base_dtype="fp4"), "`base_dtype`")])
def test_bad_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    lora_spec(**kwargs)


def test_wrapping_twice_is_refused():
  lora = apply_lora(_model(), rank=2)
  with pytest.raises(ValueError, match="already"):
    apply_lora(lora, rank=2)


@pytest.mark.slow
def test_cli_train_with_lora_trains_adapters_and_resumes(tmp_path):
  import json
  import os

  from jaxrl_llm.cli import main
  from jaxrl_llm.loop.setup import restore_latest
  out = str(tmp_path / "run")
  flags = ["train", "--algo", "ppo", "--prompts-per-step", "4", "--group-size", "2",
           "--eval-size", "8", "--eval-every", "2", "--save-every", "2", "--lora-rank", "2",
           "--lora-alpha", "4", "--lora-targets", "q,v,up", "--out", out]
  assert main(flags + ["--steps", "2"]) == 0
  assert main(flags + ["--steps", "3", "--resume"]) == 0
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  assert all(np.isfinite(r["loss"]) and r["skipped"] == 0 for r in rows[1:])
  _, _, policy, state, step = restore_latest(out)
  assert step == 3
  init = policy.init_params
  # The base is the initial one bit for bit; the adapters moved.
  attn0, attn3 = init["blocks"][0]["attn"], state.params["blocks"][0]["attn"]
  assert np.asarray(attn3["wq"][...]).tobytes() == np.asarray(attn0["wq"][...]).tobytes()
  assert not np.array_equal(np.asarray(attn3["wq_lora_b"][...]),
                            np.asarray(attn0["wq_lora_b"][...]))
  assert "wk_lora_a" not in attn3
  # The optimizer state holds the adapters and the value head only (Adam: mu, nu and
  # a few scalar counts).
  n_opt = sum(x.size for x in jax.tree_util.tree_leaves(state.opt_state))
  n_train = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(init)
                if "_lora_" in jax.tree_util.keystr(path)
                or "value_" in jax.tree_util.keystr(path))
  assert 2 * n_train <= n_opt <= 2 * n_train + 8

  from jaxrl_llm.loop.config import RunConfig
  with pytest.raises(ValueError, match="--lora-targets"):
    RunConfig(lora_rank=2, lora_targets="q,attn").validate()


@pytest.mark.parametrize("fields, match", [
    (dict(lora_rank=0), "--lora-rank"), (dict(lora_rank=2, lora_alpha=0.0), "--lora-alpha"),
    (dict(lora_rank=2, lora_targets="q,qkv"), "--lora-targets"),
    (dict(lora_alpha=2.0), "--lora-alpha is a setting of --lora-rank"),
    (dict(lora_base_dtype="nf4"), "--lora-base-dtype is a setting of --lora-rank")])
def test_bad_run_settings_name_the_flag(fields, match):
  from jaxrl_llm.loop.config import RunConfig
  with pytest.raises(ValueError, match=match) as e:
    RunConfig(**fields).validate()
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_loads_our_adapters_onto_the_transformers_base(family, tmp_path):
  pytest.importorskip("peft")
  pytest.importorskip("safetensors")
  torch = pytest.importorskip("torch")
  import peft
  import transformers

  from jaxrl_llm.models import from_pretrained
  from jaxrl_llm.models.lora import save_lora_adapters
  from tests.models.test_hf import _hf_logits, _padded_batch, make_hf_model
  path = str(tmp_path / "base")
  make_hf_model(family).save_pretrained(path)
  lora = apply_lora(from_pretrained(path, dtype=jnp.float32), rank=4, alpha=8.0,
                    targets="q,k,v,o,gate,up,down", seed=3)
  g, p = split_model(lora)
  p = _perturb_b(p, value=0.1)
  save_lora_adapters(p, lora.lora_spec, lora.config, str(tmp_path / "adapter"),
                     base_model=path)
  tokens, mask = _padded_batch()
  model = nnx.merge(g, p)
  ours = np.asarray(model.logits(model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))[0]))
  base = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
  peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  ref = _hf_logits(peft_model, tokens, mask)
  real = mask.astype(bool)
  base_logits = _hf_logits(make_hf_model(family), tokens, mask)
  assert np.abs(ref[real] - base_logits[real]).max() > 1e-2     # the adapters matter
  np.testing.assert_allclose(ours[real], ref[real], rtol=1e-4,
                             atol=1e-4 * np.abs(ref[real]).max())


@pytest.mark.slow
def test_lora_run_on_a_hf_checkpoint_exports_adapters_and_merged_model(tmp_path, capsys):
  """train --lora-rank on a tiny Qwen3 folder writes adapter/ (PEFT); export --merge-lora
  writes hf/, whose transformers logits equal the adapter model's; --merge-lora on a
  run without adapters is refused before anything is written."""
  pytest.importorskip("peft")
  torch = pytest.importorskip("torch")
  import json
  import os
  import shutil

  import peft
  import transformers

  from jaxrl_llm import cli
  from jaxrl_llm.loop.export import restore_run
  from tests.models.test_hf import _hf_logits, _padded_batch, _tiny_hf_folder
  model_dir, data = _tiny_hf_folder(tmp_path)
  out = str(tmp_path / "run")
  assert cli.main(["train", "--model", model_dir, "--dataset", data, "--reward", "math",
                   "--algo", "grpo", "--steps", "2", "--prompts-per-step", "2",
                   "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "2",
                   "--eval-every", "2", "--save-every", "2", "--out", out, "--no-progress",
                   "--lr", "1e-2", "--lora-rank", "2", "--lora-targets", "q,v,down"]) == 0
  assert "adapter" in capsys.readouterr().out
  assert sorted(os.listdir(os.path.join(out, "adapter"))) == [
      "adapter_config.json", "adapter_model.safetensors"]
  assert not os.path.exists(os.path.join(out, "hf"))
  dest = str(tmp_path / "exported")
  assert cli.main(["export", out, "--out", dest, "--merge-lora"]) == 0
  _, model, _, step = restore_run(out)
  assert step == 2
  tokens, mask = _padded_batch(seed=7, t=10)
  tokens %= model.config.vocab_size
  real = mask.astype(bool)
  with jax.default_matmul_precision("highest"):
    ours = np.asarray(model.logits(model(jnp.asarray(tokens),
                                         attention_mask=jnp.asarray(mask))[0]))
  merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(dest, "hf"))
  base = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                           torch_dtype=torch.float32)
  with_adapter = peft.PeftModel.from_pretrained(base, os.path.join(dest, "adapter"))
  scale = np.abs(ours[real]).max()
  for other in (merged, with_adapter):
    np.testing.assert_allclose(_hf_logits(other.eval(), tokens, mask)[real], ours[real],
                               rtol=1e-4, atol=1e-4 * scale)
  # A run without adapters: --merge-lora is refused, nothing written.
  plain = str(tmp_path / "plain")
  shutil.copytree(out, plain)
  with open(os.path.join(plain, "config.json")) as f:
    cfg = json.load(f)
  cfg.update(lora_rank=None, lora_targets="q,k,v,o,gate,up,down")
  with open(os.path.join(plain, "config.json"), "w") as f:
    json.dump(cfg, f)
  from jaxrl_llm import run_folder as rf
  for step in rf.checkpoint_extras(plain):      # a run saved before steps recorded
    extra_file = os.path.join(plain, "checkpoints", str(step), rf.EXTRA_FILE)
    rf.write_json(extra_file, {"step": step})   # their run (else: config.json edited)
  dest2 = str(tmp_path / "refused")
  assert cli.main(["export", plain, "--out", dest2, "--merge-lora"]) != 0
  assert "no LoRA adapters" in capsys.readouterr().err
  assert not os.path.exists(dest2)
