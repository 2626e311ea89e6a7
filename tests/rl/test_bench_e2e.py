"""``gyre-hpc bench e2e`` end to end on a short run: real fleets per policy, then the simulator."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl.rl_helpers import REPO, mpi_env

@pytest.mark.mpi
@pytest.mark.slow
def test_bench_e2e_reports_each_policy_the_speedup_and_the_forecast(tmp_path):
    gyre = str(Path(sys.executable).with_name("gyre-hpc"))
    proc = subprocess.run([gyre, "bench", "e2e", "--json", "--steps", "2", "--policies", "elastic,async",
                           "--repeats", "1", "--launcher", "local", "--workload", "easy-3turn", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["launcher"].startswith("local")
    assert set(out["policies"]) == {"elastic", "async"}
    for name, p in out["policies"].items():
        assert len(p["step_s"]) == 2 and all(s > 0 for s in p["step_s"])
        assert abs(sum(p["busy"].values()) - 1.0) < 5e-3, p["busy"]   # fractions rounded to 3 places
        assert p["restarts"] == 0
        assert (tmp_path / f"{name}-0" / "trees.zarr").is_dir()
        assert p["repeats"]["steady_step_s"] == [p["steady_step_s"]]
    assert out["policies"]["async"]["flips"] == 0
    ratio = out["policies"]["async"]["steady_step_s"] / out["policies"]["elastic"]["steady_step_s"]
    assert out["speedup"]["elastic_over_async"]["of_means"] == pytest.approx(ratio, rel=1e-2)
    assert out["resources"]["cores"] >= 1
    sim = out["simulator"]
    assert set(sim["policies"]) == {"elastic", "async"}
    for p in sim["policies"].values():
        assert p["predicted_step_s"] > 0 and p["error"] == pytest.approx(
            abs(p["predicted_step_s"] - p["measured_step_s"]) / p["measured_step_s"], abs=2e-3)


def test_repeat_spread_and_ratio_spread():
    from gyre_hpc.bench.repeats import ratio_spread, spread

    s = spread([2.0, 3.0, 4.0])
    assert (s["mean"], s["min"], s["max"], s["spread"]) == (3.0, 2.0, 4.0, round(2 / 3, 3))
    r = ratio_spread([4.0, 6.0], [2.0, 2.0])
    assert (r["of_means"], r["min"], r["max"]) == (2.5, 2.0, 3.0)


def test_bench_e2e_refuses_a_comparison_without_elastic():
    gyre = str(Path(sys.executable).with_name("gyre-hpc"))
    proc = subprocess.run([gyre, "bench", "e2e", "--policies", "async,colocate"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode != 0 and "elastic included" in proc.stderr


def test_steady_steps_leave_out_the_warm_up_and_the_pipeline_drain():
    from gyre_hpc.bench.repeats import steady

    assert steady([9.0, 5.0, 6.0, 2.0]) == [5.0, 6.0]
    assert steady([9.0, 5.0, 2.0]) == [5.0]
    assert steady([9.0, 5.0]) == [5.0]
    assert steady([9.0]) == [9.0]


def test_slowest_run_share_is_the_steady_steps_slowest_run_over_the_step():
    import numpy as np

    from gyre_hpc.bench.e2e import slowest_run_share

    runs = {"step": np.array([1, 1, 2, 2, 3, 4]), "wall_s": np.array([9.0, 1.0, 3.0, 4.0, 2.0, 1.0])}
    steps = {"step": np.array([1, 2, 3, 4]), "wall_s": np.array([10.0, 5.0, 4.0, 8.0])}
    # step 1 (warm-up) and step 4 (the drain) left out: (4/5 + 2/4) / 2
    assert slowest_run_share(runs, steps) == 0.65
    # one step: it is all there is (as for the steady step time)
    assert slowest_run_share(runs, {"step": np.array([1]), "wall_s": np.array([10.0])}) == 0.9
    assert slowest_run_share(runs, {"step": np.array([5]), "wall_s": np.array([10.0])}) is None


def test_limits_name_the_saturated_resource_and_the_slowest_run_share():
    from gyre_hpc.bench.e2e import limits

    runs = {"elastic": [{"slowest_run_share": 0.9}, {"slowest_run_share": 0.8}],
            "async": [{"slowest_run_share": None}, {"slowest_run_share": 1.0}]}
    got = limits(runs, {"saturated": "cpu", "note": "load 9.0 on 2 cores"})
    assert got["saturated"] == "cpu" and got["slowest_run_share"] == {"elastic": 0.85, "async": 1.0}
    assert "cpu saturated" in got["note"] and "85%-85% of an on-policy step" in got["note"]
    assert limits(runs, {"saturated": None})["note"].startswith("the slowest run")
    runs["async"][0]["slowest_run_share"] = 1.5   # async's tail hides behind the next step's runs
    got = limits(runs, {"saturated": None})
    assert got["slowest_run_share"]["async"] == 1.25 and "async's slowest run is 125% of its step" in got["note"]


def test_long_workload_is_make_runs_config_with_the_policy_and_a_frozen_lr(tmp_path):
    from gyre_hpc.bench.e2e import workload_config, workload_summary
    from gyre_hpc.config import build_config, load_config

    cfg = build_config(workload_config(tmp_path / "r", "colocate", 2, 3, "long"))
    local = load_config(REPO / "examples" / "local.yaml")
    assert cfg.scheduler.policy == "colocate" and cfg.train.steps == 2 and cfg.seed == 3 and cfg.train.lr == 1e-7
    assert cfg.rollout == local.rollout and cfg.warmstart == local.warmstart and cfg.run_dir == str(tmp_path / "r")
    got = workload_summary("long", 2, 3)
    assert got["tasks"] == "long" and got["runs_per_step"] == 16 and got["warm_start"] is True
    assert workload_summary("easy-3turn", 2, 3)["tasks"] == "easy-3turn"


def test_bench_e2e_refuses_an_unknown_workload():
    gyre = str(Path(sys.executable).with_name("gyre-hpc"))
    proc = subprocess.run([gyre, "bench", "e2e", "--workload", "huge"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode != 0 and "huge" in proc.stderr and "long" in proc.stderr
