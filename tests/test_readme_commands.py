"""Every ``gyre-hpc`` command the README shows exists as written, and the cheap ones run.

Each command line of the README (code blocks and the benchmark table) is parsed by the CLI
itself (``make_context``): a renamed subcommand or a dropped flag fails here, not in a user's
first hour. The ``sim`` lines run (the tiny preset in place of the paper's, which the
simulator's own tests run at full size) and ``submit --dry-run`` runs on the smoke config;
every ``--json`` one must print only JSON on stdout. The benchmarks of the table each have
their own test that runs them at a small size through the CLI (tests/*/test_bench_*.py,
test_store_bench.py, test_engine_bench_*.py); this test checks that each has one.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gyre_hpc.cli import main

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def readme_commands() -> list[list[str]]:
    """Argument lists (after ``gyre-hpc``) of every command the README shows; a table cell's
    alternatives (`gyre-hpc sim --json`, `--sweep`) are each a command of their own."""
    found = []
    for line in README.splitlines():
        if line.lstrip().startswith("|"):
            last = None
            for seg in re.findall(r"`([^`]+)`", line):
                if seg.startswith("gyre-hpc "):
                    last = shlex.split(seg)[1:]
                    found.append(last)
                elif seg.startswith("--") and last is not None:
                    found.append(last + shlex.split(seg.split(":")[0]))
            continue
        m = re.search(r"(?:\.\./)?(?:\.venv/bin/)?gyre-hpc ([a-z][^`#|]*)", line)
        if m and not line.startswith("#"):
            found.append(shlex.split(m.group(1).strip()))
    return [w for w in found if w]


def resolve(words: list[str]) -> tuple[click.Command, list[str]]:
    cmd: click.Command = main
    rest = list(words)
    while isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
        sub = cmd.get_command(click.Context(cmd), rest[0])
        assert sub is not None, f"README names `gyre-hpc {' '.join(words)}`: no subcommand {rest[0]!r}"
        cmd, rest = sub, rest[1:]
    return cmd, rest


COMMANDS = readme_commands()


def test_the_readme_shows_commands():
    assert {"inspect", "report", "submit", "sim"} <= {resolve(w)[0].name for w in COMMANDS}
    benches = {w[1] for w in COMMANDS if w[0] == "bench"}
    assert benches == {"switch", "trees", "scale", "xlong", "store", "migrate", "engines", "e2e", "fuzz", "load",
                       "chaos"}


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(w) for w in COMMANDS])
def test_every_readme_command_parses_as_written(words):
    cmd, rest = resolve(words)
    # options only: the paths a README line names (run.yaml, runs/local-demo) need not exist here
    args = [a for a in rest if a.startswith("-") or "=" in a]
    opts = [a.split("=")[0] for a in args if a.startswith("--")]
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    unknown = [o for o in opts if o not in known]
    assert not unknown, f"`gyre-hpc {' '.join(words)}`: {cmd.name} has no option {unknown}; it has {sorted(known)}"


def test_each_benchmark_of_the_table_has_a_test_that_runs_it():
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*bench*.py"))
    for bench in {w[1] for w in COMMANDS if w[0] == "bench"}:
        assert re.search(rf'"bench", "{bench}"|bench\.{bench}\b|bench_{bench}\b|bench import {bench}', tests), bench


def _run_json(args: list[str]) -> dict:
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)      # only JSON on stdout


def test_the_readme_sim_lines_run(tmp_path):
    for words in COMMANDS:
        if words[0] != "sim":
            continue
        args = ["sim", "--preset", "tiny", "--no-record", "--set", "steps=1"]
        extra = [w for w in words[1:] if w not in ("--preset", "paper")]
        if "--sweep" in extra:
            extra += ["--sweep-steps", "1"]
        if "--sensitivity" in extra:
            extra += ["--sensitivity-steps", "1", "--seeds", "0"]
        rep = _run_json(args + extra + (["--json"] if "--json" not in extra else []))
        assert rep


def test_the_readme_dry_run_line_runs_and_submits_nothing(tmp_path):
    r = CliRunner().invoke(main, ["submit", "--dry-run", str(REPO / "examples/smoke.yaml"), "--set",
                                  f"run_dir={tmp_path / 'run'}"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "#SBATCH" in r.output and not (tmp_path / "run").exists()
