"""`gyre-hpc bench migrate`: JSON figures with the re-prefill baseline and the ratio, from one run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gyre_hpc.bench.migrate import command


def _check(result: dict, contexts: list[int], mpi: bool) -> None:
    assert result["benchmark"] == "migrate" and "re-prefill" in result["baseline"]
    assert sorted(map(int, result["contexts"])) == contexts
    for ctx, row in result["contexts"].items():
        assert row["kv_tokens"] == int(ctx) + 1          # prompt + 2 sampled - 1 in the cache
        assert row["kv_mb"] == pytest.approx((int(ctx) + 1) * result["model"]["kv_bytes_per_token"] / 2**20)
        assert row["reprefill_s"] > 0 and row["migrate_inprocess_s"] > 0
        assert row["speedup_inprocess"] == pytest.approx(row["reprefill_s"] / row["migrate_inprocess_s"])
        if mpi:
            assert row["speedup_mpi"] == pytest.approx(row["reprefill_s"] / row["migrate_mpi_s"])


def test_in_process_bench_prints_baseline_and_ratio():
    out = CliRunner().invoke(command, ["--json", "--contexts", "64,256", "--repeats", "2", "--no-mpi"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert result["transport"] == "in-process"
    _check(result, [64, 256], mpi=False)


def test_bad_contexts_are_named():
    out = CliRunner().invoke(command, ["--contexts", "1k"])
    assert out.exit_code != 0 and "--contexts" in out.output


@pytest.mark.mpi
def test_mpi_bench_times_the_transfer_between_two_ranks():
    gyre = str(Path(sys.executable).parent / "gyre-hpc")
    proc = subprocess.run([gyre, "bench", "migrate", "--json", "--contexts", "64,512",
                           "--repeats", "2", "--chunk-bytes", "65536"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))   # Python's environ: no MPI state another test's MPI_Init set
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["transport"] == "mpi+in-process", result.get("mpi_skipped")
    _check(result, [64, 512], mpi=True)
