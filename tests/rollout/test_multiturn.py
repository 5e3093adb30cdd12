"""Multi-turn episodes, token in and token out (jaxrl_llm.rollout.multiturn): the trained
ids are the sampled ids interleaved with the environment turns' ids, bit for bit, on the
built-in character format and on the Qwen3 and Llama-3.1 chat templates; behaviour
log-probs of the built-in model equal teacher-forced ones; the budgets hold.

The chat-template tokenizers are tiny byte-level BPEs trained here, with the real
templates read from trl's package data (skipped, with the reason, without trl)."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import numpy as np
import pytest

from jaxrl_llm.envs import (
    CHAT_CHARS,
    CalculatorEnv,
    GuessNumberEnv,
    PlainChat,
    StepResult,
    TemplateChat,
)
from jaxrl_llm.rollout.multiturn import (
    FINISH_REASONS,
    SampledTurn,
    engine_generate,
    episodes_to_batch,
    run_episodes,
)
from jaxrl_llm.tasks.tokenizer import CharTokenizer

CHAR = PlainChat(CharTokenizer(CHAT_CHARS))


class Scripted:
  """A fake backend: episode e's turn k is ``script(e, k, prompt)`` (ids); it records
  every call's prompts and limits and what it returned. Episodes are the prompts of the
  first call, in order; a later prompt belongs to the first episode not yet seen in the
  call whose sequence so far (its last prompt and the ids returned for it) it extends."""

  def __init__(self, script):
    self.script = script
    self.calls = []
    self.returned = {}    # episode -> [ids of turn 1, turn 2, ...]
    self.history = []     # episode -> its sequence after its last turn

  def __call__(self, prompts, limits):
    first = not self.history
    out, taken = [], set()
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
      if first:
        e = i
        self.history.append(None)
      else:
        e = next(e for e, h in enumerate(self.history)
                 if e not in taken and prompt[:len(h)] == h)
      taken.add(e)
      turn = len(self.returned.setdefault(e, []))
      ids = list(self.script(e, turn, prompt))[:limit]
      self.returned[e].append(ids)
      self.history[e] = list(prompt) + ids
      out.append((ids, [-0.125 * (j + 1) - turn for j in range(len(ids))]))
    self.calls.append(([list(p) for p in prompts], list(limits)))
    return out


def _scripted(script):
  return Scripted(script)


def assert_interleaved(ep, sampled):
  """``ep.tokens`` is the prompt, then each sampled turn exactly, each followed by the
  environment's reply ids; the mask is 1 exactly on the sampled ids; the behaviour
  log-probs are the backend's there and 0 elsewhere."""
  tokens = ep.tokens.tolist()
  assert len(ep.turn_spans) == len(sampled) == ep.turns
  pieces, cursor = [tokens[:ep.prompt_len]], ep.prompt_len
  for k, ((start, end), ids) in enumerate(zip(ep.turn_spans, sampled)):
    assert start == cursor and tokens[start:end] == ids, k
    pieces.append(ids)
    nxt = ep.turn_spans[k + 1][0] if k + 1 < len(sampled) else len(tokens)
    pieces.append(tokens[end:nxt])
    cursor = nxt
  assert [i for p in pieces for i in p] == tokens
  assert len(pieces[-1]) == 0       # it ends with a model turn
  want_mask = np.zeros(len(tokens), np.int32)
  for start, end in ep.turn_spans:
    want_mask[start:end] = 1
  np.testing.assert_array_equal(ep.loss_mask, want_mask)
  want_logp = np.zeros(len(tokens), np.float32)
  for k, (start, end) in enumerate(ep.turn_spans):
    want_logp[start:end] = [-0.125 * (j + 1) - k for j in range(end - start)]
  np.testing.assert_array_equal(ep.behaviour_logprobs, want_logp)
  assert np.all(ep.behaviour_logprobs[ep.loss_mask == 0] == 0)


# ----------------------------------------------------------- the built-in char format


