"""``gyre-hpc bench fuzz`` at a small size through the CLI: one JSON object on stdout, nothing escaped."""
from __future__ import annotations

import json

from click.testing import CliRunner

from gyre_hpc.cli import main
from gyre_hpc.harness.fuzz_cases import KINDS


def test_bench_fuzz_prints_only_json_with_every_kind_and_no_escape():
    r = CliRunner().invoke(main, ["bench", "fuzz", "--cases", "36", "--seed", "2", "--exec-share", "0", "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["cases"] == 36 and report["escaped"] == 0 and report["written_outside"] == []
    assert set(report["by_kind"]) == set(KINDS)
    assert report["executed"]["cases"] == len(KINDS)            # each kind's first case, no more at share 0
    assert report["executed"]["million_line_outputs"] == 1
    assert report["settings"]["seed"] == 2 and report["wall_s"]["total"] > 0
