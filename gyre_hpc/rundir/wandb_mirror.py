"""``metrics.wandb``: the step and engine rows also logged to Weights & Biases.

What verl, AReaL, prime-rl and slime users look at first. ``metrics.h5`` stays the source;
this mirror sees each row after the file has it, with the same figures as TensorBoard
(``rundir.tensorboard``'s tags). Offline by default: a compute node usually has no route
out, and ``wandb sync <run_dir>/wandb/offline-run-*`` uploads the run from a login node later.
Two x-axes: ``train/step`` for step rows, ``engine/time_s`` (seconds since the run's first
event) for engine rows, so the two streams never fight over wandb's own step counter. A
relaunched fleet resumes the same wandb run (its id is kept in the run directory).
"""
from __future__ import annotations

import math
import uuid
from pathlib import Path

from gyre_hpc import fsio
from gyre_hpc.rundir.metrics import EngineRow, StepRow
from gyre_hpc.rundir.tensorboard import ENGINE_TAGS, STEP_TAGS

RUN_ID_FILE = "wandb-run-id"


class WandbMirror:
    def __init__(self, run_root: str | Path, project: str, mode: str, origin_s: float,
                 name: str | None = None, entity: str | None = None, config: dict | None = None):
        import wandb  # the `wandb` extra

        self.origin_s = origin_s
        root = Path(run_root)
        id_file = root / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        fsio.write_text(id_file, run_id + "\n")
        self._run = wandb.init(project=project, entity=entity, name=name, id=run_id, resume="allow", mode=mode,
                               dir=str(root), config=config, settings=wandb.Settings(silent=True, console="off"))
        self._run.define_metric("train/step")
        self._run.define_metric("train/*", step_metric="train/step")
        self._run.define_metric("engine/time_s")
        self._run.define_metric("engine/*", step_metric="engine/time_s")

    def append(self, rows: list) -> None:
        for row in rows:
            if isinstance(row, StepRow):
                self._log({"train/step": row.step}, "train", STEP_TAGS, row)
            elif isinstance(row, EngineRow):
                self._log({"engine/time_s": row.time - self.origin_s}, f"engine/cell{row.cell}", ENGINE_TAGS, row)

    def _log(self, axis: dict, prefix: str, tags: tuple[str, ...], row) -> None:
        values = {f"{prefix}/{tag}": float(getattr(row, tag)) for tag in tags}
        values = {k: v for k, v in values.items() if math.isfinite(v)}   # as TensorBoard: NaN = not measured
        if values:
            self._run.log({**axis, **values})

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() returns before wandb's service has written the run's transaction log (with
        # wandb 0.31 offline: 7 bytes at return, every row a moment later), so a `wandb sync`
        # or a reader right after the fleet's exit could miss rows; teardown waits for the
        # service to exit, which flushes it. The fleet's controller is the only wandb user in
        # its process.
        wandb.teardown()
