"""``gyre-hpc report RUN``: a run's figures as PNG files and one self-contained HTML page.

For a user without Jupyter (or on a login node): the same figures the notebooks draw
(``rundir.figures``) on one run directory, written under ``<run>/report/`` (or ``--out``),
and ``report.html`` with every image inlined as base64 and the run's summary (``inspect``'s
figures), so the page opens anywhere, copied anywhere, with no server and no network.
"""
from __future__ import annotations

import base64
import html
import sys
from dataclasses import dataclass
from pathlib import Path

import click

# (file, caption, what it shows)
FIGURES = (
    ("gantt.png", "Cell roles over time", "one row per cell: blue rolls out, orange trains, red switches; dotted lines "
                                          "are step boundaries, crosses mark releases that moved KV"),
    ("step_times.png", "Step times", "wall time of each RL step"),
    ("rewards.png", "Rewards", "mean reward per step (metrics.h5) and checker scores by policy version (trees.zarr)"),
    ("busy.png", "Utilisation", "share of all cell-seconds rolling out, training, switching or idle"),
    ("tree_savings.png", "Tree savings", "tokens each trajectory tree stores once against its calls as separate "
                                         "sequences"),
)


@dataclass(frozen=True)
class Report:
    html: Path
    figures: list[Path]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Report:
    """Draw the run's figures into ``out`` (default ``<run>/report``) and write the page."""
    from gyre_hpc.rundir import figures
    from gyre_hpc.rundir.inspect import summarize
    from gyre_hpc.rundir.load import open_run, open_trees

    run = open_run(run_dir)
    root = Path(run_dir)
    out = Path(out) if out is not None else root / "report"
    out.mkdir(parents=True, exist_ok=True)
    runs = {run.name: run}
    drawn = {"gantt.png": figures.gantt(runs), "step_times.png": figures.step_times(runs),
             "rewards.png": figures.rewards(figures.reward_curves(runs, root)), "busy.png": figures.busy(runs)}
    if (root / "trees.zarr").exists():
        drawn["tree_savings.png"] = figures.savings(open_trees(root / "trees.zarr"))
    paths = []
    for name, fig in drawn.items():
        fig.savefig(out / name, dpi=90)
        paths.append(out / name)
    page = out / "report.html"
    page.write_text(render_page(run.name, summary_rows(summarize(root)), [(p, *_caption(p.name)) for p in paths]))
    return Report(page, paths)


def _caption(name: str) -> tuple[str, str]:
    for file, title, text in FIGURES:
        if file == name:
            return title, text
    return name, ""


def summary_rows(s) -> list[tuple[str, str]]:
    """The run at a glance, in the words ``inspect`` uses."""
    rows = [("status", s.status), ("launcher / policy", f"{s.launcher} / {s.policy}"),
            ("cells", f"{s.cells} x {s.ranks_per_cell} rank(s)"), ("steps done", f"{s.steps_done} of {s.steps_planned}"),
            ("launches", f"{s.launches} ({s.relaunches} relaunch(es), {s.requeues} requeue(s))")]
    if s.steps:
        rewards = [r["reward_mean"] for r in s.steps]
        rows.append(("reward mean, first -> last step", f"{rewards[0]:.3f} -> {rewards[-1]:.3f}"))
        gaps = [r["logprob_gap_max"] for r in s.steps if r.get("logprob_gap_max") is not None]
        if gaps:
            rows.append(("logprob gap trainer-vs-engine (max over steps)", f"{max(gaps):.3g}"))
    f = s.flip_effects
    if f:
        rows.append(("flips", f"{f['flips']} ({f['releases']} to TRAIN, {f['reclaims']} to ROLLOUT)"))
        rows.append(("KV moved", f"{f['requests_moved']} requests mid-decode + {f['contexts_moved']} retained "
                                 f"contexts = {f['kv_moved']}"))
    if s.trees:
        rows.append(("trees.zarr", f"{s.trees['trees']} trees, {s.trees['trained_tokens']} trained tokens"))
    return rows


def render_page(name: str, rows: list[tuple[str, str]], figures: list[tuple[Path, str, str]]) -> str:
    """One HTML file holding everything: the summary table and each PNG inlined."""
    esc = html.escape
    table = "\n".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    figs = "\n".join(
        f'<figure class="gyre-figure"><img alt="{esc(title)}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"><figcaption><b>{esc(title)}</b>: {esc(text)}'
        f"</figcaption></figure>" for path, title, text in figures)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gyre-hpc report: {esc(name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}th,td{{text-align:left;padding:2px 12px 2px 0}}
figure{{margin:1.5em 0}}img{{max-width:100%}}figcaption{{color:#555}}</style></head>
<body data-figures="{len(figures)}"><h1>gyre-hpc report: {esc(name)}</h1>
<table>{table}</table>
{figs}
<script>
// Once loaded, the page records how many of its figures the browser decoded (a browser test
// reads it; a reader never sees it).
window.addEventListener("load", () => {{
  const shown = [...document.querySelectorAll("figure.gyre-figure img")].filter(i => i.naturalWidth > 0);
  document.body.dataset.figuresShown = String(shown.length);
}});
</script>
</body></html>
"""


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="where the PNGs and report.html go (default RUN/report)")
def report(run_dir: Path, out: Path | None) -> None:
    """Write a run's figures (PNG) and a self-contained HTML page, without Jupyter."""
    from gyre_hpc.rundir.inspect import RunDirError

    try:
        rep = write_report(run_dir, out)
    except (RunDirError, FileNotFoundError) as exc:
        click.echo(f"report: {exc}", err=True)
        sys.exit(1)
    for p in rep.figures:
        click.echo(f"figure {p}")
    click.echo(f"page   {rep.html}")
