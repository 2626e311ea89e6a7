"""scripts/bench_scaffolds.py: the harness and an outside scaffold side by side, as JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="openai is not installed (the test extra)")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (the endpoint extra)")

from gyre_hpc.harness.confine import isolation_mode  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow       # ~23 s here: six harness runs and one scaffold run on the tiny model
@pytest.mark.skipif(isolation_mode() == "plain", reason="no namespace jail can be made here")
def test_bench_scaffolds_prints_both_agents_and_their_ratio():
    script = f"{sys.executable} {REPO / 'tests/harness/scaffold_openai_client.py'}"   # it starts in the workspace
    proc = subprocess.run([sys.executable, "scripts/bench_scaffolds.py", "--runs", "1", "--scaffold", script,
                           "--max-new-tokens", "8"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    harness, scaffold = out["harness"], out["scaffold"]
    assert scaffold["calls_per_run"] == 3 and scaffold["reward_mean"] == 1.0 and scaffold["drift"] == 0
    assert scaffold["extends"] == 2 and 0 < scaffold["endpoint_overhead_share"] < 1
    assert out["ratio_scaffold_over_harness"]["calls_per_run"] == 3 / harness["calls_per_run"]
