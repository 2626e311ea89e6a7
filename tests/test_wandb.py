"""metrics.wandb: step and engine rows logged to a Weights & Biases run, read back from the
offline run's own transaction log with wandb's protobuf records."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

from gyre_hpc.rundir.metrics import EngineRow, EventRow, MetricsWriter, StepRow, read_table  # noqa: E402
from gyre_hpc.rundir.wandb_mirror import WandbMirror  # noqa: E402


def wandb_history(run_root: Path) -> list[dict]:
    """Every history record of the offline run under ``run_root/wandb``: the .wandb file is a
    LevelDB-style log (a 7-byte header, 32 KiB blocks of checksum/length/type-framed chunks)
    of ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    (path,) = list((run_root / "wandb").glob("offline-run-*/run-*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf = (b"" if kind in (1, 2) else buf) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(buf)
    history = []
    for raw in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return history


def test_offline_run_holds_the_step_and_engine_figures(tmp_path):
    mirror = WandbMirror(tmp_path, "gyre-test", "offline", origin_s=1000.0, name="t", config={"seed": 3})
    with MetricsWriter(tmp_path / "metrics.h5", mirror=mirror) as w:
        w.append([StepRow(step=1, time=1001.0, wall_s=2.0, tokens=640, loss=0.5, reward_mean=0.25,
                          logprob_gap_max=0.0, logprob_gap_mean=0.0, pre_update_clip_share=0.0, behaviour_kl=0.0),
                  StepRow(step=2, time=1003.0, wall_s=3.0, tokens=512, loss=0.4)])          # reward not measured
        w.append([EngineRow(time=1002.5, cell=1, tokens_per_s=5.0, queued=2)])
        w.add(EventRow(time=1004.0, event="finish"))                                          # not mirrored
    assert len(read_table(tmp_path / "metrics.h5", "steps")["step"]) == 2
    history = wandb_history(tmp_path)
    steps = [h for h in history if "train/step" in h]
    assert [h["train/step"] for h in steps] == [1, 2]
    assert steps[0]["train/loss"] == 0.5 and steps[0]["train/reward_mean"] == 0.25 and steps[0]["train/tokens"] == 640
    assert steps[0]["train/logprob_gap_max"] == 0.0 and "train/reward_mean" not in steps[1]
    (engine,) = [h for h in history if "engine/time_s" in h]
    assert engine["engine/time_s"] == 2.5 and engine["engine/cell1/tokens_per_s"] == 5.0
    assert engine["engine/cell1/queued"] == 2.0
    # A relaunch resumes the same wandb run.
    run_id = (tmp_path / "wandb-run-id").read_text().strip()
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) == 1


def test_fleet_metrics_log_to_wandb_only_when_configured(tmp_path):
    from gyre_hpc.cells.fleet import open_fleet_metrics
    from gyre_hpc.config import build_config
    from gyre_hpc.rundir.layout import RunDir

    run = RunDir.at(tmp_path / "plain").make()
    with open_fleet_metrics(run, build_config({"run_dir": str(run.root)})) as m:
        m.add(StepRow(step=1, time=1.0, wall_s=1.0))
    assert not (run.root / "wandb").exists()
    run = RunDir.at(tmp_path / "wb").make()
    cfg = build_config({"run_dir": str(run.root), "metrics": {"wandb": {"project": "p"}, "tensorboard": True}})
    with open_fleet_metrics(run, cfg) as m:
        m.add(StepRow(step=1, time=1.0, wall_s=1.0, loss=0.125))
    assert [h["train/loss"] for h in wandb_history(run.root) if "train/loss" in h] == [0.125]
    assert any(run.tensorboard.iterdir())           # both mirrors at once


def test_wandb_config_is_validated():
    from gyre_hpc.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="metrics.wandb.mode"):
        build_config({"metrics": {"wandb": {"project": "p", "mode": "sometimes"}}})
    with pytest.raises(ConfigError, match="metrics.wandb.project"):
        build_config({"metrics": {"wandb": {}}})
