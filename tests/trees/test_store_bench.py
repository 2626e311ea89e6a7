"""`gyre-hpc bench store --json` runs end to end on a small workload and reports consistent figures."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gyre_hpc.bench.store import synthetic_trees
from gyre_hpc.cli import main


def test_bench_store_prints_json_with_baseline_and_ratios():
    result = CliRunner().invoke(main, ["bench", "store", "--runs", "4", "--batch", "2", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    trees = synthetic_trees(4)
    assert out["workload"]["tokens"] == sum(t.n_tokens for t in trees)
    assert out["workload"]["appends"] == 2
    for section in ("append", "stream_read", "append_no_fsync", "stream_read_no_fsync"):
        fig = out[section]
        assert fig["store_s"] > 0 and fig["numpy_s"] > 0
        assert fig["store_tokens_per_s"] == pytest.approx(out["workload"]["tokens"] / fig["store_s"])
        assert fig["ratio_store_over_numpy"] == pytest.approx(fig["numpy_s"] / fig["store_s"])
    assert 0 < out["bytes_on_disk"]["store"] and 0 < out["bytes_on_disk"]["numpy"]


def test_bench_store_rejects_a_zero_batch():
    result = CliRunner().invoke(main, ["bench", "store", "--batch", "0", "--json"])
    assert result.exit_code != 0 and "--batch=0" in result.output
