"""The environment layer (jaxrl_llm.envs): the protocol's checks and registry, tools and
their parsers, the code sandbox, the built-in environments and the adapters."""

from __future__ import annotations

import os
import string
import warnings
from typing import Literal

import pytest

from jaxrl_llm.envs import (
    CODE_PROBLEMS,
    ENVS,
    CalculatorEnv,
    CodeTestEnv,
    GuessNumberEnv,
    GymTextEnv,
    ParsedTurn,
    StepResult,
    TextArenaEnv,
    Tool,
    ToolCall,
    calculator,
    check_max_turns,
    check_messages,
    check_step,
    extract_code,
    get_tool_parser,
    make_env,
    parse_hermes,
    parse_llama3_json,
    python_tool,
    run_python,
    tool_messages,
)

# --------------------------------------------------------------------- the protocol


@pytest.mark.parametrize("messages, says", [
    ("hello", "returned reset() of type str; it must be a list of message dicts"),
    ({"role": "user", "content": "x"}, "returned reset() of type dict"),
    ([["user", "x"]], "returned reset()[0] of type list; it must be a dict"),
    ([{"content": "x"}], "returned reset()[0] without 'role'"),
    ([{"role": "user"}], "returned reset()[0] without 'content'"),
    ([{"role": "user", "content": 7}], "returned reset()[0]['content'] of type int; it "
     "must be a str"),
    ([{"role": "user", "content": None}], "reset()[0]['content'] of type NoneType"),
    ([{"role": "", "content": "x"}], "returned reset()[0] with an empty 'role'"),
])
def test_messages_of_a_wrong_type_name_the_environment_and_the_field(messages, says):
  with pytest.raises(ValueError) as info:
    check_messages(messages, env="mine", field="reset()")
  assert str(info.value).startswith("environment 'mine' ") and says in str(info.value)


@pytest.mark.parametrize("result, says", [
    ((["x"], 1.0, True, {}), "returned step() of type tuple; it must be a StepResult"),
    (StepResult([{"role": "user", "content": b"x"}]),
     "step().messages[0]['content'] of type bytes"),
    (StepResult([], reward="1"), "step().reward = '1'; it must be a finite real number"),
    (StepResult([], reward=True), "step().reward = True"),
    (StepResult([], reward=float("inf")), "step().reward = inf"),
    (StepResult([], done=1), "step().done of type int; it must be a bool"),
    (StepResult([], info=[]), "step().info of type list; it must be a dict"),
])
def test_step_results_of_a_wrong_type_name_the_environment_and_the_field(result, says):
  with pytest.raises(ValueError) as info:
    check_step(result, env="mine")
  assert str(info.value).startswith("environment 'mine' ") and says in str(info.value)


def test_check_step_normalises_numbers():
  import numpy as np
  out = check_step(StepResult((), np.float32(0.5), np.bool_(True), {}), env="e")
  assert (out.messages, out.reward, out.done) == ([], 0.5, True)
  assert type(out.reward) is float and type(out.done) is bool


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_max_turns_below_one_is_refused(bad):
  with pytest.raises(ValueError, match="`max_turns` must be an int >= 1"):
    check_max_turns(bad)
  assert check_max_turns(3) == 3


def _raising_factory(**kwargs):
  raise RuntimeError("no GPU here\nsecond line")


@pytest.mark.parametrize("name, says", [
    ("nope", "unknown environment 'nope': one of ['calculator', 'code_tests', "
     "'guess_number'], gym:ID, textarena:ID or module:factory."),
    ("no_such_module_xyz:make", "environment 'no_such_module_xyz:make': cannot import "
     "module 'no_such_module_xyz' (ModuleNotFoundError: No module named "
     "'no_such_module_xyz')."),
    ("jaxrl_llm.envs.builtin:nope", "environment 'jaxrl_llm.envs.builtin:nope': module "
     "'jaxrl_llm.envs.builtin' has no callable 'nope'."),
    ("tests.envs.test_envs:_raising_factory",
     "environment 'tests.envs.test_envs:_raising_factory': its factory raised "
     "RuntimeError: no GPU here second line"),
    ("builtins:dict", "environment 'builtins:dict': the factory returned a dict, which has "
     "no reset(seed) and step(text)."),
    ("", "`name` must be a non-empty str"),
])
def test_make_env_errors_are_one_line_naming_it(name, says):
  with pytest.raises(ValueError) as info:
    make_env(name)
  assert str(info.value) == says or (says in str(info.value) and not name)
  assert "\n" not in str(info.value)


