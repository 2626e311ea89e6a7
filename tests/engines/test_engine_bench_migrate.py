"""`gyre-hpc bench migrate`: JSON figures with the re-prefill baseline and the ratio, from one run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gyre_hpc.bench.migrate import DEFAULT_CONTEXTS, NEW_TOKENS, _engine, baseline_request, command, moving_request


def _check(result: dict, contexts: list[int], mpi: bool) -> None:
    assert result["benchmark"] == "migrate" and "re-prefill" in result["baseline"]
    assert sorted(map(int, result["contexts"])) == contexts
    for ctx, row in result["contexts"].items():
        prompt = result["prompt_tokens"][ctx]
        assert prompt == int(ctx) - NEW_TOKENS
        assert row["kv_tokens"] == prompt + 1          # prompt + 2 sampled - 1 in the cache
        assert row["kv_mb"] == pytest.approx((prompt + 1) * result["model"]["kv_bytes_per_token"] / 2**20)
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
    out = CliRunner().invoke(command, ["--contexts", "1024,40000"])
    assert out.exit_code != 0 and "at most 32768" in out.output


def test_every_default_context_fits_the_model():
    """The 32K default once asked for 32768 + 8 tokens of a 32768-position model and crashed; then
    the re-prefill baseline asked for 32768 + 1, and under mpiexec the other rank hung in a barrier."""
    from gyre_hpc.models.tiny_lm import build_model

    model = build_model("tiny", seed=0)
    for context in DEFAULT_CONTEXTS:
        moving, baseline = moving_request(context), baseline_request(context)
        assert moving.prompt_len + moving.params.max_new_tokens == context
        assert baseline.prompt_len + baseline.params.max_new_tokens == context
        assert baseline.prompt_ids[:-1] == moving.prompt_ids
        for request in (moving, baseline):
            _engine(model, "probe").submit(request)   # validates, does not run


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
