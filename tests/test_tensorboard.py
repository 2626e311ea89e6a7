"""metrics.tensorboard: step and engine rows land in TensorBoard event files, read back here."""
import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gyre_hpc.rundir.metrics import EngineRow, EventRow, MetricsWriter, StepRow, read_table
from gyre_hpc.rundir.tensorboard import TensorBoardMirror, run_origin_s


def _scalars(logdir, tag):
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)], acc.Tags()["scalars"]


def test_writer_mirrors_step_and_engine_rows(tmp_path):
    logdir = tmp_path / "tensorboard"
    with MetricsWriter(tmp_path / "metrics.h5", mirror=TensorBoardMirror(logdir, origin_s=1000.0)) as w:
        w.append([StepRow(step=0, time=1001.0, wall_s=1.5, tokens=640, replicas=1, loss=0.75, reward_mean=0.25),
                  StepRow(step=1, time=1003.0, wall_s=2.0, tokens=512, replicas=2, loss=0.5)])   # no reward
        w.append(EngineRow(time=1000.0 + t, cell=c, tokens_per_s=10.0 * c + t, queued=t) for c in (1, 2) for t in (2, 7))
        w.add(EventRow(time=1004.0, event="finish"))     # events are not mirrored
    assert len(read_table(tmp_path / "metrics.h5", "steps")["step"]) == 2   # metrics.h5 still has everything

    loss, tags = _scalars(logdir, "train/loss")
    assert [(s, v) for s, v, _ in loss] == [(0, 0.75), (1, 0.5)]
    assert [t for _, _, t in loss] == [1001.0, 1003.0]
    reward, _ = _scalars(logdir, "train/reward_mean")
    assert [(s, v) for s, v, _ in reward] == [(0, 0.25)]          # the NaN of step 1 is left out
    tokens, _ = _scalars(logdir, "train/tokens")
    assert [v for _, v, _ in tokens] == [640.0, 512.0]
    rate, _ = _scalars(logdir, "engine/cell2/tokens_per_s")
    assert [(s, v) for s, v, _ in rate] == [(2, 22.0), (7, 27.0)]  # seconds since the origin
    queued, _ = _scalars(logdir, "engine/cell1/queued")
    assert [(s, v) for s, v, _ in queued] == [(2, 2.0), (7, 7.0)]
    assert not any("event" in t for t in tags) and "engine/cell1/inflight" in tags


def test_run_origin_is_the_first_event(tmp_path):
    p = tmp_path / "metrics.h5"
    assert run_origin_s(p, default=5.0) == 5.0
    with MetricsWriter(p) as w:
        w.add(EventRow(time=42.0, event="launch"))
        w.add(EventRow(time=50.0, event="relaunch"))
    assert run_origin_s(p, default=5.0) == 42.0


def test_fleet_metrics_write_tensorboard_only_when_configured(tmp_path):
    from gyre_hpc.cells.fleet import open_fleet_metrics
    from gyre_hpc.config import build_config
    from gyre_hpc.rundir.layout import RunDir

    for on in (False, True):
        run = RunDir.at(tmp_path / f"run-{on}").make()
        cfg = build_config({"run_dir": str(run.root)}, [f"metrics.tensorboard={str(on).lower()}"])
        with open_fleet_metrics(run, cfg) as metrics:
            metrics.add(StepRow(step=3, time=1.0, wall_s=1.0, loss=0.125))
        assert run.tensorboard.exists() == on
        if on:
            loss, _ = _scalars(run.tensorboard, "train/loss")
            assert [(s, v) for s, v, _ in loss] == [(3, 0.125)] and not math.isnan(loss[0][1])