def test_make_env_builds_registered_and_user_environments():
  assert sorted(ENVS) == ["calculator", "code_tests", "guess_number"]
  env = make_env("calculator", max_value=9)
  assert isinstance(env, CalculatorEnv) and env.max_value == 9
  mine = make_env("jaxrl_llm.envs.builtin:GuessNumberEnv", high=5)
  assert isinstance(mine, GuessNumberEnv) and mine.high == 5
  with pytest.raises(ValueError, match=r"its factory raised TypeError: .*unexpected"):
    make_env("calculator", colour="red")


# --------------------------------------------------------------------------- tools


def _tool_fn(expression: str, digits: int = 2, mode: Literal["exact", "round"] = "exact",
             scale: float | None = None, tags: list[int] | None = None,
             flag: bool = False) -> str:
  """Evaluates something, in two lines of
  description.

  A second paragraph the schema leaves out.

  Args:
    expression: what to evaluate,
      over two lines.
    digits (int): how many digits.
    mode: exact or rounded.

  Returns:
    The value.
  """
  return f"{expression}|{digits}|{mode}|{scale}|{tags}|{flag}"


def test_a_tool_schema_comes_from_the_signature_and_docstring():
  t = Tool.from_function(_tool_fn)
  assert t.schema == {"type": "function", "function": {
      "name": "_tool_fn",
      "description": "Evaluates something, in two lines of description.",
      "parameters": {"type": "object", "required": ["expression"], "properties": {
          "expression": {"type": "string", "description": "what to evaluate, over two lines."},
          "digits": {"type": "integer", "description": "how many digits."},
          "mode": {"enum": ["exact", "round"], "description": "exact or rounded."},
          "scale": {"type": "number"},
          "tags": {"type": "array", "items": {"type": "integer"}},
          "flag": {"type": "boolean"}}}}}
  given = Tool.from_function(_tool_fn, name="calc", description="d",
                             parameters={"type": "object", "properties": {}})
  assert given.schema["function"]["name"] == "calc" and given.description == "d"
  with pytest.raises(ValueError, match="takes \\*xs; a tool's arguments are named"):
    Tool.from_function(lambda *xs: 0)
  with pytest.raises(ValueError, match="`name` must be an identifier-like str"):
    Tool.from_function(_tool_fn, name="two words")


def test_tool_schemas_match_transformers_get_json_schema():
  """The schema a chat template reads is the one transformers derives from the same
  function (it adds a "return" entry, which templates do not read)."""
  utils = pytest.importorskip("transformers.utils")

  def add(a: int, b: float = 0.5, names: list[str] = (), mode: str = "x") -> float:
    """Adds numbers.

    Args:
      a: the first term.
      b: the second
        term.
      names: some names.
      mode: a mode.
    """

  for fn in (add, calculator):
    theirs = utils.get_json_schema(fn)
    theirs["function"].pop("return", None)
    assert Tool.from_function(fn).schema == theirs


def test_calling_a_tool_never_raises():
  t = Tool.from_function(_tool_fn)
  assert t({"expression": "1+1", "digits": 3}) == "1+1|3|exact|None|None|False"
  assert t({"digits": 3}) == "Error: _tool_fn: missing required argument(s) ['expression']."
  assert t({"expression": "x", "colour": 1}).startswith(
      "Error: _tool_fn: unknown argument(s) ['colour']; _tool_fn takes ['digits', ")
  assert t({"expression": 3}) == ("Error: _tool_fn: argument 'expression' must be of JSON "
                                  "type string, got 3.")
  assert t({"expression": "x", "digits": True}).startswith("Error: _tool_fn: argument "
                                                           "'digits' must be of JSON type")
  assert t({"expression": "x", "mode": "loose"}) == (
      "Error: _tool_fn: argument 'mode' must be one of ['exact', 'round'], got \"loose\".")
  assert t(["x"]) == "Error: _tool_fn: the arguments must be a JSON object, got list."
  boom = Tool.from_function(lambda: 1 / 0, name="boom")
  assert boom({}) == "Error: boom raised ZeroDivisionError: division by zero"
  listed = Tool.from_function(lambda: [1, "a"], name="listed")
  assert listed({}) == '[1, "a"]'


