import json

import pytest
from click.testing import CliRunner

from gyre_hpc.bench.trees import _per_path, _workload, command


def test_per_path_baseline_keeps_per_run_weights():
    runs, trees = _workload(n_runs=2, n_calls=12, seed=1)
    paths, weights = _per_path(runs, trees)
    assert len(paths) == 24 and weights.n_runs == 2
    # Each run's paths together weigh 1 / n_runs, like the run's tree.
    for r in range(2):
        mine = slice(12 * r, 12 * (r + 1))
        total = sum(int(p.trained.sum()) * w for p, w in zip(paths[mine], weights.run_weight[mine]))
        assert abs(total - 0.5) < 1e-12


@pytest.mark.slow  # two spawned processes importing torch: ~15 s on a busy 2-core box
def test_bench_prints_json_with_baseline_and_ratios():
    result = CliRunner().invoke(command, ["--json", "--runs", "2", "--calls", "12", "--row-tokens", "2048",
                                          "--repeats", "1"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    tok = out["tokens"]
    assert tok["expanded_paths"] > tok["tree"] > 0
    assert abs(tok["ratio"] - tok["expanded_paths"] / tok["tree"]) < 1e-12
    assert tok["packed_rows_per_path"] == tok["expanded_paths"]  # single paths never repeat context
    t = out["step_time_s"]
    assert t["per_path"] > 0 and t["tree"] > 0 and abs(t["ratio"] - t["per_path"] / t["tree"]) < 1e-12
    assert out["peak_mem_mb"]["per_path"] >= 0 and out["peak_mem_mb"]["tree"] >= 0
    assert out["trained_tokens"]["tree"] <= out["trained_tokens"]["per_path"]
    mfu = out["mfu"]   # each variant's FLOP rate over the GEMM rate measured in the same run
    for v in ("per_path", "tree"):
        assert mfu[v] > 0 and abs(mfu[v] - mfu["gflop_s"][v] / mfu["gflop_s"]["gemm"]) < 1e-12
        assert abs(mfu["gflop_s"][v] * 1e9 * t[v] - mfu["flops"][v]["total"]) <= 1e-6 * mfu["flops"][v]["total"]


def test_bench_refuses_a_single_run():
    result = CliRunner().invoke(command, ["--runs", "1"])
    assert result.exit_code != 0 and "--runs" in result.output


def test_bench_trains_the_checkpoint_named_by_model(tmp_path):
    """--model's weights are the ones trained: a checkpoint of the preset at the bench's seed
    gives the preset's loss and gradient to the bit, one at another seed does not."""
    import queue

    from gyre_hpc.bench.trees import _measure
    from gyre_hpc.models.checkpoint import save_pretrained
    from gyre_hpc.models.tiny_lm import build_model

    def measured(model_path):
        out = queue.Queue()
        _measure("tree", n_runs=2, n_calls=6, seed=3, preset="tiny", row_tokens=2048, queue=out,
                 model_path=model_path)
        got = out.get()
        return got["loss"], got["grad_norm"]

    for seed in (3, 4):
        save_pretrained(build_model("tiny", seed=seed), tmp_path / f"seed{seed}")
    preset = measured(None)
    assert measured(str(tmp_path / "seed3")) == preset
    assert measured(str(tmp_path / "seed4")) != preset
