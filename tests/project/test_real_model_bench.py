"""The bookkeeping of ``benchmarks/real_model.py`` on made-up rows (the runs train the
real SmolLM2 for about an hour: ``benchmarks/RESULTS.md``)."""

import json

import pytest

from benchmarks import real_model as bench

SPEC = {"eval_size": 200, "target": 0.25, "task": "chain_sum", "steps": 2, "prompts": 2,
        "group": 2, "max_new_tokens": 8, "seed": 3, "lr": 1e-5, "kl": 0.0,
        "eval_every": 2}


def test_wilson_interval_pins():
  assert bench.wilson(0, 10)[0] == pytest.approx(0.0, abs=1e-12)
  lo, hi = bench.wilson(33, 200)                # 0.165: the base model on chain_sum
  assert (round(lo, 4), round(hi, 4)) == (0.12, 0.2227)   # by hand: 0.17131 -+ 0.05135
  lo, hi = bench.wilson(100, 100)
  assert hi == pytest.approx(1.0) and round(lo, 4) == 0.963


def test_curves_leave_out_eval_and_find_the_target():
  rows = [{"step": 0, "eval_accuracy": 0.165, "eval_s": 50.0, "step_s": 60.0},
          {"step": 1, "step_s": 30.0, "eval_s": 0.0, "reward": 0.1, "adv_std": 1.0,
           "adv_raw_var": 0.2, "response_length": 20.0, "peak_rss_mb": 2048.0},
          {"step": 2, "step_s": 70.0, "eval_s": 50.0, "save_s": 5.0, "reward": 0.3,
           "adv_std": 0.5, "adv_raw_var": 0.4, "eval_accuracy": 0.3}]
  c = bench._curves("grpo", rows, SPEC)
  assert (c["acc_start"], c["acc_end"], c["steps_to_target"]) == (0.165, 0.3, 2)
  assert c["step_s"] == 15.0 and c["first_step_s"] == 30.0      # 70 - eval - save
  assert [p["wall_s"] for p in c["curve"]] == [0.0, 30.0, 45.0]
  assert c["adv_var"] == pytest.approx(0.625) and c["adv_raw_var"] == pytest.approx(0.3)
  assert c["peak_rss_gb"] == 2.0
  trl = bench._curves("trl", rows, SPEC)
  assert trl["step_s"] == 70.0          # TRL's rows time the step without its eval


def test_table_and_commands():
  run = {"arm": "grpo", "task": "chain_sum", "seed": 0, "acc_start": 0.165,
         "acc_end": 0.3, "ci_start": bench.wilson(33, 200), "step_s": 20.0,
         "adv_var": 0.5, "adv_raw_var": 0.1, "steps_to_target": 30}
  table = bench._table([run, dict(run, seed=1, acc_end=0.2, steps_to_target=None)], SPEC)
  assert "| chain_sum | grpo | 2 | 0.165 -> 0.250 [" in table
  assert "| no | 20.0 | 0.5 / 0.1 | 30, - |" in table      # seed 1 stayed inside
  failed = {"arm": "trl", "task": "chain_sum", "seed": 0, "error": "exited -9"}
  assert table + "\nfailed: chain_sum trl seed 0: exited -9" == bench._table(
      [run, dict(run, seed=1, acc_end=0.2, steps_to_target=None), failed], SPEC)
  cmd = bench._ours_cmd("ppo_dynclip", SPEC, "OUT")
  assert cmd[cmd.index("--task") + 1] == "rg:chain_sum"
  assert cmd[cmd.index("--clip-end") + 1] == "0.05"
  assert "--old-logp-from-step" not in cmd and cmd[cmd.index("--kl-mode") + 1] == "none"
  assert "--old-logp-from-step" in bench._ours_cmd("grpo", SPEC, "OUT")
  assert "--kl-coef" in bench._ours_cmd("grpo", dict(SPEC, kl=0.001), "OUT")


def test_every_arm_is_a_valid_command():
  """Each arm's ``jaxrl-llm train`` command, with and without a KL term, parses and
  resolves (a value head cannot take ``--old-logp-from-step``: the PPO arms go
  without it)."""
  import jaxrl_llm.cli as cli
  from jaxrl_llm.loop.resolve import resolve
  parser = cli.build_parser()
  for arm in (a for a in bench.ARMS if a != "trl"):
    for spec in (SPEC, dict(SPEC, kl=0.001)):
      cmd = bench._ours_cmd(arm, spec, "OUT")
      argv = cmd[cmd.index("train"):]
      resolve(cli.run_config_from_args(parser.parse_args(argv)))


def test_tables_from_saved_runs_later_files_win(tmp_path, capsys):
  run = {"arm": "grpo", "task": "chain_sum", "seed": 0, "acc_start": 0.165,
         "acc_end": 0.3, "ci_start": bench.wilson(33, 200), "step_s": 20.0,
         "adv_var": None, "adv_raw_var": None, "steps_to_target": None}
  first, second = tmp_path / "a.json", tmp_path / "b.json"
  first.write_text(json.dumps([{"arm": "trl", "task": "chain_sum", "seed": 0,
                                "error": "exited -9"}, run]))
  second.write_text(json.dumps([dict(run, arm="trl", acc_end=0.25)]))
  bench.main(["--table", str(first), str(second)])
  out = capsys.readouterr().out
  assert "| chain_sum | trl | 1 | 0.165 -> 0.250" in out and "failed" not in out
  assert "| chain_sum | grpo | 1 | 0.165 -> 0.300" in out