HERMES = [
    # well-formed, one call, with text around it
    ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
     '"2+3"}}\n</tool_call>', "Let me compute.", [("calculator", {"expression": "2+3"})], 0),
    # several calls; arguments given as a JSON string (some models)
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b",'
     ' "arguments": "{\\"y\\": [2]}"}</tool_call>', "", [("a", {"x": 1}), ("b", {"y": [2]})],
     0),
    # malformed JSON beside a good call: an error entry, not an exception
    ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call><tool_call>{"name": "b", '
     '"arguments": {}}</tool_call>', "", [("b", {})], 1),
    # no name, arguments not an object, an unterminated block
    ('<tool_call>{"arguments": {}}</tool_call>', "", [], 1),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "", [], 1),
    ('answer soon <tool_call>{"name": "a", "arguments": {}}', "answer soon", [], 1),
    # no call at all
    ("<answer>5</answer>", "<answer>5</answer>", [], 0),
]


@pytest.mark.parametrize("text, content, calls, n_errors", HERMES)
def test_hermes_parser_fixtures(text, content, calls, n_errors):
  turn = parse_hermes(text)
  assert turn.content == content
  assert [(c.name, c.arguments) for c in turn.calls] == calls
  assert len(turn.errors) == n_errors
  assert turn.has_calls == bool(calls or n_errors)
  assert get_tool_parser("qwen3")(text) == get_tool_parser("qwen2.5")(text) == turn


