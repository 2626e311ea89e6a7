"""``gyre-hpc bench xlong --small``: one RL step of xlong-mini runs through the real fleet, measured."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gyre_hpc.bench.xlong import bench_config, ends_inward
from gyre_hpc.bench.xlong_measure import (call_cost_summary, same_context_ratio, tail_ratio, whole_call_summary,
                                         window_calls)
from tests.rl.rl_helpers import REPO, mpi_env


def test_tail_ratio_compares_the_last_tenth_of_the_calls_with_the_first():
    costs = [1.0] * 10 + [5.0] * 80 + [2.0] * 10
    r = tail_ratio(costs)
    assert (r["first_ms"], r["last_ms"], r["last_over_first"]) == (1000.0, 2000.0, 2.0)
    assert tail_ratio([3.0])["last_over_first"] == 1.0
    s = call_cost_summary({"assemble_s": [0.1] * 20, "append_s": [0.2] * 20, "prefill_s": [0.3] * 19 + [0.6],
                           "prefill_tokens": [5] * 20, "context_tokens": list(range(20))})
    assert s["total"]["last_over_first"] == pytest.approx(0.75 / 0.6) and s["prefill_tokens"] == 100
    assert len(s["total_ms_by_decile"]) == 10 and s["total_s"] == pytest.approx(12.3)


def test_runs_are_measured_from_both_ends_of_their_lengths_inward():
    assert ends_inward([430, 654, 493, 614, 542, 435, 569, 499]) == [0, 1, 5, 3, 2, 6, 7, 4]
    assert ends_inward([3.0]) == [0] and ends_inward([]) == []
    order = ends_inward(list(range(9)))
    assert sorted(order) == list(range(9))
    # a drift in time: the first half of the order holds as much length as the second
    assert abs(sum(order[:4]) - sum(order[4:8])) <= 4


def test_time_builds_times_every_journal_both_ways_and_a_longer_run_takes_longer(tmp_path):
    import queue

    from gyre_hpc.bench.xlong_measure import time_builds
    from gyre_hpc.harness.journal import JournalWriter
    from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_journal

    paths = []
    for n in (40, 400):
        path = tmp_path / f"run{n}.journal"
        writer = JournalWriter.create(path, f"run{n}", "task")
        for call in synthetic_journal(SyntheticConfig(n_calls=n), seed=0):
            writer.append_call(call)
        writer.close()
        paths.append(str(path))
    q = queue.Queue()
    time_builds(paths, q)
    out = q.get()
    assert len(out["build_s"]) == len(out["build_whole_prompts_s"]) == 2
    assert 0 < out["build_s"][0] < out["build_s"][1]            # ten times the calls: more time, in turn
    assert out["build_s"][1] < out["build_whole_prompts_s"][1]   # increments beat every whole prompt


def test_window_calls_are_the_calls_tail_ratio_compares():
    assert window_calls(100) == set(range(10)) | set(range(90, 100))
    assert window_calls(101) == set(range(11)) | set(range(90, 101))      # a tenth rounded up, as tail_ratio
    assert window_calls(3) == {0, 2} and window_calls(1) == {0}
    costs = [1.0 if k in window_calls(57) else 100.0 for k in range(57)]   # what lies between is not compared
    assert tail_ratio(costs)["last_over_first"] == 1.0


def test_whole_call_summary_adds_the_engines_prefill_and_decode_to_the_loops_parts():
    s = whole_call_summary({"assemble_s": [0.1] * 20, "append_s": [0.2] * 20, "engine_s": [1.0] * 18 + [2.0, 3.0],
                            "context_tokens": list(range(20)), "decode_tokens": [4] * 20,
                            "reproduced": [True] * 19 + [False]})
    assert s["first_ms"] == pytest.approx(1300.0) and s["last_ms"] == pytest.approx(2800.0)
    assert s["last_over_first"] == pytest.approx(2800 / 1300) and s["engine"]["last_over_first"] == pytest.approx(2.5)
    assert (s["decode_tokens"], s["outputs_reproduced"], s["calls"]) == (80, 19, 20)
    assert s["total_s"] == pytest.approx(0.3 * 20 + 18 + 5) and len(s["ms_by_decile"]) == 10
    assert s["same_context_and_output_last_over_first"] is not None


def test_same_context_ratio_takes_the_window_out_and_keeps_growth_with_the_run():
    # Contexts climb within each window of 60 calls (the first 10% of the run is the first half
    # of one, the last 10% the second half): the plain ratio of a cost that follows the context
    # alone is > 1, at the same context it is 1.
    context = [200 + 50 * (k % 60) for k in range(300)]
    by_context = [1.0 + 0.001 * c for c in context]
    assert tail_ratio(by_context)["last_over_first"] > 1.3
    assert same_context_ratio(by_context, context) == pytest.approx(1.0)
    # A cost that also grows with k is seen: +1.0 over the run at a mean cost of ~3.65.
    grows = [x + k / 300 for k, x in enumerate(by_context)]
    mean_ctx = np.mean(context)
    want = (1 + 0.001 * mean_ctx + np.mean(np.arange(270, 300)) / 300) / (1 + 0.001 * mean_ctx + np.mean(np.arange(30)) / 300)
    assert same_context_ratio(grows, context) == pytest.approx(want)
    assert same_context_ratio([1.0, 2.0], [5, 6]) is None
    # A whole call's decode follows its output: late calls that write more cost more, and
    # with the output in the fit that is not charged to k.
    outputs = [10 + 40 * (k >= 250) * (k % 2) for k in range(300)]
    writes = [x + 0.02 * o for x, o in zip(by_context, outputs)]
    assert same_context_ratio(writes, context) > 1.1
    assert same_context_ratio(writes, context, outputs=outputs) == pytest.approx(1.0)


def test_bench_config_is_the_example_for_one_step_here(tmp_path):
    cfg = bench_config(REPO / "examples" / "xlong.yaml", tmp_path / "run", small=True, warmstart_cache=str(tmp_path))
    assert cfg["train"]["steps"] == 1 and cfg["launcher"] == "local" and cfg["run_dir"] == str(tmp_path / "run")
    assert cfg["rollout"]["tasks"] == "xlong-mini" and cfg["warmstart"]["cache_dir"] == str(tmp_path)
    assert cfg["warmstart"]["tasks"] == "xlong-mini"     # --small never builds the full suite's warm start
    full = bench_config(REPO / "examples" / "xlong.yaml", tmp_path / "run", small=False, warmstart_cache=None)
    assert full["rollout"]["tasks"] == "xlong-large" and full["warmstart"]["tasks"] == "xlong"
    assert full["rollout"]["tasks_per_step"] * full["rollout"]["runs_per_task"] >= 8


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_xlong_small_reports_runs_costs_growth_and_the_loss_against_the_reference(tmp_path):
    gyre = str(Path(sys.executable).with_name("gyre-hpc"))
    proc = subprocess.run([gyre, "bench", "xlong", "--json", "--small", "--out", str(tmp_path / "out"),
                           "--warmstart-cache", str(tmp_path / "ws")], capture_output=True, text=True, timeout=1500,
                          cwd=REPO, env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    runs = out["runs"]
    assert len(runs) == 4 and out["workload"]["suite"] == "xlong-mini"
    for r in runs:
        assert r["build_identical"] and r["calls"] >= 5 and len(r["call_cost"]["total_ms_by_decile"]) == 10
        assert r["context_tokens"] > r["tree_tokens"] > 0 and r["sharing_ratio"] > 1
        assert r["ended_by"] in ("finish", "turn_budget", "wall_clock", "failed", "other")
        assert r["call_cost"]["total"]["first_ms"] > 0 and r["call_cost"]["prefill_tokens"] > 0
        # The whole call replayed as the live one: the engine samples the journal's own output.
        whole = r["call_cost"]["whole_call"]
        assert whole["calls"] == r["calls"] and whole["outputs_reproduced"] == r["calls"]
        assert whole["replays"] == 2 and whole["replays_of_the_other_calls"] == 1
        assert whole["decode_tokens"] == r["output_tokens"] and whole["first_ms"] > r["call_cost"]["total"]["first_ms"]
    assert sum(out["summary"]["ended_by"].values()) == 4
    assert out["summary"]["controller_peak_rss_mb"] > 0 and out["summary"]["train_peak_rss_mb"] > 0
    groups = out["training"]["groups"]
    assert len(groups) == 2 and all(g["reported"] == g["micro_batches"] > 0 for g in groups)
    # The loss the fleet trained on, the trainer's packing recomputed, and the float64 reference.
    tr = out["training"]
    assert tr["step_loss_abs_diff_vs_trainer_forward"] < 1e-6 and tr["step_abs_diff_vs_reference"] < 1e-6
    assert tr["probe_rel_diff_vs_reference"] < 1e-5 and abs(tr["reference"]["probe"]) > 1e-3
    assert np.isfinite(out["vs_calls"]["build_s"]["growth_exponent"])
    assert out["time_s"]["warm_start_source"] == "build"           # xlong-mini's warm start is not shipped
    assert out["time_s"]["warm_start_built"] and out["time_s"]["bench"] > out["time_s"]["fleet"] > 0
