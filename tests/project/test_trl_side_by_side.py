"""The bookkeeping of ``benchmarks/trl_side_by_side.py`` on made-up step rows (the runs
themselves need TRL and take an hour: ``benchmarks/RESULTS.md``)."""

import math

from benchmarks import trl_side_by_side as bench

SPEC = {"prompts": 2, "group": 2, "max_new_tokens": 16, "recipe": {"prompt_tokens": 10}}
PROC = {"wall_s": 9.0, "to_first_step_s": 5.0, "peak_rss_gb": 1.0, "vm_hwm_gb": 1.0,
        "cpu_s": 8.0}


def test_our_rows_leave_out_eval_and_count_tokens():
  rows = [{"step": 0, "setup_s": 1.0, "eval_s": 2.0, "step_s": 3.0},
          {"step": 1, "step_s": 10.0, "generate_s": 1.0, "update_s": 5.0,
           "old_logp_s": 1.0, "ref_s": 1.0, "score_s": 0.5, "response_length": 3.0,
           "compile_s": 4.0, "peak_rss_mb": 1024.0},
          {"step": 2, "step_s": 6.0, "eval_s": 1.0, "generate_s": 1.0, "update_s": 2.0,
           "old_logp_s": 0.5, "ref_s": 0.5, "score_s": 0.0, "response_length": 5.0,
           "peak_rss_mb": 2048.0}]
  s = bench._summary("jaxrl_llm", PROC, rows, SPEC)
  assert s["first_step_s"] == 10.0 and s["step_s"] == 5.0       # step 2 less its eval
  assert s["rollout_other_s"] == 1.0 and s["update_s"] == 2.0
  assert s["tokens_per_step_each"] == [12.0, 20.0] and s["width"] == 26
  assert s["loop_peak_rss_gb"] == 2.0 and s["eval0_s"] == 2.0


def test_table_ratios_ours_over_trl():
  ours = {"arm": "jaxrl_llm", "step_s": 2.0, "peak_rss_gb": 3.0}
  trl = [{"arm": "trl", "step_s": s, "peak_rss_gb": 1.5} for s in (3.0, 4.0, 100.0)]
  table, med = bench._table([ours, *trl])
  assert med["trl"]["step_s"] == 4.0                             # the median
  assert "| s / step after the first | 2 | 4 | 0.50 |" in table
  assert "| peak RSS, whole process (GiB) | 3 | 1.5 | 2.00 |" in table
  assert math.isnan(bench._mean([], "x"))
