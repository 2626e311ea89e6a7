"""``gyre-hpc bench fuzz``: seeded hostile model output through the harness's parser and loop.

Every case's turns are parsed by ``parse_action``; a seeded share of the cases (and the first
case of each kind, the million-line command among them) is executed by real ``AgentRun``s over
a workspace beside a bait directory (``gyre_hpc.harness.fuzz``). The figures that must be 0 are
``escaped`` (an exception out of the parser or the loop, or a run the harness failed for a
model-written call) and ``written_outside``; ``unexpected`` counts cases whose last turn did not
become what the case says it should. The baseline, measured in the same run, is the parser's
time per well-formed call beside its time per hostile one. Exit status 1 when anything escaped
or was written outside, after the JSON.
"""
from __future__ import annotations

import tempfile
import time

import click

from gyre_hpc.harness.fuzz import run_cases, summarize
from gyre_hpc.harness.fuzz_cases import KINDS, generate_cases
from gyre_hpc.report import emit


def run_bench(n_cases: int = 10_000, seed: int = 0, exec_share: float = 0.05, turns_per_run: int = 16) -> dict:
    start = time.perf_counter()
    cases = generate_cases(n_cases, seed, exec_share)
    generate_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="gyre-bench-fuzz-") as tmp:
        result = run_cases(cases, f"{tmp}/fuzz", turns_per_run=turns_per_run)
    report = summarize(result)
    report["settings"] = {
        "seed": seed, "exec_share": exec_share, "turns_per_run": turns_per_run, "kinds": list(KINDS),
        "selection": (f"every case is parsed by actions.parse_action; the first case of each kind and a seeded "
                      f"{exec_share:.0%} of the rest are executed through AgentRun (tools, jail, journal, checker), "
                      f"{turns_per_run} turns to a run; the others run the parser only"),
    }
    report["wall_s"] = {"total": time.perf_counter() - start, "generate": generate_s,
                        "parse_only": sum(result.parse_s.values()), "execute": result.execute_s}
    return report


@click.command()
@click.option("--cases", "n_cases", default=10_000, show_default=True, help="cases to generate and run")
@click.option("--seed", default=0, show_default=True)
@click.option("--exec-share", default=0.05, show_default=True, help="share of cases (beyond each kind's first) executed")
@click.option("--turns-per-run", default=16, show_default=True, help="executed turns per AgentRun")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def command(n_cases: int, seed: int, exec_share: float, turns_per_run: int, as_json: bool) -> None:
    """Hostile tool calls through the harness: outcomes by status and kind, escapes (must be 0)."""
    if n_cases < 1 or turns_per_run < 1:
        raise click.BadParameter(f"--cases={n_cases}, --turns-per-run={turns_per_run}: each must be >= 1")
    if not 0.0 <= exec_share <= 1.0:
        raise click.BadParameter(f"--exec-share={exec_share}: must be in [0, 1]")
    report = run_bench(n_cases, seed, exec_share, turns_per_run)
    emit(report, as_json)
    if report["escaped"] or report["written_outside"]:
        raise SystemExit(1)
