"""``gyre-hpc bench switch``: the figures it derives, and one real run through the CLI."""
import json
import subprocess
import sys

import pytest

from cells_mpi import mpi_env
from gyre_hpc.bench.switch import summarize

RAW = {
    "raw_send_s": [0.5, 0.4, 0.6], "raw_bytes": 100 << 20, "world_size": 4, "exit_code": 0,
    "flips": [
        {"to": "TRAIN", "duration_s": 1.0, "comm_s": 0.5, "transfer_s": 0.5, "bytes": 100 << 20},
        {"to": "TRAIN", "duration_s": 2.0, "comm_s": 0.4, "transfer_s": 1.0, "bytes": 100 << 20},
        {"to": "TRAIN", "duration_s": 4.0, "comm_s": 0.1, "transfer_s": 2.0, "bytes": 100 << 20},
        {"to": "ROLLOUT", "duration_s": 0.1, "comm_s": 0.1, "transfer_s": 0.0, "bytes": 0},
        {"to": "ROLLOUT", "duration_s": 0.3, "comm_s": 0.3, "transfer_s": 0.0, "bytes": 0},
    ],
}


def test_summary_takes_medians_and_divides_by_the_baseline():
    s = summarize(RAW, 100.0, "local")
    assert s["flips"] == {"rollout_to_train": 3, "train_to_rollout": 2}
    assert s["rollout_to_train_s"]["median"] == 2.0
    assert s["train_to_rollout_s"]["median"] == pytest.approx(0.2)
    assert s["rollout_to_train_s"]["comm_s_median"] == 0.4
    assert s["rollout_to_train_s"]["transfer_s_median"] == 1.0
    assert s["weight_transfer_MBps"]["median"] == 100.0          # 100 MB over the 1.0 s transfer
    assert s["weight_transfer_MBps"]["whole_flip_median"] == 50.0  # over the whole 2.0 s flip
    assert s["baseline"]["MBps"] == 200.0
    assert s["ratio"]["transfer_MBps_over_baseline_MBps"] == 0.5
    assert s["ratio"]["rollout_to_train_s_over_baseline_s"] == 4.0


def test_summary_reports_engine_weight_sync_against_a_raw_bcast_of_the_same_bytes():
    s = summarize({**RAW, "engine_sync_s": [1.0, 0.5, 2.0], "raw_bcast_s": [0.4, 0.4, 0.4], "engines": 2},
                  100.0, "local")
    sync = s["engine_weight_sync"]
    assert sync["MBps"] == 100.0 and sync["raw_bcast"]["MBps"] == 250.0
    assert sync["ratio_MBps_over_raw_bcast"] == pytest.approx(0.4)
    assert sync["ratio_pairs_median"] == pytest.approx(0.4)     # pairs 0.4, 0.8, 0.2
    assert sync["ratio_of_best"] == pytest.approx(0.8)          # 0.4 / 0.5
    assert "engine_weight_sync" not in summarize(RAW, 100.0, "local")


def test_summary_refuses_a_run_without_flips_both_ways():
    with pytest.raises(RuntimeError, match="0 train->rollout"):
        summarize({**RAW, "flips": RAW["flips"][:3]}, 100.0, "local")


@pytest.mark.mpi
@pytest.mark.slow   # one fleet launch with real bytes
def test_bench_switch_cli_prints_json_with_baseline_and_ratio(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "bench", "switch",
                           "--json", "--state-mb", "8",
                           "--flips", "2", "--keep", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=mpi_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["flips"]["rollout_to_train"] >= 2 and out["flips"]["train_to_rollout"] >= 2
    assert out["weight_transfer_MBps"]["bytes_per_flip"] >= 8 << 20
    assert out["rollout_to_train_s"]["median"] > 0 and out["baseline"]["MBps"] > 0
    assert out["ratio"]["transfer_MBps_over_baseline_MBps"] == pytest.approx(
        out["weight_transfer_MBps"]["median"] / out["baseline"]["MBps"])
    sync = out["engine_weight_sync"]
    assert sync["MBps"] > 0 and sync["ratio_MBps_over_raw_bcast"] == pytest.approx(
        sync["MBps"] / sync["raw_bcast"]["MBps"])


@pytest.mark.mpi
@pytest.mark.slow   # one fleet launch
def test_bench_switch_with_model_moves_the_checkpoints_float32_bytes(tmp_path):
    from gyre_hpc.models.checkpoint import save_pretrained
    from gyre_hpc.models.decoder import build_model

    model = build_model("small", seed=0)
    save_pretrained(model, tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "bench", "switch",
                           "--json", "--model", str(tmp_path / "ckpt"), "--flips", "1"],
                          capture_output=True, text=True, timeout=300, env=mpi_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["state_mb"] == pytest.approx(model.n_params * 4 / (1 << 20))
    assert out["model"]["params"] == model.n_params and out["model"]["weights"] == "checkpoint ckpt"
    assert out["weight_transfer_MBps"]["bytes_per_flip"] >= model.n_params * 4


@pytest.mark.slurm
@pytest.mark.slow   # one srun het step over the virtual nodes
def test_bench_switch_runs_as_one_srun_pmix_world_across_virtual_nodes(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "bench", "switch",
                           "--json", "--launcher", "slurm", "--state-mb", "4", "--flips", "1",
                           "--keep", str(tmp_path / "run"), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, env=mpi_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["launcher"] == "slurm" and out["world_size"] == 4
    assert out["command"].startswith("srun -v --mpi=pmix")
    nodelists = [part.split("--nodelist ")[1].split()[0] for part in out["command"].split(" : ")]
    assert len(set(nodelists)) >= 3          # controller and cells spread over >= 3 virtual nodes
    assert out["flips"]["rollout_to_train"] >= 1 and out["flips"]["train_to_rollout"] >= 1
    assert out["weight_transfer_MBps"]["bytes_per_flip"] >= 4 << 20