LLAMA = [
    ('{"name": "calculator", "parameters": {"expression": "2+3"}}', [("calculator",
                                                                    {"expression": "2+3"})], 0),
    ('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})], 0),
    ('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}\n'
     '{"name": "h", "parameters": {}}', [("f", {"x": 1}), ("g", {}), ("h", {})], 0),
    ('{"name": "f", "parameters": {"x": 1}; {"name": "g"}', [], 1),        # malformed
    ('{"name": "f", "parameters": {}}; {"name": ', [("f", {})], 1),      # cut short
    ('{"parameters": {}}', [], 1),
    ("The answer is <answer>5</answer>.", [], 0),
]


@pytest.mark.parametrize("text, calls, n_errors", LLAMA)
def test_llama3_json_parser_fixtures(text, calls, n_errors):
  turn = parse_llama3_json(text)
  assert [(c.name, c.arguments) for c in turn.calls] == calls
  assert len(turn.errors) == n_errors
  assert turn.content == ("" if text.lstrip().startswith(("{", "<|python_tag|>{")) else text)
  assert get_tool_parser("llama3.1")(text) == turn


def test_tool_results_and_errors_become_tool_turns():
  add = Tool.from_function(lambda a, b: a + b, name="add")
  turn = ParsedTurn("", (ToolCall("add", {"a": 2, "b": 3}), ToolCall("sub", {})),
                    ("invalid JSON in a tool call",))
  assert tool_messages(turn, [add]) == [
      {"role": "tool", "name": "add", "content": "5"},
      {"role": "tool", "name": "sub", "content": "Error: unknown tool sub; the tools are "
       "['add']."},
      {"role": "tool", "name": "error", "content": "Error: invalid JSON in a tool call."}]
  with pytest.raises(ValueError, match="`parser` must be one of"):
    get_tool_parser("xml")


# ------------------------------------------------------------------------- sandbox

LIMITS = dict(timeout_s=2.0, memory_mb=256, max_output_bytes=4096)


def test_sandbox_runs_code_in_a_scratch_directory_that_is_removed():
  r = run_python("import os\nopen('notes.txt', 'w').write('kept')\n"
                 "print(os.getcwd()); print(open('notes.txt').read())", **LIMITS)
  assert r.ok and r.error is None and r.returncode == 0
  cwd, text = r.output.split()
  assert text == "kept" and os.path.basename(cwd).startswith("jaxrl-sandbox-")
  assert not os.path.exists(cwd)


def test_sandbox_sleep_forever_is_stopped_at_the_limit():
  r = run_python("import time\nprint('start', flush=True)\ntime.sleep(10**6)", **LIMITS)
  assert r.error == "timeout" and 2.0 <= r.elapsed_s < 6.0
  assert r.observation() == "start\nError: timed out after 2 s (the code was stopped)"


def test_sandbox_ten_gigabytes_is_a_memory_error():
  r = run_python("x = bytearray(10 * 1024**3)", **LIMITS)
  assert r.error == "memory" and "MemoryError" in r.output
  assert r.observation().endswith("Error: out of memory (the limit is 256 MiB)")


def test_sandbox_a_flood_of_output_is_truncated():
  r = run_python("import sys\nfor _ in range(10**6):\n  sys.stdout.write('x' * 100)",
                 **LIMITS)   # 100 MB
  assert r.error == "output" and r.truncated and len(r.output) == 4096
  assert r.elapsed_s < 5.0
  assert r.observation().endswith("Error: output truncated at 4096 bytes (the code was "
                                  "stopped)")


@pytest.mark.parametrize("code, event", [
    ("import os\nos.fork()", "os.fork"),
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
    ("import os\nos.system('true')", "os.system"),
    ("import socket\nsocket.socket()", "socket.__new__"),
    ("import socket\nsocket.getaddrinfo('example.com', 80)", "socket.getaddrinfo"),
])
def test_sandbox_refuses_processes_and_network(code, event):
  r = run_python(code, **LIMITS)
  assert r.error == "refused" and r.message == f"sandbox: {event} is not allowed"
  assert f"PermissionError: sandbox: {event} is not allowed" in r.output


def test_sandbox_refuses_writes_outside_its_scratch_directory(tmp_path):
  outside = tmp_path / "outside"
  kept = tmp_path / "kept.txt"
  kept.write_text("mine")
  for code in (f"open({str(outside)!r}, 'w').write('x')",
               f"import os\nos.open({str(outside)!r}, os.O_CREAT | os.O_WRONLY)",
               f"import os\nos.remove({str(kept)!r})",
               f"import os\nos.rename({str(kept)!r}, 'here.txt')",
               f"import os\nos.chdir({str(tmp_path)!r})\nopen('outside', 'a')",
               f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/outside', 'w')",
               f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
    r = run_python(code, **LIMITS)
    assert r.error == "refused", (code, r)
    assert "(outside the scratch directory) is not allowed" in r.message
  assert not outside.exists() and kept.read_text() == "mine"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


def test_sandbox_cpu_time_limit():
  r = run_python("while True: pass", timeout_s=5.0, cpu_s=1)
  assert r.error == "cpu" and r.elapsed_s < 4.0
  assert r.message == "CPU time limit of 1 s exceeded (the code was stopped)"


def test_sandbox_reports_an_exception_with_its_traceback():
  r = run_python("def f(x):\n  return x / 0\nf(1)", **LIMITS)
  assert r.error == "exception" and r.message == "the code raised ZeroDivisionError"
  assert r.output.startswith("Traceback (most recent call last):\n  File \"main.py\", line 3")
  assert "<string>" not in r.output and r.output.rstrip().endswith(
      "ZeroDivisionError: division by zero")
  assert run_python("import sys\nsys.exit(3)", **LIMITS).error == "exit"
  assert run_python("print(", **LIMITS).message == "the code raised SyntaxError"


def test_sandbox_argument_errors_and_the_python_tool():
  with pytest.raises(ValueError, match="`timeout_s` must be a positive number"):
    run_python("1", timeout_s=0)
  with pytest.raises(ValueError, match="`code` must be a str"):
    run_python(b"1")
  tool = python_tool(**LIMITS)
  assert tool.schema["function"]["parameters"]["required"] == ["code"]
  assert tool({"code": "print(2 ** 10)"}) == "1024\n"
  assert tool({"code": "1/0"}).endswith("Error: the code raised ZeroDivisionError")


# --------------------------------------------------------------- built-in environments


def test_calculator_evaluates_arithmetic_only():
  assert calculator("(12+3)*4") == "60" and calculator("7/2") == "3.5"
  assert calculator("2**10 - -1") == "1025" and calculator("9/3") == "3"
  assert calculator("1/0") == "Error: division by zero"
  assert calculator("2**1000").startswith("Error: cannot evaluate '2**1000': exponents")
  assert calculator("__import__('os')").startswith("Error: cannot evaluate")
  assert calculator("x + 1") == "Error: cannot evaluate 'x + 1': unsupported expression " \
                                "element Name"


def test_calculator_env_is_deterministic_and_scores_the_answer():
  env = CalculatorEnv()
  opening = env.reset(11)
  assert opening == CalculatorEnv().reset(11) and opening != env.reset(12)
  expression, answer = env.question(12)
  assert opening[0]["role"] == "system" and env.tools[0].name == "calculator"
  call = ('<tool_call>{"name": "calculator", "arguments": {"expression": "EXPR"}}'
          '</tool_call>').replace("EXPR", expression)
  out = env.step(call)
  assert out == StepResult([{"role": "tool", "name": "calculator", "content": str(answer)}],
                           0.0, False, {"tool_calls": 1, "tool_errors": 0})
  bad = env.step('<tool_call>{"name": "calculator", "arguments": {</tool_call>')
  assert bad.messages[0]["content"].startswith("Error: invalid JSON in a tool call")
  assert not bad.done
  assert env.step(f"so <answer>{answer}</answer>").reward == 1.0
  assert env.step(f"<answer>{answer + 1}</answer>") == StepResult([], 0.0, True,
                                                                   {"answered": True})
  assert env.step(f"{answer}") == StepResult([], 0.0, True, {"answered": False})
  llama = CalculatorEnv(parser="llama3_json")
  llama.reset(12)
  msg = llama.step('{"name": "calculator", "parameters": {"expression": "2*21"}}').messages
  assert msg == [{"role": "tool", "name": "calculator", "content": "42"}]


def test_guess_number_gives_feedback_and_rewards_fewer_guesses():
  env = GuessNumberEnv(low=1, high=100, max_guesses=8)
  env.reset(5)
  secret = env.secret
  assert GuessNumberEnv().reset(5) == env.reset(5) and env.secret == secret
  low, high, rewards = 1, 100, []
  while True:     # binary search finds it within 7 guesses
    guess = (low + high) // 2
    out = env.step(f"I guess {guess}")
    rewards.append(out.reward)
    if out.done:
      break
    hint = out.messages[0]["content"]
    assert hint.startswith("higher" if guess < secret else "lower")
    low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
  assert rewards[-1] == pytest.approx(0.9 ** (len(rewards) - 1)) and sum(rewards[:-1]) == 0
  env.reset(5)
  assert env.step("no idea").messages[0]["content"] == (
      "Reply with one number between 1 and 100. (7 left)")
  assert env.step(str(secret)).reward == pytest.approx(0.9)
  short = GuessNumberEnv(max_guesses=1)
  short.reset(5)
  out = short.step(str(secret % 100 + 1))
  assert out.done and out.reward == 0.0 and f"it was {secret}" in out.messages[0]["content"]


SOLUTIONS = {
    "f": "import re\ndef f(x):\n  k, m = map(int, re.findall(r'\\d+', TEXT))\n  return k*x + m",
    "count": "def count(s):\n  return s.count(TEXT.split('letter ')[1][0])",
    "clip": "import re\ndef clip(x):\n  lo, hi = map(int, re.findall(r'-?\\d+', TEXT))\n"
            "  return min(max(x, lo), hi)",
    "second": "def second(xs):\n  return sorted(xs)[-2] if len(xs) > 1 else None",
}


def test_code_env_every_problem_family_is_solvable():
  env = CodeTestEnv(timeout_s=5.0)
  seen = set()
  for seed in range(12):
    env.reset(seed)
    problem = env.problem
    code = f"TEXT = {problem.text!r}\n" + SOLUTIONS[problem.function]
    assert env.run_tests(code) == (1.0, f"{len(problem.tests)}/{len(problem.tests)} tests "
                                   "passed."), problem
    seen.add(problem.function)
  assert seen == set(SOLUTIONS) and len(CODE_PROBLEMS) == 4


def test_code_env_rewards_telescope_to_the_last_pass_rate():
  env = CodeTestEnv(max_attempts=3, timeout_s=2.0)
  opening = env.reset(0)
  assert opening == CodeTestEnv().reset(0)
  problem = env.problem
  assert problem.function == "second"
  first = env.step("```python\ndef second(xs):\n  return max(xs)\n```")
  assert not first.done and first.info["pass_rate"] < 1.0
  assert first.reward == first.info["pass_rate"]
  assert first.messages[0]["content"].startswith(
      f"{round(first.reward * 4)}/4 tests passed.\nFAILED second(")
  broken = env.step("```python\ndef second(xs) return 1\n```")
  assert broken.reward == -first.reward and "SyntaxError" in broken.messages[0]["content"]
  last = env.step("```python\n" + SOLUTIONS["second"] + "\n```")
  assert last.done and last.reward == 1.0
  assert first.reward + broken.reward + last.reward == 1.0
  hang = CodeTestEnv(timeout_s=1.0)
  hang.reset(0)
  out = hang.step("```python\nwhile True: pass\n```")
  assert out.reward == 0.0 and "timed out after 1 s" in out.messages[0]["content"]
  assert extract_code("no fence") == "no fence"


# ------------------------------------------------------------------------ adapters


def _gym_env_class():
  gymnasium = pytest.importorskip("gymnasium", reason="gymnasium is not installed "
                                  "(pip install 'jaxrl_llm[envs]')")

  class Countdown(gymnasium.Env):
    """Says a number; the agent must say the one below it; 3 right answers win."""
    observation_space = gymnasium.spaces.Text(64, charset=string.printable)
    action_space = gymnasium.spaces.Text(64, charset=string.printable)

    def __init__(self, as_int=False):
      self.as_int = as_int

    def reset(self, *, seed=None, options=None):
      super().reset(seed=seed)
      self.n = int(self.np_random.integers(10, 99))
      self.right = 0
      return (self.n if self.as_int else f"say {self.n - 1}"), {}

    def step(self, action):
      ok = action.strip() == str(self.n - 1)
      self.right += ok
      self.n -= 1
      return f"say {self.n - 1}", float(ok), self.right == 3, False, {"ok": ok}

  return gymnasium, Countdown


def test_gymnasium_text_env_adapter():
  gymnasium, countdown = _gym_env_class()
  env = GymTextEnv(countdown(), system_prompt="Count down.")
  opening = env.reset(0)
  assert opening[0] == {"role": "system", "content": "Count down."}
  assert opening == GymTextEnv(countdown(), system_prompt="Count down.").reset(0)
  n = int(opening[1]["content"].split()[1])
  rewards = []
  for k in range(3):
    out = env.step(str(n - k))
    rewards.append(out.reward)
    assert out.info["ok"] and out.info["truncated"] is False
  assert rewards == [1.0, 1.0, 1.0] and out.done
  with warnings.catch_warnings(), pytest.raises(
      ValueError, match="environment 'Countdown' returned a reset\\(\\) observation of type "
      "int; a text environment's must be a str"):
    warnings.simplefilter("ignore")    # gymnasium's checker warns first
    GymTextEnv(countdown(as_int=True)).reset(0)
  gymnasium.register(id="JaxrlTestCountdown-v0", entry_point=countdown)
  made = make_env("gym:JaxrlTestCountdown-v0", system_prompt="hi")
  assert isinstance(made, GymTextEnv) and made.name == "JaxrlTestCountdown-v0"
  assert made.reset(1)[1]["content"].startswith("say ")


def test_textarena_single_player_game_adapter():
  pytest.importorskip("textarena", reason="textarena is not installed (pip install "
                      "'jaxrl_llm[envs]')")
  env = make_env("textarena:GuessTheNumber-v0")
  assert isinstance(env, TextArenaEnv) and env.name == "GuessTheNumber-v0-raw"
  opening = env.reset(3)
  assert opening == TextArenaEnv("GuessTheNumber-v0").reset(3)
  assert len(opening) == 1 and "Guess The Number" in opening[0]["content"]
  low, high = 1, 20
  for _ in range(10):
    guess = (low + high) // 2
    out = env.step(f"[{guess}]")
    if out.done:
      break
    text = out.messages[0]["content"]
    assert "higher" in text or "lower" in text
    low, high = (guess + 1, high) if "higher" in text else (low, guess - 1)
  assert out.done and out.reward == 1.0 and out.messages == []