class Chatter:
  """A deterministic test environment: replies ``"n<k>"`` as a user turn, done after
  ``turns`` turns (never, with None); reward 0.25 a turn."""

  name = "chatter"

  def __init__(self, turns=3, role="user"):
    self.turns, self.role, self.k = turns, role, 0

  def reset(self, seed):
    self.k = 0
    return [{"role": "user", "content": f"hi {seed}"}]

  def step(self, text):
    self.k += 1
    done = self.turns is not None and self.k >= self.turns
    return StepResult([{"role": self.role, "content": f"n{self.k}"}], 0.25, done,
                      {"text": text})


def test_char_format_episodes_interleave_sampled_and_environment_ids_exactly():
  tok = CHAR.tokenizer
  # turn texts, the first ending at the stop id, the second cut by its limit (no eos)
  script = lambda e, k, prompt: tok.encode(["ab", "cdefghijkl", "z"][k] + str(e)) + (
      [tok.eos_id] if k != 1 else [])
  backend = _scripted(script)
  envs = [Chatter(), Chatter()]
  eps = run_episodes(backend, CHAR, envs, seeds=[7, 8], max_turns=5, max_new_tokens=6,
                     max_len=200)
  for e, ep in enumerate(eps):
    sampled = backend.returned[e]
    assert sampled[1] == tok.encode("cdefgh")              # cut at max_new_tokens=6
    assert_interleaved(ep, sampled)
    text = "".join(tok.id_to_token(i) for i in ep.tokens)
    assert text == (f"u:hi {7 + e}<eos>a:ab{e}<eos>u:n1<eos>a:cdefgh<eos>u:n2<eos>a:z{e}"
                    "<eos>")
    # the cut turn got its close (<eos>) as an environment token (mask 0)
    assert ep.loss_mask[ep.turn_spans[1][1]] == 0
    assert (ep.turns, ep.turn_rewards, ep.reward, ep.finish_reason) == (
        3, [0.25] * 3, 0.75, "done")
    assert [m["content"] for m in ep.messages] == [
        f"hi {7 + e}", f"ab{e}", "n1", "cdefgh", "n2", f"z{e}", "n3"]
    assert [i["text"] for i in ep.infos] == [f"ab{e}", "cdefgh", f"z{e}"]
    assert (ep.env, ep.seed) == ("chatter", 7 + e)
  # one backend call per round, every live episode in it
  assert [len(p) for p, _ in backend.calls] == [2, 2, 2]


def test_max_turns_ends_an_episode_after_a_model_turn():
  tok = CHAR.tokenizer
  backend = _scripted(lambda e, k, p: tok.encode("x") + [tok.eos_id])
  [ep] = run_episodes(backend, CHAR, [Chatter(turns=None)], max_turns=2,
                      max_new_tokens=4, max_len=100)
  assert (ep.turns, ep.finish_reason, ep.reward) == (2, "max_turns", 0.5)
  assert ep.tokens[-2:].tolist() == tok.encode("x") + [tok.eos_id]   # no reply after it
  assert set(FINISH_REASONS) == {"done", "max_turns", "length"}


def test_the_length_budget_bounds_every_turn_and_the_sequence():
  tok = CHAR.tokenizer
  backend = _scripted(lambda e, k, p: tok.encode("abcdefgh"))    # never stops by itself
  opening = len(CHAR.prompt_ids(Chatter().reset(0)))
  [ep] = run_episodes(backend, CHAR, [Chatter(turns=None)], max_turns=10,
                      max_new_tokens=8, max_len=opening + 8 + 6 + 5)
  assert ep.finish_reason == "length" and len(ep.tokens) <= opening + 19
  # turn 1: 8 tokens; the reply <eos>u:n1<eos>a: is 8; turn 2 gets the 3 left
  assert [lim for _, lims in backend.calls for lim in lims] == [8, 3]
  assert len(ep.tokens) == opening + 19 and ep.turns == 2
  # a reply that does not fit (with a token for the next turn) is not appended
  backend = _scripted(lambda e, k, p: tok.encode("ab") + [tok.eos_id])
  [ep] = run_episodes(backend, CHAR, [Chatter(turns=None)], max_turns=10,
                      max_new_tokens=8, max_len=opening + 3 + 6)
  assert (ep.turns, ep.finish_reason, len(ep.tokens)) == (1, "length", opening + 3)


