"""Must-show: a sequence migrated between TorchEngines in different MPI ranks mid-decode
continues exactly (greedy and seeded sampling), and its destination prefills nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_hpc.engines import Request, SamplingParams
from gyre_hpc.engines.torch_engine import TorchEngine

from engine_helpers import prompt
from mpi_migration_program import MAX_NEW, requests

HERE = Path(__file__).parent


def mpi_env() -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.mpi
def test_migration_across_ranks_continues_exactly_without_prefill(model_dir, other_model_dir, tmp_path):
    prompts = [list(prompt(i)) for i in range(4)]
    (Path(model_dir) / "prompts.json").write_text(json.dumps(prompts))
    out_path = tmp_path / "result.json"
    proc = subprocess.run(
        ["mpiexec", "-n", "3", "--oversubscribe", sys.executable, str(HERE / "mpi_migration_program.py"),
         str(model_dir), str(out_path), str(other_model_dir)],
        env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out_path.read_text())

    reference = TorchEngine.from_pretrained(model_dir, name="reference")
    expected = {r.request_id: reference.generate(r) for r in requests(prompts)}

    on_one = sorted(rid for rid, e in result["routed"].items() if e == 1)
    assert len(on_one) == 2, result["routed"]
    assert sorted(result["moved"]) == on_one and set(result["moved"].values()) == {2} and result["gone"] == []
    assert all(0 < n < MAX_NEW for n in result["tokens_at_move"].values()), result["tokens_at_move"]
    assert result["bytes"] > 0
    # After the flip back, engine 1 is empty, so least outstanding tokens routes to it, and
    # it decodes with the weights it was sent.
    assert result["back_engine"] == 1 and result["loaded_version"] == 2
    assert "has stopped serving" in result["stopped_refused"]
    back = result["outputs"]["back"]
    assert back["policy_version"] == 2
    other = TorchEngine.from_pretrained(other_model_dir).generate(
        Request("back", tuple(prompts[0]), SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=())))
    assert back["token_ids"] == list(other.token_ids)
    for rid, want in expected.items():
        got = result["outputs"][rid]
        assert got["token_ids"] == list(want.token_ids), rid
        assert got["logprobs"] == pytest.approx(list(want.logprobs), abs=1e-5), rid
        assert got["migrations"] == (1 if rid in on_one else 0), rid
    # Both greedy and seeded requests crossed ranks.
    assert {p.temperature for p in (r.params for r in requests(prompts) if r.request_id in on_one)} == {0.0, 0.9}
    before, after = result["dest_before"], result["dest_after"]
    assert after["prefill_tokens"] == before["prefill_tokens"], "the destination re-prefilled"
    assert after["migrations_in"] == before["migrations_in"] + 2
    assert result["final"]["1"]["migrations_out"] == 2
    decoded_after_move = sum(MAX_NEW - n for n in result["tokens_at_move"].values())
    assert after["decode_tokens"] - before["decode_tokens"] >= decoded_after_move


@pytest.mark.mpi
def test_import_that_does_not_fit_fails_naming_the_field_and_hangs_no_rank(model_dir, tmp_path):
    out_path = tmp_path / "result.json"
    proc = subprocess.run(
        ["mpiexec", "-n", "3", "--oversubscribe", sys.executable, str(HERE / "mpi_bad_import_program.py"),
         str(model_dir), str(out_path)],
        env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out_path.read_text())
    assert result["error"] is not None and "dtype=float32 (engine has float64)" in result["error"]
    assert "rank 2" in result["error"]
    assert result["source_out"] == 1 and result["dest_in"] == 0
