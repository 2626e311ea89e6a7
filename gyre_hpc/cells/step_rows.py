"""A step's rows in ``metrics.h5`` are written once a checkpoint seals the step, for every
workload.

A fleet killed between a step's end and the checkpoint that covers it (``train.checkpoint_every``
> 1, or a kill right at the step's end) redoes the step; rows written at the step's end would
then appear twice, and every notebook would read a wrong history. So a step driver keeps its
rows in ``UnsealedRows`` until ``seal``; the checkpoint carries the rows it seals
(``STEP_ROWS_FILE``), and the fleet's next start writes those a kill caught between the
checkpoint's commit and their append (``restore_step_rows``, called by ``cells.fleet``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from gyre_hpc import fsio
from gyre_hpc.rundir.metrics import MetricsWriter, RunRow, StepRow, read_table

STEP_ROWS_FILE = "metrics_rows.json"   # the steps/runs rows of the steps a checkpoint seals


def restore_step_rows(directory: Path, metrics_path: Path) -> list:
    """Rows of the steps a checkpoint sealed that are missing from ``metrics.h5`` (a kill
    between the checkpoint's commit and the rows' append); [] when they are there or were
    never saved. Each table is checked by its own key, a run row by (step, run id) and a step
    row by its step: ``MetricsWriter.append`` writes one table after another, so a kill in
    between leaves a step's run rows without its step row (``bench chaos`` found step 1's
    run rows twice when the step row alone decided)."""
    path = Path(directory) / STEP_ROWS_FILE
    if not path.is_file():
        return []
    kinds = {"RunRow": RunRow, "StepRow": StepRow}
    rows = [kinds[kind](**fields) for kind, fields in json.loads(path.read_text())]
    steps, runs = set(), set()
    if metrics_path.exists():
        steps = {int(s) for s in read_table(metrics_path, "steps")["step"]}
        table = read_table(metrics_path, "runs")
        runs = {(int(s), str(r)) for s, r in zip(table["step"], table["run_id"])}
    return [r for r in rows if (isinstance(r, StepRow) and r.step not in steps)
            or (isinstance(r, RunRow) and (r.step, r.run_id) not in runs)]


class UnsealedRows:
    """The rows of the steps no checkpoint has sealed yet."""

    def __init__(self) -> None:
        self.rows: list = []

    def add(self, rows: list) -> None:
        self.rows += rows

    def save(self, staging: Path, step: int) -> str:
        """Write the rows the checkpoint of ``step`` seals into its staging folder; their file name."""
        rows = [r for r in self.rows if r.step <= step]
        with fsio.naming_full_disk(staging / STEP_ROWS_FILE):
            (staging / STEP_ROWS_FILE).write_text(json.dumps([[type(r).__name__, dataclasses.asdict(r)] for r in rows]))
        return STEP_ROWS_FILE

    def seal(self, step: int, metrics: MetricsWriter) -> None:
        """The checkpoint of ``step`` is committed: its rows go to ``metrics.h5``, once."""
        rows = [r for r in self.rows if r.step <= step]
        self.rows = [r for r in self.rows if r.step > step]
        metrics.append(rows)