class BadEnv(Chatter):
  name = "bad"

  def step(self, text):
    return StepResult([{"role": "user", "content": 42}], 0.0, False)


def test_episode_argument_and_environment_errors():
  tok = CHAR.tokenizer
  ok = lambda prompts, limits: [([tok.eos_id], [0.0]) for _ in prompts]
  kw = dict(max_turns=2, max_new_tokens=4, max_len=50)
  with pytest.raises(ValueError, match="`max_turns` must be an int >= 1, got 0"):
    run_episodes(ok, CHAR, [Chatter()], **{**kw, "max_turns": 0})
  with pytest.raises(ValueError, match=r"environment 'bad' returned step\(\).messages\[0\]"
                     r"\['content'\] of type int; it must be a str"):
    run_episodes(ok, CHAR, [BadEnv()], **kw)
  env = Chatter()
  with pytest.raises(ValueError, match="`envs\\[1\\]` is `envs\\[0\\]`"):
    run_episodes(ok, CHAR, [env, env], **kw)
  with pytest.raises(ValueError, match="`seeds` must have one seed per environment"):
    run_episodes(ok, CHAR, [Chatter()], seeds=[1, 2], **kw)
  with pytest.raises(ValueError, match="the opening of seed 0 is 9 tokens, which leaves no "
                     "room below `max_len`=9"):
    run_episodes(ok, CHAR, [Chatter()], **{**kw, "max_len": 9})
  too_long = lambda prompts, limits: [([3] * (limits[0] + 1), [0.0] * (limits[0] + 1))]
  with pytest.raises(ValueError, match="returned 5 ids and 5 log-probs for prompt 0; it must "
                     "return as many of each, 1 to max_new_tokens=4"):
    run_episodes(too_long, CHAR, [Chatter()], **kw)
  with pytest.raises(ValueError, match="returned 0 completions for 1 prompts"):
    run_episodes(lambda p, n: [], CHAR, [Chatter()], **kw)


def test_episodes_count_the_prompt_tokens_a_backend_prefilled_and_reused():
  # A fake backend that says it reused all of each prompt but its last 3 tokens.
  tok = CHAR.tokenizer

  def generate(prompts, limits):
    ids = tok.encode("ok") + [tok.eos_id]
    return [SampledTurn(ids, [-0.5] * 3, cached_tokens=len(p) - 3) for p in prompts]

  [ep] = run_episodes(generate, CHAR, [Chatter()], max_turns=3, max_new_tokens=4, max_len=80)
  asked = [ep.prompt_len] + [start for start, _ in ep.turn_spans[1:]]
  assert ep.turns == 3 and (ep.prefill_tokens, ep.reused_tokens) == (9, sum(asked) - 9)
  # Plain pairs: everything prefilled.
  [ep] = run_episodes(lambda p, n: [tuple(t) for t in generate(p, n)], CHAR, [Chatter()],
                      max_turns=3, max_new_tokens=4, max_len=80)
  assert (ep.prefill_tokens, ep.reused_tokens) == (sum(asked), 0)
  for bad in (-1, 9):              # the opening is 9 tokens
    lying = lambda p, n, bad=bad: [SampledTurn([tok.eos_id], [0.0], bad) for _ in p]
    with pytest.raises(ValueError, match=f"reused {bad!r} cached tokens of prompt 0; it "
                       r"must be an int in \[0, 9\)"):
      run_episodes(lying, CHAR, [Chatter()], max_turns=3, max_new_tokens=4, max_len=80)


def test_environments_stepped_in_threads_give_the_same_episodes():
  tok = CHAR.tokenizer
  script = lambda e, k, p: tok.encode(str(e) * (k + 1)) + [tok.eos_id]
  runs = [run_episodes(_scripted(script), CHAR, [Chatter(turns=2 + e % 2) for e in range(6)],
                       max_turns=4, max_new_tokens=5, max_len=80, max_workers=w)
          for w in (1, 4)]
  for a, b in zip(*runs):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.turn_rewards, a.finish_reason, a.messages) == (
        b.turn_rewards, b.finish_reason, b.messages)


