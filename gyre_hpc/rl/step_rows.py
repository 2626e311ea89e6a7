"""An RL step's rows in ``metrics.h5``: one ``steps`` row and a ``runs`` row per run, held
until a checkpoint seals the step (``cells.step_rows``), and its ``pace`` events."""
from __future__ import annotations

from gyre_hpc.cells.plan import Cell, cell_of_rank
from gyre_hpc.rl.step_state import RLStepRecord, StepState
from gyre_hpc.rundir.metrics import EventRow, RunRow, StepRow


def step_rows(st: StepState, rec: RLStepRecord, replicas: int, now: float) -> list:
    """The ``runs`` rows of a finished step, then its ``steps`` row."""
    rows: list = [RunRow(time=now, step=st.step, run_id=o.spec.run_id, task_id=o.spec.task.task_id,
                         status=o.tree.status, reward=o.tree.reward, wall_s=o.tree.wall_s,
                         calls=o.tree.n_paths + len(o.tree.dropped_calls), migrations=o.migrations,
                         restarts=o.restarts, policy_version=o.tree.policy_version, model_s=o.model_s,
                         started=st.run_started.get(o.spec.run_id, 0.0), resumed_calls=o.resumed_calls,
                         tools_redone=o.tools_redone, restarted_from_first=int(o.restarted_from_first))
                  for o in st.outcomes_in_order()]
    gap = rec.gap
    rows.append(StepRow(step=st.step, time=now, wall_s=rec.wall_s, tokens=rec.tokens, replicas=replicas,
                        loss=rec.loss, reward_mean=rec.reward_mean, policy_version=rec.policy_version,
                        recomputed_prefill_tokens=rec.recomputed_prefill_tokens,
                        logprob_gap_max=gap.max_abs,
                        logprob_gap_mean=gap.mean_abs, pre_update_clip_share=gap.clip_share,
                        behaviour_kl=gap.kl))
    return rows


def pace_events(step: int, engines: dict[int, dict], replicas: dict[int, dict], cells: tuple[Cell, ...],
                now: float) -> list[EventRow]:
    """Paced cells (cells.device: paced): one ``pace`` event per engine and replica a step.
    The durations are EMULATED; the overrun share says how far real compute broke the
    emulation. Written at the step's end, not sealed: a redone step adds its own."""
    def detail(cell: int, role: str, r: dict) -> str:   # fits the events table's 160 bytes
        return (f"EMULATED cell={cell} {role} intervals={r['intervals']} paced_s={r['paced_s']:.3f} "
                f"real_s={r['real_s']:.3f} overruns={r['overruns']} overrun_s={r['overrun_s']:.3f} "
                f"share={r['overrun_share']:.4f}")
    out = [EventRow(now, "pace", step, detail(cid, "engine", rec)) for cid, rec in sorted(engines.items())]
    out += [EventRow(now, "pace", step, detail(cell_of_rank(cells, rank).id, "replica", rec))
            for rank, rec in sorted(replicas.items())]
    return out
