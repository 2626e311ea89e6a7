"""The progress of an rl run: a live table on a terminal, one line per step everywhere else.

The head process is not an MPI rank and must not disturb the fleet, so it reads what the
controller writes anyway: ``metrics.h5`` in SWMR mode (steps: reward and loss; timeline: the
cells' roles after each flip and what moved with its KV; runs: requests moved and restarts). A reader thread polls the file.
On a terminal a rich ``Live`` table shows it. Where stdout is not a terminal (``make run >
log``, CI, an sbatch job's output file) a live table renders once, at exit, so instead each
new step prints one line, flushed at once (``step_line``); the supervisor's own lines (launch,
relaunch, requeue) go to the same stream. A file that is briefly unreadable (not created yet,
or between the supervisor's and the controller's writers) just leaves the last view up.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gyre_hpc.config import RunConfig
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import read_table


@dataclass
class Progress:
    steps_planned: int
    roles: dict[int, str]
    step: int = 0
    reward: list[float] = field(default_factory=list)
    loss: float = float("nan")
    logprob_gap_max: float = float("nan")   # the last step's trainer-vs-behaviour gap
    flips: int = 0
    runs: int = 0
    migrations: int = 0        # requests moved mid-decode (the runs table's count)
    contexts_moved: int = 0    # retained agent contexts moved with their KV (the timeline's)
    restarts: int = 0


def read_progress(path: Path, cfg: RunConfig) -> Progress:
    """What the run has recorded so far (raises OSError/KeyError while the file is unreadable)."""
    roles = {c: ("TRAIN" if c == cfg.cells.core or c in (cfg.cells.initial_train or []) else "ROLLOUT")
             for c in range(cfg.cells.count)}
    p = Progress(cfg.train.steps, roles)
    steps = read_table(path, "steps")
    if len(steps["step"]):
        p.step = int(steps["step"][-1])
        p.reward = [float(x) for x in steps["reward_mean"]]
        p.loss = float(steps["loss"][-1])
        p.logprob_gap_max = float(steps["logprob_gap_max"][-1])
    tl = read_table(path, "timeline")
    for cell, role, event, sessions in zip(tl["cell"], tl["role"], tl["event"], tl["sessions"]):
        if event == "flip_end":
            p.roles[int(cell)] = str(role)
            p.flips += 1
        elif event == "migrate":
            p.contexts_moved += int(sessions)
    runs = read_table(path, "runs")
    p.runs = len(runs["run_id"])
    p.migrations = int(runs["migrations"].sum())
    p.restarts = int(runs["restarts"].sum())
    return p


def step_lines(path: Path, cfg: RunConfig, done: int, started: float) -> list[str]:
    """One line for each step row of ``metrics.h5`` after the first ``done``: step, reward,
    wall time, trained tokens, flips, KV moved, the train-inference gap and an ETA."""
    steps = read_table(path, "steps")
    n = len(steps["step"])
    if n <= done:
        return []
    tl = read_table(path, "timeline")
    lines = []
    for i in range(done, n):
        step = int(steps["step"][i])
        in_step = [j for j in range(len(tl["step"])) if int(tl["step"][j]) == step]
        flips = sum(1 for j in in_step if tl["event"][j] == "flip_end")
        moved = [j for j in in_step if tl["event"][j] == "migrate"]
        sessions = sum(int(tl["sessions"][j]) for j in moved)
        requests = sum(int(tl["requests"][j]) for j in moved) - sessions
        walls = [float(w) for w in steps["wall_s"][:i + 1]]
        left = cfg.train.steps - step
        eta = f"{left * sum(walls) / len(walls):.0f}s" if left > 0 else "done"
        gap = float(steps["logprob_gap_max"][i])
        lines.append(f"[progress] {time.strftime('%H:%M:%S')} step {step}/{cfg.train.steps} reward "
                     f"{float(steps['reward_mean'][i]):.3f} wall {float(steps['wall_s'][i]):.1f}s trained "
                     f"{int(steps['tokens'][i])} tok flips {flips} KV moved {requests} requests + {sessions} "
                     f"contexts logprob gap {gap:.3g} ETA {eta} (elapsed {time.monotonic() - started:.0f}s)")
    return lines


@contextmanager
def progress_lines(cfg: RunConfig, poll_s: float = 2.0, stream=None):
    """Print ``step_lines`` as steps land while the body (the head's supervisor) runs."""
    stream = stream or sys.stdout
    path = RunDir.at(cfg.run_dir).metrics
    t0 = time.monotonic()
    state = {"done": _steps_recorded(path)}   # a resumed run's earlier steps were printed before

    def emit():
        try:
            lines = step_lines(path, cfg, state["done"], t0)
        except (OSError, KeyError, ValueError):
            return
        for line in lines:
            print(line, file=stream, flush=True)
        state["done"] += len(lines)

    with polling(emit, poll_s):
        yield


@contextmanager
def polling(tick, poll_s: float):
    """Call ``tick`` every ``poll_s`` seconds in a thread while the body runs, and once more after."""
    stop = threading.Event()

    def poll():
        while not stop.wait(poll_s):
            tick()
    thread = threading.Thread(target=poll, name="gyre-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        tick()


def _steps_recorded(path: Path) -> int:
    try:
        return len(read_table(path, "steps")["step"]) if path.exists() else 0
    except (OSError, KeyError, ValueError):
        return 0


def render(p: Progress, elapsed: float):
    from rich.table import Table

    table = Table(title=f"gyre rl: step {p.step}/{p.steps_planned}  ({elapsed:.0f} s)", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    first = f"{p.reward[0]:.3f}" if p.reward else "-"
    last = f"{p.reward[-1]:.3f}" if p.reward else "-"
    table.add_row("reward mean (first -> last step)", f"{first} -> {last}")
    table.add_row("loss (last step)", f"{p.loss:.4g}")
    table.add_row("logprob gap trainer-vs-engine (last step, max)", f"{p.logprob_gap_max:.3g}")
    table.add_row("cell roles", "  ".join(f"{c}:{r}" for c, r in sorted(p.roles.items())))
    table.add_row("flips / runs / restarts", f"{p.flips} / {p.runs} / {p.restarts}")
    table.add_row("KV moved: requests mid-decode + retained contexts",
                  f"{p.migrations} + {p.contexts_moved} = {p.migrations + p.contexts_moved}")
    return table


@contextmanager
def progress_display(cfg: RunConfig, poll_s: float = 1.0):
    """Show progress while the body (the head's supervisor) runs: the live table on a
    terminal, ``progress_lines`` anywhere else."""
    if not sys.stdout.isatty():
        with progress_lines(cfg):
            yield
        return
    from rich.console import Console
    from rich.live import Live

    path = RunDir.at(cfg.run_dir).metrics
    t0 = time.monotonic()
    state = {"p": None}

    def view():
        p = state["p"]
        if p is None:
            from rich.text import Text
            return Text(f"gyre rl: starting the fleet ({time.monotonic() - t0:.0f} s)")
        return render(p, time.monotonic() - t0)

    console = Console()
    with Live(view(), console=console, refresh_per_second=2, transient=False) as live:
        def tick():
            try:
                state["p"] = read_progress(path, cfg)
            except (OSError, KeyError, ValueError):
                pass
            live.update(view())
        with polling(tick, poll_s):
            yield
    console.line()


def notebooks(root: Path | None = None) -> list[Path]:
    """The analysis notebooks shipped with the project (``analysis/*.ipynb``)."""
    root = root or Path(__file__).resolve().parents[2] / "analysis"
    return sorted(root.glob("*.ipynb")) if root.is_dir() else []


RUN_NOTEBOOKS = ("steps.ipynb", "timeline.ipynb")   # what a finished run's figures need first


def notebook_hint(run_root: Path, root: Path | None = None) -> str | None:
    """The command that runs the analysis notebooks on this run, as it can be pasted: this
    interpreter's ``jupyter-execute`` (nbclient, in the base install), the run's variables
    (docs/analysis.md), figures written under ``analysis/figures/``."""
    nbs = notebooks(root)
    if not nbs:
        return None
    run_root = Path(run_root).resolve()
    names = ", ".join(nb.name for nb in nbs)
    chosen = [nb.name for nb in nbs if nb.name in RUN_NOTEBOOKS] or [nbs[0].name]
    execute = Path(sys.executable).with_name("jupyter-execute")
    return (f"notebooks ({names}; steps.ipynb: reward and step times, timeline.ipynb: cell roles); figures "
            f"into {nbs[0].parent / 'figures'}:\n"
            f"  cd {nbs[0].parent} && GYRE_RUNS={run_root.parent} GYRE_TREES_RUN={run_root} {execute} "
            f"{' '.join(chosen)}")