def test_episodes_to_batch_gives_grpo_advantages_over_episodes_of_a_prompt():
  tok = CHAR.tokenizer
  backend = _scripted(lambda e, k, p: tok.encode("ab"[:1 + e % 2]) + [tok.eos_id])
  envs = [Chatter(turns=1 + e % 2) for e in range(4)]     # rewards .25 .5 .25 .5
  eps = run_episodes(backend, CHAR, envs, seeds=[0, 0, 1, 1], max_turns=3,
                     max_new_tokens=4, max_len=64)
  batch = episodes_to_batch(eps, pad_id=tok.pad_id, group_size=2)
  np.testing.assert_allclose(batch["scores"], [0.25, 0.5, 0.25, 0.5])
  b, t = batch["tokens"].shape
  assert b == 4 and t == max(len(e.tokens) for e in eps)
  adv = 0.25 / np.std([0.25, 0.5], ddof=1) / 2      # (s - mean) / (std + eps)
  for i, ep in enumerate(eps):
    n = len(ep.tokens)
    np.testing.assert_array_equal(batch["tokens"][i, :n], ep.tokens)
    assert np.all(batch["tokens"][i, n:] == tok.pad_id)
    assert batch["attention_mask"][i].sum() == n
    np.testing.assert_array_equal(batch["loss_mask"][i, :n], ep.loss_mask)
    np.testing.assert_array_equal(batch["rollout_logp"][i, :n], ep.behaviour_logprobs)
    sign = 1 if i % 2 else -1
    np.testing.assert_allclose(batch["advantages"][i], sign * adv * batch["loss_mask"][i],
                               rtol=1e-5)
  assert batch["turns"].tolist() == [1, 2, 1, 2]
  with pytest.raises(ValueError, match="longer than `length`=3"):
    episodes_to_batch(eps, pad_id=0, length=3, group_size=2)


def test_environment_tokens_contribute_nothing_to_the_loss_or_its_gradient():
  from jaxrl_llm import aggregate, ppo_policy_loss
  tok = CHAR.tokenizer
  backend = _scripted(lambda e, k, p: tok.encode("abc") + [tok.eos_id])
  eps = run_episodes(backend, CHAR, [Chatter(), Chatter(turns=2)], max_turns=3,
                     max_new_tokens=6, max_len=64)
  batch = episodes_to_batch(eps, pad_id=tok.pad_id, group_size=2)
  rng = np.random.default_rng(0)
  logp = rng.normal(size=batch["tokens"].shape).astype(np.float32)

  def loss(logp):
    per_token, _ = ppo_policy_loss(logp, batch["rollout_logp"], batch["advantages"],
                                   batch["loss_mask"])
    return aggregate(per_token, batch["loss_mask"], "token-mean")

  grad = np.asarray(jax.grad(loss)(logp))
  assert np.all(grad[batch["loss_mask"] == 0] == 0) and np.any(grad != 0)
  shuffled = np.where(batch["loss_mask"] == 1, logp, rng.normal(size=logp.shape))
  assert float(loss(shuffled.astype(np.float32))) == float(loss(logp))


# ------------------------------------------------------------- chat templates (TITO)

_CORPUS = ["What is 811*87+181? Answer as <answer>N</answer>.", "Solve the problem. You "
           "may call the calculator tool. Give the final answer as <answer>N</answer>.",
           '{"name": "calculator", "arguments": {"expression": "811*87+181"}}',
           "system user assistant tool ipython Cutting Knowledge Date Today Environment",
           "Guess my number between 1 and 100. Reply with one number; higher lower left"]


def _template(name):
  spec = importlib.util.find_spec("trl")
  if spec is None or not spec.submodule_search_locations:
    pytest.skip("the Qwen3 / Llama-3.1 chat templates are read from trl's package data "
                "(pip install trl)")
  path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
  return (path / f"{name}.jinja").read_text()


