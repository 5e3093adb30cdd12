"""An OpenAI-compatible endpoint over a generation backend that records token-exact
trajectories.

Black-box agents (any code using the ``openai`` client, a ``verifiers`` environment)
call the model through ``/v1/chat/completions`` and ``/v1/completions``; every call's
prompt ids, sampled ids and behaviour log-probs are recorded, and the calls of one
conversation are chained token in / token out into one multi-turn
:class:`~jaxrl_llm.rollout.multiturn.Episode` that
:func:`~jaxrl_llm.rollout.multiturn.episodes_to_batch` trains on.

* :mod:`~jaxrl_llm.serve.server`: :func:`serve` -> :class:`Server` (the HTTP server,
  127.0.0.1 by default) and :class:`App` (the endpoints apart from HTTP).
* :mod:`~jaxrl_llm.serve.protocol`: OpenAI's request and response formats, checked and
  built; :class:`ApiError` (a 4xx / 5xx with OpenAI's JSON error body).
* :mod:`~jaxrl_llm.serve.recorder`: :class:`Recorder` (the calls, how a request is
  matched to the call it continues, ``take()`` -> episodes).
* :mod:`~jaxrl_llm.serve.batcher`: :class:`Batcher` (concurrent requests gathered into
  one backend call).

On the floor of the loop (docs/architecture.md): it uses ``rollout``, ``envs`` and the
core; only the command and the facade import it.

Examples:
  >>> from jaxrl_llm.envs import CHAT_CHARS, PlainChat
  >>> from jaxrl_llm.tasks.tokenizer import CharTokenizer
  >>> chat = PlainChat(CharTokenizer(CHAT_CHARS))
  >>> generate = lambda prompts, limits: [([chat.eos_id], [0.0]) for _ in prompts]
  >>> with serve(generate, chat, max_len=32) as server:
  ...   server.host, server.base_url.endswith("/v1")
  ('127.0.0.1', True)
"""

from jaxrl_llm.serve.batcher import BackendError, Batcher, takes_sampling
from jaxrl_llm.serve.protocol import ApiError, Choice, Sampling
from jaxrl_llm.serve.recorder import Call, Prefix, Recorder, chat_key
from jaxrl_llm.serve.server import DEFAULT_HOST, App, Server, serve

__all__ = ["serve", "Server", "App", "DEFAULT_HOST",
           "Recorder", "Call", "Prefix", "chat_key",
           "Batcher", "BackendError", "takes_sampling",
           "ApiError", "Choice", "Sampling"]
