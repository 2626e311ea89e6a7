"""The head's sbatch script: the committed file is the generator's output (golden), shapes follow the config."""
from __future__ import annotations

import subprocess

from gyre_hpc.config import build_config, load_config
from gyre_hpc.jobs.sbatch_script import render_head_script
from tests.jobs.slurm_jobs import REPO


def test_committed_script_is_the_generated_default_shape():
    expected = render_head_script(load_config(REPO / "examples/smoke.yaml"), job_name="gyre-head")
    committed = (REPO / "sbatch" / "gyre_head.sh").read_text()
    assert committed == expected, (
        "sbatch/gyre_head.sh differs from the generator; regenerate it with render_head_script("
        "load_config('examples/smoke.yaml'), job_name='gyre-head')")


def test_script_has_one_het_component_per_cell_after_the_head():
    cfg = build_config({"cells": {"count": 2, "ranks_per_cell": 2, "cpus_per_rank": 3, "mem_per_cell_mb": 500},
                        "slurm": {"partition": "gpu", "account": "proj1", "time_min": 30, "signal_s": 90,
                                  "extra_args": ["--qos=high"]}})
    text = render_head_script(cfg)
    sbatch_lines = [l for l in text.splitlines() if l.startswith("#SBATCH")]
    components = "\n".join(sbatch_lines).split("#SBATCH hetjob")
    assert len(components) == 3
    assert "#SBATCH --ntasks=1" in components[0] and "#SBATCH --cpus-per-task=1" in components[0]
    for comp in components[1:]:
        assert "#SBATCH --ntasks=2" in comp and "#SBATCH --cpus-per-task=3" in comp and "#SBATCH --mem=500M" in comp
    head = components[0]
    for line in ("--partition=gpu", "--account=proj1", "--time=30", "--signal=B:USR2@90", "--requeue", "--qos=high"):
        assert f"#SBATCH {line}" in head
    assert text.rstrip().endswith('exec "$PY" -m gyre_hpc.jobs.head "$@"')
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_script_without_a_config_argument_prints_usage(tmp_path):
    script = tmp_path / "head.sh"
    script.write_text(render_head_script(build_config({})))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert out.returncode == 2 and "usage: sbatch" in out.stderr


def test_script_names_its_python_and_stops_clearly_when_it_lacks_the_project(tmp_path):
    """Submitted from a directory without .venv, with a python that lacks the project: the
    script says which python it chose and how to point at another, instead of a bare
    ModuleNotFoundError from inside the head."""
    import sys

    bare = tmp_path / "bin" / "python"
    bare.parent.mkdir()
    bare.write_text("#!/bin/sh\nexit 1\n")     # a python that imports nothing
    bare.chmod(0o755)
    script = REPO / "sbatch" / "gyre_head.sh"
    env = {"PATH": "/usr/bin:/bin", "GYRE_PYTHON": str(bare), "SLURM_SUBMIT_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(script), "run.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"gyre head: python {bare} (GYRE_PYTHON={bare}" in proc.stdout
    assert "cannot import gyre_hpc" in proc.stderr and "GYRE_PYTHON=/path/to/venv/bin/python" in proc.stderr
    env["GYRE_PYTHON"] = sys.executable            # the project's own: gets past the check to the head
    proc = subprocess.run(["bash", str(script), str(tmp_path / "missing.yaml")], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert "cannot import gyre_hpc" not in proc.stderr and "missing.yaml" in proc.stderr + proc.stdout


def test_submit_dry_run_prints_the_golden_script_and_config_and_writes_nothing(tmp_path):
    """`gyre-hpc submit --dry-run --sbatch` is the golden text (regenerate it with the command in
    its first test line when the config or the script changes on purpose); the submitit form
    shows submitit's own script; neither writes a file or calls Slurm."""
    from click.testing import CliRunner

    from gyre_hpc.jobs.cli import submit

    golden = (REPO / "tests/jobs/data/dry_run_smoke_sbatch.txt").read_text()
    out = CliRunner().invoke(submit, ["--dry-run", "--sbatch", str(REPO / "examples/smoke.yaml"),
                                      "--set", "run_dir=/gyre-golden/run"])
    assert out.exit_code == 0, out.output
    assert out.output == golden, ("regenerate: gyre-hpc submit --dry-run --sbatch examples/smoke.yaml --set "
                                  "run_dir=/gyre-golden/run > tests/jobs/data/dry_run_smoke_sbatch.txt")
    run_dir = tmp_path / "run"
    out = CliRunner().invoke(submit, ["--dry-run", str(REPO / "examples/smoke.yaml"), "--set", f"run_dir={run_dir}"])
    assert out.exit_code == 0, out.output
    assert f"#SBATCH --output={run_dir}/submitit/%j_0_log.out" in out.output
    assert "#SBATCH --signal=B:USR2@120" in out.output and "-m submitit.core._submit" in out.output
    assert f"run_dir: {run_dir}\nlauncher: slurm\n" in out.output
    assert not run_dir.exists()
    bad = CliRunner().invoke(submit, ["--dry-run", str(REPO / "examples/smoke.yaml"), "--set", "cells.count=0"])
    assert bad.exit_code != 0 and "cells.count" in bad.output
