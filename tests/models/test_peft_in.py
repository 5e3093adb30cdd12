"""PEFT LoRA adapters in (jaxrl_llm.models.lora.load_lora_adapters, ``train --lora-init``):
our export loads back bit for bit, an adapter made by ``peft`` itself gives peft's
logits, bad folders are refused in one line, and a CLI run starts from the adapter."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("qwix")
pytest.importorskip("safetensors")

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models import make_apply_fn, split_model
from jaxrl_llm.models.lora import (
  ADAPTER_CONFIG_FILE,
  ADAPTER_WEIGHTS_FILE,
  apply_lora,
  load_lora_adapters,
  read_lora_config,
  save_lora_adapters,
)
from tests.models.test_lora import _float32_matmuls, _model, _perturb_b, _tokens  # noqa: F401

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _leaves(params):
  return {jax.tree_util.keystr(k).removesuffix(".value"): np.asarray(v) for k, v in
          jax.tree_util.tree_leaves_with_path(params)}


def _exported(folder, *, rank=2, alpha=4.0, targets="q,v", seed=1, **overrides):
  """A tiny LoRA model with random A and B, its adapters written to ``folder``."""
  lora = apply_lora(_model(**overrides), rank=rank, alpha=alpha, targets=targets, seed=seed)
  g, p = split_model(lora)
  p = _perturb_b(p)
  save_lora_adapters(p, lora.lora_spec, lora.config, folder)
  return nnx.merge(g, p)


# ------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("wrapped, base_dtype", [(True, "bf16"), (False, "bf16"),
                                                 (False, "nf4")])
def test_our_export_loads_back_bit_identical(tmp_path, wrapped, base_dtype):
  """Every target (GQA k/v, the head-split o): save -> load gives the same adapters
  bit for bit and the same logits, onto a model wrapped with another seed or onto
  the bare base (wrapped from adapter_config.json; QLoRA nf4 too)."""
  folder = str(tmp_path / "adapter")
  base = _model(qkv_bias=True)
  trained = apply_lora(base, rank=3, alpha=6.0, targets="all", seed=1,
                       base_dtype=base_dtype)
  g, p = split_model(trained)
  trained = nnx.merge(g, _perturb_b(p))
  save_lora_adapters(split_model(trained)[1], trained.lora_spec, trained.config, folder)
  target = apply_lora(base, rank=3, alpha=6.0, targets="all", seed=2) if wrapped else base
  loaded = load_lora_adapters(target, folder, seed=2, base_dtype=base_dtype)
  assert loaded.lora_spec == trained.lora_spec
  want, got = _leaves(split_model(trained)[1]), _leaves(split_model(loaded)[1])
  assert want.keys() == got.keys()
  for name, x in want.items():
    assert x.dtype == got[name].dtype and x.tobytes() == got[name].tobytes(), name
  # The seed-2 init differs: the values above came from the file.
  fresh = np.asarray(apply_lora(base, rank=3, alpha=6.0, targets="all",
                                seed=2).blocks[1].attn.wo_lora_a[...])
  assert not np.array_equal(fresh, want["['blocks'][1]['attn']['wo_lora_a']"])
  tokens, mask = _tokens()
  outs = [np.asarray(jax.jit(make_apply_fn(g))(p, tokens, None, mask)[0]) for g, p in
          (split_model(trained), split_model(loaded))]
  np.testing.assert_array_equal(outs[0], outs[1])
  # The input model is kept as it was.
  if wrapped:
    assert float(jnp.abs(target.blocks[0].attn.wq_lora_b[...]).max()) == 0.0


def test_a_bfloat16_adapter_file_loads_at_its_stored_values(tmp_path):
  import ml_dtypes
  folder = str(tmp_path / "adapter")
  trained = _exported(folder)
  file = os.path.join(folder, ADAPTER_WEIGHTS_FILE)
  tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(file).items()}
  save_file(tensors, file)
  loaded = load_lora_adapters(_model(), folder)
  got = np.asarray(loaded.blocks[1].attn.wv_lora_b[...])
  want = np.asarray(trained.blocks[1].attn.wv_lora_b[...])
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))


# ------------------------------------------------------------- adapters made by peft


@pytest.mark.parametrize("family, target_modules, r, alpha, targets", [
    ("llama", "all-linear", 4, 8, "q,k,v,o,gate,up,down"),
    ("qwen3", PROJ, 4, 16, "q,k,v,o,gate,up,down"),
    ("qwen2", ["q_proj", "v_proj", "down_proj"], 2, 2, "q,v,down"),  # q/k/v biases, tied
    ("qwen3", r".*\.(q|o|up)_proj", 3, 6, "q,o,up"),                   # a regular expression
])
def test_an_adapter_made_by_peft_gives_peft_logits(family, target_modules, r, alpha,
                                                   targets, tmp_path):
  """peft.get_peft_model on the transformers model, non-zero random lora_B,
  save_pretrained; loaded onto our from_pretrained base, the logits are peft's
  within 1e-4 (float32)."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")

  from jaxrl_llm.models import from_pretrained
  from tests.models.test_hf import (
    _assert_logits_close,
    _hf_logits,
    _our_logits,
    _padded_batch,
    make_hf_model,
  )
  base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
  make_hf_model(family).save_pretrained(base_dir)
  config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules,
                           lora_dropout=0.0, task_type="CAUSAL_LM")
  model = peft.get_peft_model(make_hf_model(family), config)
  torch.manual_seed(1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name:
        p.normal_(0.0, 0.1)
  model.save_pretrained(adapter_dir)
  tokens, mask = _padded_batch()
  ref = _hf_logits(model.eval(), tokens, mask)
  real = mask.astype(bool)
  base_logits = _hf_logits(make_hf_model(family), tokens, mask)
  assert np.abs(ref[real] - base_logits[real]).max() > 1e-2     # the adapters matter
  ours = load_lora_adapters(from_pretrained(base_dir, dtype=jnp.float32), adapter_dir)
  assert ours.lora_spec.rank == r and ours.lora_spec.alpha == alpha
  assert ",".join(ours.lora_spec.targets) == targets
  _assert_logits_close(_our_logits(ours, tokens, mask), ref, mask)


# ---------------------------------------------------------------------- bad folders


@pytest.fixture
def adapter(tmp_path):
  """An exported adapter (rank 2, alpha 4, targets q,v) to copy and spoil."""
  folder = str(tmp_path / "good")
  _exported(folder)
  return folder


def _spoiled(adapter, tmp_path, *, config=None, tensors=None, remove=None):
  folder = str(tmp_path / "bad")
  shutil.copytree(adapter, folder)
  if remove is not None:
    os.remove(os.path.join(folder, remove))
  if config is not None:
    file = os.path.join(folder, ADAPTER_CONFIG_FILE)
    with open(file) as f:
      cfg = json.load(f)
    with open(file, "w") as f:
      json.dump(config(cfg), f)
  if tensors is not None:
    file = os.path.join(folder, ADAPTER_WEIGHTS_FILE)
    save_file(tensors(load_file(file)), file)
  return folder


def _one_line_error(match, fn, *args, **kwargs):
  with pytest.raises(ValueError, match=match) as e:
    fn(*args, **kwargs)
  assert "\n" not in str(e.value)
  return str(e.value)


@pytest.mark.parametrize("changes, match", [
    (dict(use_dora=True), "use_dora=True: DoRA"),
    (dict(use_rslora=True), "use_rslora=True: rsLoRA"),
    (dict(bias="lora_only"), "bias='lora_only'"),
    (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
    (dict(alpha_pattern={"q_proj": 4}), "alpha_pattern"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(init_lora_weights="pissa"), "rewrites the base"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(peft_type="IA3"), "peft_type='IA3'"),
    (dict(some_future_feature={"on": 1}), "some_future_feature"),
    (dict(r=0), "r must be an int >= 1"),
    (dict(lora_alpha="big"), "lora_alpha must be a number"),
    (dict(target_modules=["q_proj", "lm_head"]), r"\['lm_head'\] matches no LoRA target"),
    (dict(target_modules=17), "target_modules must be"),
])
def test_unsupported_or_bad_configs_are_refused(adapter, tmp_path, changes, match):
  folder = _spoiled(adapter, tmp_path, config=lambda c: {**c, **changes})
  msg = _one_line_error(match, load_lora_adapters, _model(), folder)
  assert msg.startswith(f"`path` {folder!r}")


def test_missing_files_are_refused(adapter, tmp_path):
  _one_line_error("is not a folder", read_lora_config, str(tmp_path / "nowhere"))
  _one_line_error(f"has no {ADAPTER_CONFIG_FILE}", read_lora_config,
                  _spoiled(adapter, tmp_path, remove=ADAPTER_CONFIG_FILE))
  folder = str(tmp_path / "pickle")
  shutil.copytree(adapter, folder)
  os.rename(os.path.join(folder, ADAPTER_WEIGHTS_FILE),
            os.path.join(folder, "adapter_model.bin"))
  _one_line_error(f"has no {ADAPTER_WEIGHTS_FILE} .it has adapter_model.bin",
                  read_lora_config, folder)
  with open(os.path.join(folder, ADAPTER_CONFIG_FILE), "w") as f:
    f.write("{not json")
  open(os.path.join(folder, ADAPTER_WEIGHTS_FILE), "w").close()
  _one_line_error("not valid JSON", read_lora_config, folder)


@pytest.mark.parametrize("wrap, match", [
    (dict(rank=4, alpha=4.0, targets="q,v"), "has r=2, but `model`'s adapters have rank=4"),
    (dict(rank=2, alpha=2.0, targets="q,v"), "lora_alpha=4.0, but .* alpha=2.0"),
    (dict(rank=2, alpha=4.0, targets="q,k,v"), "target_modules=.'q', 'v'., but .* targets="),
])
def test_a_model_with_other_adapters_is_refused(adapter, wrap, match):
  _one_line_error(match, load_lora_adapters, apply_lora(_model(), **wrap), adapter)


@pytest.mark.parametrize("edit, match", [
    (lambda t: {**t, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                np.zeros((65, 2), np.float32)}, r"has shape \[65, 2\], expected \[64, 2\]"),
    (lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.v_proj.lora_A" not in k},
     "layers.1.self_attn.v_proj.lora_A.weight' is missing"),
    (lambda t: {**t, "base_model.model.lm_head.lora_A.weight": np.zeros((2, 64), np.float32)},
     "lm_head.lora_A.weight' is not an adapter of targets q,v"),
    (lambda t: {k: np.where(np.arange(v.size).reshape(v.shape) == 3, np.inf, v).astype(v.dtype)
                if "layers.1.self_attn.q_proj.lora_B" in k else v for k, v in t.items()},
     r"layers.1.self_attn.q_proj.lora_B.weight' has 1 non-finite values \(NaN or inf\)"),
])
def test_bad_tensors_are_refused(adapter, tmp_path, edit, match):
  folder = _spoiled(adapter, tmp_path, tensors=edit)
  msg = _one_line_error(match, load_lora_adapters, _model(), folder)
  assert msg.startswith(f"`path` {folder!r}: {ADAPTER_WEIGHTS_FILE}: tensor")


# ------------------------------------------------------------------------ the command


@pytest.mark.parametrize("fields, match", [
    (dict(lora_rank=4), "the adapter has rank 2, the run --lora-rank 4; pass --lora-rank 2"),
    (dict(lora_rank=2), "the adapter has alpha 4, the run --lora-alpha 2; pass --lora-alpha 4"),
    (dict(lora_rank=2, lora_alpha=4.0), "has targets q,v, the run --lora-targets "
     "q,k,v,o,gate,up,down; pass --lora-targets q,v"),
    (dict(), "--lora-init is a setting of --lora-rank"),
])
def test_run_settings_that_disagree_with_the_adapter_name_the_flag(adapter, fields, match):
  from jaxrl_llm.loop.config import RunConfig
  with pytest.raises(ValueError, match=match) as e:
    RunConfig(lora_init=adapter, **fields).validate()
  assert "\n" not in str(e.value)
  RunConfig(lora_init=adapter, lora_rank=2, lora_alpha=4.0, lora_targets="v,q").validate()


def test_cli_refuses_a_bad_adapter_before_writing(adapter, tmp_path, capsys):
  from jaxrl_llm.cli import main
  out = str(tmp_path / "run")
  bad = _spoiled(adapter, tmp_path, config=lambda c: {**c, "use_dora": True})
  assert main(["train", "--lora-rank", "2", "--lora-alpha", "4", "--lora-targets", "q,v",
               "--lora-init", bad, "--out", out]) != 0
  err = capsys.readouterr().err
  assert "--lora-init" in err and "DoRA" in err
  assert not os.path.exists(out)


@pytest.mark.slow
def test_cli_train_starts_from_the_adapter_and_resumes(tmp_path):
  """train --lora-init on a tiny Qwen3 folder: the step-0 adapters are the folder's
  (bit for bit), step 1 is one Adam step (<= ~lr) away from them, --resume goes on."""
  pytest.importorskip("transformers")
  from jaxrl_llm import cli
  from jaxrl_llm.loop.setup import restore_latest
  from jaxrl_llm.models import from_pretrained
  from tests.models.test_hf import _tiny_hf_folder
  model_dir, data = _tiny_hf_folder(tmp_path)
  trained = apply_lora(from_pretrained(model_dir), rank=2, alpha=4.0, targets="q,v,down",
                       seed=5)
  p = _perturb_b(split_model(trained)[1])
  adapter_dir = str(tmp_path / "sft_adapter")
  save_lora_adapters(p, trained.lora_spec, trained.config, adapter_dir)
  want = {k: v for k, v in _leaves(p).items() if "_lora_" in k}
  out = str(tmp_path / "run")
  flags = ["train", "--model", model_dir, "--dataset", data, "--reward", "math",
           "--algo", "grpo", "--prompts-per-step", "2", "--group-size", "2",
           "--max-new-tokens", "4", "--eval-size", "2", "--eval-every", "1",
           "--save-every", "1", "--out", out, "--no-progress", "--lr", "1e-4",
           "--lora-rank", "2", "--lora-alpha", "4", "--lora-targets", "q,v,down",
           "--lora-init", adapter_dir]
  assert cli.main(flags + ["--steps", "1"]) == 0
  _, _, policy, state, step = restore_latest(out)
  assert step == 1
  start = _leaves(policy.init_params)
  moved = _leaves(state.params)
  fresh = _leaves(split_model(apply_lora(from_pretrained(model_dir), rank=2, alpha=4.0,
                                         targets="q,v,down", seed=0))[1])
  for name, x in want.items():
    assert start[name].tobytes() == x.tobytes(), name          # step 0: the folder's
    assert np.abs(moved[name] - x).max() <= 2e-4, name         # one Adam step of lr 1e-4
    assert np.abs(fresh[name] - x).max() > 1e-2, name          # not a fresh init
  assert cli.main(flags + ["--steps", "2", "--resume"]) == 0
  assert restore_latest(out)[4] == 2


@pytest.mark.parametrize("critic", [None, "policy"])
def test_the_run_policy_starts_from_the_adapter(tmp_path, critic):
  """make_policy with lora_init (a preset model; a shared value head or a separate,
  fully trained critic): the policy's initial adapters are the folder's, bit for bit;
  the base and the critic are the run's own."""
  import dataclasses

  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_policy, make_task
  from jaxrl_llm.models import get_config
  from jaxrl_llm.models.critic import POLICY
  from jaxrl_llm.models.lora import lora_spec
  run = RunConfig(algo="ppo", critic=critic, lora_rank=2, lora_alpha=4.0,
                  lora_targets="q,v,down", rollout="simple")
  task = make_task(run)
  plain = make_policy(resolve(run, task), task).init_params
  part = plain[POLICY] if critic else plain
  trained = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.01 if "_lora_" in jax.tree_util.keystr(path) else x, part)
  folder = str(tmp_path / "adapter")
  config = get_config("tiny", task.tokenizer.vocab_size, value_head=not critic,
                      max_seq_len=max(task.max_prompt_len + task.max_new_tokens, 8))
  save_lora_adapters(trained, lora_spec(2, 4.0, "q,v,down"), config, folder)
  run = dataclasses.replace(run, lora_init=folder)
  run.validate()
  seeded = make_policy(resolve(run, task), task).init_params
  want, got, before = _leaves(trained), _leaves(seeded), _leaves(plain)
  for name, x in got.items():
    if critic is not None and not name.startswith(f"['{POLICY}']"):
      ref = before[name]                                      # the critic: untouched
    else:
      key = name[len(f"['{POLICY}']"):] if critic else name
      ref = want[key]                         # adapters from the folder, base as before
    assert x.tobytes() == ref.tobytes(), name


def _truncated(tensors_file):
  with open(tensors_file, "rb") as f:
    data = f.read()
  with open(tensors_file, "wb") as f:
    f.write(data[:len(data) - 100])


_FLAGS = ["--algo", "grpo", "--lora-rank", "2", "--lora-alpha", "4", "--lora-targets", "q,v",
          "--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--eval-size",
          "4", "--no-progress"]
_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda t: {**t, _Q_A: np.zeros((3, 3), np.float32)},
     f"tensor {_Q_A!r} has shape [3, 3], expected [2, 64]"),
    (lambda t: {k: v for k, v in t.items() if k != _Q_A}, f"tensor {_Q_A!r} is missing"),
    (lambda t: {**t, "base_model.model.model.layers.5.mlp.up_proj.lora_A.weight":
                np.zeros((2, 2), np.float32)},
     "tensor 'base_model.model.model.layers.5.mlp.up_proj.lora_A.weight' is not an "
     "adapter of targets q,v on this 2-layer model"),
    (lambda t: {**t, _Q_A: np.full_like(t[_Q_A], np.nan)},
     f"tensor {_Q_A!r} has 128 non-finite values (NaN or inf) of 128"),
    (_truncated, f"{ADAPTER_WEIGHTS_FILE} cannot be read (Error while deserializing header"),
], ids=["shape", "missing", "extra", "nan", "truncated"])
def test_cli_refuses_bad_adapter_tensors_in_one_line(tmp_path, capsys, edit, message):
  """Reliability issue, item 5: wrong shapes, missing or extra tensors and a truncated
  file ended ``train --lora-init`` in a 27-39-line traceback; a NaN adapter trained
  (every step skipped) and wrote a non-finite checkpoint. Now: one line naming
  --lora-init and the tensor, exit 2, no run folder."""
  from jaxrl_llm.cli import main
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_policy, make_task
  from jaxrl_llm.models import get_config
  from jaxrl_llm.models.lora import lora_spec
  run = RunConfig(algo="grpo", lora_rank=2, lora_alpha=4.0, lora_targets="q,v",
                  rollout="simple")
  task = make_task(run)
  params = make_policy(resolve(run, task), task).init_params
  config = get_config("tiny", task.tokenizer.vocab_size, value_head=False,
                      max_seq_len=max(task.max_prompt_len + task.max_new_tokens, 8))
  folder = str(tmp_path / "adapter")
  save_lora_adapters(params, lora_spec(2, 4.0, "q,v"), config, folder)
  file = os.path.join(folder, ADAPTER_WEIGHTS_FILE)
  if edit is _truncated:
    edit(file)
  else:
    save_file(edit(load_file(file)), file)
  capsys.readouterr()
  out = str(tmp_path / "run")
  assert main(["train", *_FLAGS, "--lora-init", folder, "--out", out]) == 2
  err = capsys.readouterr().err
  assert err.splitlines() == [f"error: --lora-init {folder!r}: {ADAPTER_WEIGHTS_FILE}"
                              + err.split(ADAPTER_WEIGHTS_FILE, 1)[1].rstrip("\n")], err
  assert message in err and "Traceback" not in err
  assert not os.path.exists(out)