def _tokenizer(family):
  """A byte-level BPE (480 tokens) with the family's special tokens and template."""
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  if family == "qwen3":
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    plain = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>",
             "</tool_response>"]
    named = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    template, extra = _template("qwen3"), []
  else:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
    plain = []
    named = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    template, extra = _template("llama3_1"), ["<|end_of_text|>", "<|eom_id|>"]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(_CORPUS * 5, trainers.BpeTrainer(
      vocab_size=480, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
  return HFTokenizer(tok, special_tokens=named, chat_template=template,
                     extra_eos_ids=[tok.token_to_id(t) for t in extra])


def _calculator_script(tok, family, answer, expression):
  """Three turns: two tool calls, then the answer; turn 1 tokenized in two pieces (not
  the canonical tokenization of its text: re-encoding it would change its ids)."""
  if family == "qwen3":
    call = ('<think>\nI will use the calculator.\n</think>\n\n<tool_call>\n{"name": '
            '"calculator", "arguments": {"expression": "EXPR"}}\n</tool_call>')
    final = f"<think>\nDone.\n</think>\n\n<answer>{answer}</answer>"
  else:
    call = '{"name": "calculator", "parameters": {"expression": "EXPR"}}'
    final = f"<answer>{answer}</answer>"
  stop = tok.eos_id
  first = call.replace("EXPR", expression)
  cut = first.index("calc") + 3
  turns = [tok.encode(first[:cut]) + tok.encode(first[cut:]) + [stop],
           tok.encode(call.replace("EXPR", "1+1")) + [stop], tok.encode(final) + [stop]]
  assert tok.encode(tok.decode(turns[0][:-1])) != turns[0][:-1]   # non-canonical ids
  return lambda e, k, prompt: turns[k]


@pytest.mark.parametrize("family", ["qwen3", "llama3.1"])
def test_template_episodes_are_the_sampled_ids_and_the_templates_turns(family):
  tok = _tokenizer(family)
  chat = TemplateChat(tok)
  parser = "hermes" if family == "qwen3" else "llama3_json"
  env = CalculatorEnv(parser=parser)
  expression, answer = env.question(3)
  backend = _scripted(_calculator_script(tok, family, answer, expression))
  [ep] = run_episodes(backend, chat, [env], seeds=[3], max_turns=4, max_new_tokens=96,
                      max_len=2048)
  sampled = backend.returned[0]
  assert_interleaved(ep, sampled)
  assert (ep.turns, ep.finish_reason, ep.turn_rewards) == (3, "done", [0.0, 0.0, 1.0])
  # the prompt is the template's rendering of the opening, with the tools' schemas
  opening = ep.messages[:2]
  tools = [env.tools[0].schema]
  assert ep.tokens[:ep.prompt_len].tolist() == chat.prompt_ids(opening, tools)
  prompt_text = chat.render(opening, add_generation_prompt=True, tools=tools)
  assert '"name": "calculator"' in prompt_text
  assert ("<tools>" in prompt_text) == (family == "qwen3")
  # tool results came back as the template's tool turns
  assert ep.messages[3] == {"role": "tool", "name": "calculator", "content": str(answer)}
  # The whole sequence reads as the template's rendering of the conversation (these
  # templates keep earlier turns as they were when tool turns follow), while its ids
  # are the sampled ones: the canonical encoding of that text differs.
  # (Qwen's close of the last turn is <|im_end|> and a newline; the model stops at the
  # first.)
  text = tok.tokenizer.decode(ep.tokens.tolist(), skip_special_tokens=False)
  newline = "\n" if family == "qwen3" else ""
  assert text + newline == chat.render(ep.messages, add_generation_prompt=False, tools=tools)
  assert tok.encode(text) != ep.tokens.tolist()
  # the environment turns are what the template writes after the model's stop id
  reply = ep.tokens[ep.turn_spans[0][1]:ep.turn_spans[1][0]].tolist()
  reply_text = tok.tokenizer.decode(reply, skip_special_tokens=False)
  if family == "qwen3":
    assert reply_text == (f"\n<|im_start|>user\n<tool_response>\n{answer}\n</tool_response>"
                          "<|im_end|>\n<|im_start|>assistant\n")
  else:
    assert reply_text == (f'<|start_header_id|>ipython<|end_header_id|>\n\n"{answer}"'
                          "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("family", ["qwen3", "llama3.1"])
def test_tools_render_as_transformers_renders_them(family):
  transformers = pytest.importorskip("transformers")
  tok = _tokenizer(family)
  ref = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer,
                                             chat_template=tok.chat_template,
                                             **tok.special_tokens)
  env = CalculatorEnv()
  opening, tools = env.reset(0), [t.schema for t in env.tools]
  tool_turn = [{"role": "assistant", "content": "ok"},
               {"role": "tool", "name": "calculator", "content": "42"}]
  for messages in (opening, opening + tool_turn):
    want = ref.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    assert TemplateChat(tok).render(messages, add_generation_prompt=True,
                                    tools=tools) == want


@pytest.mark.parametrize("family", ["qwen3", "llama3.1"])
def test_a_turn_without_its_stop_id_gets_the_templates_close(family):
  tok = _tokenizer(family)
  chat = TemplateChat(tok)
  close = "<|im_end|>" if family == "qwen3" else "<|eot_id|>"
  reply = [{"role": "user", "content": "lower (7 left)"}]
  cut = chat.continuation_ids(reply, tok.encode("50"))               # cut by its limit
  closed = chat.continuation_ids(reply, tok.encode("50") + [tok.eos_id])
  assert cut == [tok.tokenizer.token_to_id(close)] + closed
  if family == "llama3.1":    # <|eom_id|> (a stop id too) stands for the close as well
    eom = tok.tokenizer.token_to_id("<|eom_id|>")
    assert chat.continuation_ids(reply, tok.encode("50") + [eom]) == closed


def test_qwen3_re_rendering_drops_thinking_that_the_episode_keeps():
  """Qwen3's template drops an earlier assistant turn's reasoning once a user turn
  follows it: a conversation rendered again is not the one the model saw. The
  episode's ids are the sampled ones, thinking included."""
  tok = _tokenizer("qwen3")
  chat = TemplateChat(tok)
  env = GuessNumberEnv(low=1, high=100, max_guesses=3)
  env.reset(5)
  wrong = 1 if env.secret != 1 else 2
  turn = lambda k: tok.encode(f"<think>\nTry {k}.\n</think>\n\n{wrong}") + [tok.eos_id]
  backend = _scripted(lambda e, k, prompt: turn(k))
  [ep] = run_episodes(backend, chat, [env], seeds=[5], max_turns=3, max_new_tokens=64,
                      max_len=1024)
  assert_interleaved(ep, backend.returned[0])
  assert ep.finish_reason == "done" and ep.reward == 0.0
  text = tok.tokenizer.decode(ep.tokens.tolist(), skip_special_tokens=False)
  assert text.count("<think>\nTry ") == 3
  rendered = chat.render(ep.messages[:-1], add_generation_prompt=False)
  assert rendered.count("<think>\nTry ") == 1 and rendered != text


def test_template_chat_refuses_a_template_that_closes_turns_differently():
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  from tokenizers import Tokenizer, models

  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  vocab = {c: i for i, c in enumerate(["<e>", "[UNK]"])}
  raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  odd = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
         "{% if m.role == 'assistant' and loop.last %}<e>{% else %};{% endif %}{% endfor %}")
  chat = TemplateChat(HFTokenizer(raw, special_tokens={"eos_token": "<e>"},
                                  chat_template=odd))
  with pytest.raises(ValueError, match="closes an assistant turn with '<e>' when it is last "
                     "but with ';user:hi;'"):
    chat.continuation_ids([{"role": "user", "content": "hi"}], [0])
  with pytest.raises(ValueError, match="has no chat template"):
    TemplateChat(CHAR.tokenizer)


# ------------------------------------------------------- the built-in model, for real


def test_behaviour_logprobs_of_a_three_turn_episode_equal_teacher_forced_ones():
  from flax import nnx

  from jaxrl_llm.models import (
      Transformer,
      TransformerConfig,
      make_apply_fn,
      make_paged_decode_fns,
      split_model,
  )
  from jaxrl_llm.rollout import RolloutEngine
  from jaxrl_llm.train import policy_forward
  tok = CHAR.tokenizer
  graphdef, params = split_model(Transformer(TransformerConfig.tiny(tok.vocab_size),
                                             rngs=nnx.Rngs(0)))
  engine = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=4, max_len=128,
                         page_size=8)
  generate = engine_generate(engine, params, eos_ids=CHAR.stop_ids, seed=3,
                             temperature=1.0)
  eps = run_episodes(generate, CHAR, [Chatter(), Chatter()], seeds=[1, 2], max_turns=3,
                     max_new_tokens=8, max_len=128)
  batch = episodes_to_batch(eps, pad_id=tok.pad_id, group_size=2)
  logp, _, _ = policy_forward(make_apply_fn(graphdef), params, batch, temperature=1.0)
  mask = batch["loss_mask"] == 1
  for ep in eps:
    assert ep.turns == 3 and ep.finish_reason == "done"
  assert mask.sum() >= 6 and len({tuple(e.tokens) for e in eps}) == 2
  np.testing.assert_allclose(np.asarray(logp)[mask], batch["rollout_logp"][mask], atol=1e-4)
  assert np.all(batch["rollout_logp"][~mask] == 0)
  # the same seed draws the same episodes
  again = run_episodes(engine_generate(engine, params, eos_ids=CHAR.stop_ids, seed=3,
                                       temperature=1.0), CHAR, [Chatter(), Chatter()],
                       seeds=[1, 2], max_turns=3, max_new_tokens=8, max_len=128)
  for a, b in zip(eps, again):
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_kv_continuation_prefills_only_the_new_tokens_with_teacher_forced_logprobs():
  # The engine's prefix cache: turn k+1 reads the keys/values of the sequence up to
  # turn k's last sampled token from its pages (full pages of 8) and prefills the rest:
  # the last page's part, that token and the reply. Episodes, log-probs within float
  # rounding of those re-prefilled each turn, and teacher-forced within 1e-4.
  from flax import nnx

  from jaxrl_llm.models import (
      Transformer,
      TransformerConfig,
      make_apply_fn,
      make_paged_decode_fns,
      split_model,
  )
  from jaxrl_llm.rollout import RolloutEngine
  from jaxrl_llm.train import policy_forward
  tok = CHAR.tokenizer
  graphdef, params = split_model(Transformer(TransformerConfig.tiny(tok.vocab_size),
                                             rngs=nnx.Rngs(0)))
  engine = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=4, max_len=128,
                         page_size=8)
  runs = {}
  for cached in (False, True):
    generate = engine_generate(engine, params, eos_ids=CHAR.stop_ids, seed=3,
                               temperature=1.0, prefix_cache=cached)
    runs[cached] = run_episodes(generate, CHAR, [Chatter(), Chatter()], seeds=[1, 2],
                                max_turns=3, max_new_tokens=8, max_len=128)
  assert not engine.prefix_cache                 # a replica had the cache
  for plain, ep in zip(runs[False], runs[True]):
    assert ep.turns == 3 and ep.finish_reason == "done"
    np.testing.assert_array_equal(ep.tokens, plain.tokens)
    np.testing.assert_allclose(ep.behaviour_logprobs, plain.behaviour_logprobs, atol=2e-6)
    asked = [ep.prompt_len] + [start for start, _ in ep.turn_spans[1:]]
    reused = sum((end - 1) // 8 * 8 for _, end in ep.turn_spans[:-1])
    assert (plain.prefill_tokens, plain.reused_tokens) == (sum(asked), 0)
    assert (ep.prefill_tokens, ep.reused_tokens) == (sum(asked) - reused, reused)
    # Each later turn prefilled under a page, its last sampled token and the reply.
    replies = [start - end for (_, end), (start, _) in zip(ep.turn_spans, ep.turn_spans[1:])]
    assert ep.prefill_tokens - ep.prompt_len <= sum(replies) + 2 * 8
  batch = episodes_to_batch(runs[True], pad_id=tok.pad_id, group_size=2)
  logp, _, _ = policy_forward(make_apply_fn(graphdef), params, batch, temperature=1.0)
  mask = batch["loss_mask"] == 1
  np.testing.assert_allclose(np.asarray(logp)[mask], batch["rollout_logp"][mask], atol=1e-4)
