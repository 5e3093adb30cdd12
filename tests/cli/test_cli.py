"""The command's fast path: flags are built, checked and explained without importing JAX.

``import jaxrl_llm`` is lazy (PEP 562): the public names load from their modules on
first access, and ``dir()`` / ``__all__`` are unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One subprocess (a fresh interpreter, nothing imported yet): builds the parser, prints
# both help texts, rejects each user mistake with a one-line error, and reports
# whether JAX was imported along the way.
_PROBE = r"""
import contextlib, io, json, sys, time
t0 = time.perf_counter()
import jaxrl_llm, jaxrl_llm.cli as cli
parser = cli.build_parser()
out = {"import_and_parser_s": time.perf_counter() - t0, "help": {}, "errors": {}}
for argv in (["--help"], ["train", "--help"]):
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
    cli.main(argv)
  out["help"][" ".join(argv)] = buf.getvalue()
for name, argv in {
    "eval_every": ["train", "--eval-every", "0"],
    "minibatches": ["train", "--num-minibatches", "3"],
    "temperature": ["train", "--temperature", "0"],
    "group_size": ["train", "--group-size", "1"],
    "eval_missing": ["eval", "--out", sys.argv[1]],
    "plot_missing": ["plot", sys.argv[1]],
}.items():
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    rc = cli.main(argv + (["--out", sys.argv[1]] if argv[0] == "train" else []))
  out["errors"][name] = (rc, err.getvalue())
out["jax_imported"] = sorted(m for m in ("jax", "jaxlib", "flax", "optax", "orbax")
                             if m in sys.modules)
out["total_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
  import json
  missing = str(tmp_path_factory.mktemp("cli") / "no_such_run")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  done = subprocess.run([sys.executable, "-c", _PROBE, missing], capture_output=True,
                        text=True, env=env, cwd=ROOT, timeout=120)
  assert done.returncode == 0, done.stderr
  result = json.loads(done.stdout.strip().splitlines()[-1])
  result["missing"] = missing
  return result


def test_help_and_flag_errors_import_no_jax(probe):
  assert probe["jax_imported"] == [], probe["jax_imported"]
  top, train = probe["help"]["--help"], probe["help"]["train --help"]
  assert "train" in top and "eval" in top and "plot" in top
  for text in ("--policy-loss", "--algo", "--temperature", "algorithms (--algo):",
               "tasks (--task):", "(default:"):
    assert text in train, text


def test_user_mistakes_end_in_one_line_errors_naming_the_flag(probe):
  expected = {"eval_every": "--eval-every", "minibatches": "--num-minibatches 3",
              "temperature": "--temperature", "group_size": "--group-size",
              "eval_missing": "does not exist", "plot_missing": "does not exist"}
  for name, needle in expected.items():
    rc, err = probe["errors"][name]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], (name, err)
    assert "Traceback" not in err, (name, err)
  assert not os.path.exists(probe["missing"])   # a refused start writes nothing


def static_imports(pkg) -> dict:
  """``{module: names}`` imported under ``if TYPE_CHECKING:`` in a package's source."""
  import ast
  with open(pkg.__file__) as f:
    tree = ast.parse(f.read())
  out: dict = {}
  for node in tree.body:
    if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
      for imp in node.body:
        assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
        out.setdefault(imp.module, set()).update(a.name for a in imp.names)
  return out


def test_lazy_package_namespace_is_the_eager_one():
  import jaxrl_llm
  import jaxrl_llm.loop
  import jaxrl_llm.train
  for pkg in (jaxrl_llm, jaxrl_llm.train, jaxrl_llm.loop):
    # The lazy table names what the static (TYPE_CHECKING) imports name, module by module.
    assert static_imports(pkg) == {m: set(n) for m, n in pkg._EXPORTS.items()}, pkg
    assert len(pkg.__all__) == len(set(pkg.__all__)), pkg.__name__
    assert set(pkg.__all__) <= set(dir(pkg)), pkg.__name__
    for name in pkg.__all__:
      assert getattr(pkg, name) is not None, (pkg.__name__, name)
  from jaxrl_llm.advantages import gae
  from jaxrl_llm.train.config import TrainConfig
  from jaxrl_llm.train.train_state import TrainState
  assert jaxrl_llm.gae is gae and TrainState is jaxrl_llm.TrainState
  assert TrainConfig is jaxrl_llm.TrainConfig is jaxrl_llm.train.TrainConfig
  # train/config.py holds TrainConfig alone: no lazy way back to the train state
  import jaxrl_llm.train.config
  assert not hasattr(jaxrl_llm.train.config, "TrainState")
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    jaxrl_llm.nope  # noqa: B018


def test_every_registered_loss_resolves_and_takes_its_keywords():
  import inspect

  from jaxrl_llm.train.registry import POLICY_LOSS_REGISTRY, register_policy_loss
  for spec in POLICY_LOSS_REGISTRY.values():
    params = inspect.signature(spec.fn).parameters
    assert set(spec.defaults) | set(spec.static) <= set(params), spec.name
  with pytest.raises(ValueError, match="has no keyword"):
    register_policy_loss("bad", lambda logp, old_logp, advantages, mask: None, tau=1.0)


def _readme_train_commands() -> list[list[str]]:
  """The ``jaxrl-llm train`` commands of README.md's bash blocks, as argv lists (not
  ``--help``, nor the placeholders ``...`` and ``$i``)."""
  import re
  import shlex
  with open(os.path.join(ROOT, "README.md")) as f:
    blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
  commands = []
  for block in blocks:
    for line in block.replace("\\\n", " ").splitlines():
      for part in line.split("&&"):
        words = shlex.split(part.split("#")[0])
        shown = not any(w in ("--help", "...") or "$" in w for w in words)
        if words[:2] == ["jaxrl-llm", "train"] and shown:
          commands.append(words[2:])
  return commands


def test_every_readme_train_command_parses_and_resolves():
  """Each ``jaxrl-llm train`` line the README shows (the real-model learning run among
  them) is a valid command: its flags parse, and the run resolves (no model is loaded)
  unless it names the reader's own files (a model folder or a dataset)."""
  import jaxrl_llm.cli as cli
  from jaxrl_llm.loop.resolve import resolve
  commands = _readme_train_commands()
  assert len(commands) >= 3
  assert any("smollm2-135m-instruct" in c and "rg:chain_sum" in c for c in commands)
  parser = cli.build_parser()
  for argv in commands:
    args = parser.parse_args(["train", *argv])
    own_files = args.dataset is not None or "/" in str(args.model)
    if not own_files:
      resolve(cli.run_config_from_args(args))
