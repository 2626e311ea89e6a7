"""Checkpoint directories, the latest pointer and pruning, on a real filesystem."""
import json
import subprocess
import sys

import pytest
import torch

from gyre_hpc.cells import checkpoint as ck


def save(root, step, value=1.0, keep=2):
    d = ck.staging_dir(root, step)
    ck.write_state(d, {"w": torch.full((3,), value), "b": torch.arange(4).to(torch.bfloat16)})
    return ck.commit(root, step, ck.CheckpointMeta(step=step, policy_version=step, roles={"0": "TRAIN", "1": "ROLLOUT"}),
                     keep=keep)


def test_commit_writes_meta_state_and_latest(tmp_path):
    final = save(tmp_path, 3, value=2.0)
    assert final.name == "step-00000003"
    assert ck.latest_dir(tmp_path) == final
    meta = ck.read_meta(final)
    assert (meta.step, meta.policy_version, meta.roles) == (3, 3, {"0": "TRAIN", "1": "ROLLOUT"})
    state = ck.load_state(final)
    assert torch.equal(state["w"], torch.full((3,), 2.0)) and state["b"].dtype == torch.bfloat16
    assert not list(tmp_path.glob("*.tmp*"))


def test_the_pointer_and_meta_carry_the_run_directory_layouts_names(tmp_path):
    """The head and ``inspect`` read these names from rundir.layout without importing torch."""
    from gyre_hpc.rundir.layout import CHECKPOINT_LATEST, CHECKPOINT_META

    final = save(tmp_path, 7)
    assert (tmp_path / CHECKPOINT_LATEST).read_text() == "step-00000007\n"
    assert json.loads((final / CHECKPOINT_META).read_text())["step"] == 7


def test_only_the_last_two_are_kept(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step)
    assert [p.name for p in ck.complete_dirs(tmp_path)] == ["step-00000004", "step-00000005"]
    assert ck.latest_dir(tmp_path).name == "step-00000005"


def test_a_killed_writer_leaves_latest_on_the_previous_checkpoint(tmp_path):
    save(tmp_path, 1)
    d = ck.staging_dir(tmp_path, 2)
    ck.write_state(d, {"w": torch.zeros(2)})          # killed before commit
    assert ck.latest_dir(tmp_path).name == "step-00000001"
    assert [p.name for p in ck.complete_dirs(tmp_path)] == ["step-00000001"]
    save(tmp_path, 2)                                  # the relaunch redoes the step
    assert ck.latest_dir(tmp_path).name == "step-00000002"


def test_commit_refuses_a_dir_without_its_state(tmp_path):
    ck.staging_dir(tmp_path, 1)
    with pytest.raises(ck.CheckpointError, match="model.safetensors was not written"):
        ck.commit(tmp_path, 1, ck.CheckpointMeta(step=1, policy_version=1, roles={}))
    assert ck.latest_dir(tmp_path) is None


def test_broken_pointer_and_meta_are_named(tmp_path):
    (tmp_path / "latest").write_text("step-00000009\n")
    with pytest.raises(ck.CheckpointError, match="names 'step-00000009'"):
        ck.latest_dir(tmp_path)
    d = tmp_path / "step-00000001"
    d.mkdir()
    (d / "meta.json").write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="meta.json is unreadable"):
        ck.read_meta(d)
    (d / "meta.json").write_text(json.dumps({"step": 1, "policy_version": 0, "roles": {}}))
    with pytest.raises(ck.CheckpointError, match="model.safetensors is missing"):
        ck.load_state(d)


def test_a_fleet_checkpoint_raises_the_one_checkpoint_error_of_models(tmp_path):
    """One CheckpointError for HF folders and fleet step dirs: a caller catching the models'
    error (a ValueError) catches the fleet's too, and the head compares one type name."""
    from gyre_hpc.models.checkpoint import CheckpointError

    (tmp_path / "latest").write_text("step-00000004\n")
    with pytest.raises(CheckpointError, match="names 'step-00000004'") as raised:
        ck.latest_dir(tmp_path)
    assert type(raised.value) is CheckpointError and isinstance(raised.value, ValueError)
    assert ck.CheckpointError is CheckpointError


def test_a_checkpoint_whose_meta_still_names_its_workload_reads_back(tmp_path):
    """Checkpoints before issue 50 recorded ``extra.workload``, which nothing read; they resume."""
    final = save(tmp_path, 2)
    meta = json.loads((final / "meta.json").read_text())
    meta["extra"] = {"trees_committed": 8, "trained_upto": 8, "workload": "rl"}
    (final / "meta.json").write_text(json.dumps(meta))
    back = ck.read_meta(ck.latest_dir(tmp_path))
    assert (back.step, back.extra["trained_upto"]) == (2, 8)


def test_a_step_dir_latest_never_named_is_replaced_by_the_rerun(tmp_path):
    save(tmp_path, 1)
    # A writer killed after renaming step 2 into place but before repointing latest.
    save(tmp_path, 2, value=5.0)
    (tmp_path / "latest").write_text("step-00000001\n")
    save(tmp_path, 2, value=7.0)                       # the relaunch reran step 2
    assert ck.latest_dir(tmp_path).name == "step-00000002"
    assert torch.equal(ck.load_state(ck.latest_dir(tmp_path))["w"], torch.full((3,), 7.0))
    # Sealing the step latest already names again keeps what latest points at.
    save(tmp_path, 2, value=9.0)
    assert torch.equal(ck.load_state(ck.latest_dir(tmp_path))["w"], torch.full((3,), 7.0))


KILLED_RENAMING_IN = """
import os, sys, torch
from gyre_hpc.cells import checkpoint as ck
root, real_rename = sys.argv[1], os.rename
os.rename = lambda src, dst: os._exit(9) if dst.name == "step-00000002" else real_rename(src, dst)
ck.write_state(ck.staging_dir(root, 2), {"w": torch.full((3,), 6.0)})
ck.commit(root, 2, ck.CheckpointMeta(step=2, policy_version=2, roles={}))
"""


def test_a_writer_killed_between_the_renames_of_a_rerun_step_leaves_readers_whole(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2, value=5.0)
    (tmp_path / "latest").write_text("step-00000001\n")    # killed before repointing latest
    rerun = subprocess.run([sys.executable, "-c", KILLED_RENAMING_IN, str(tmp_path)], timeout=120)
    assert rerun.returncode == 9                           # the old step 2 aside, the new one not in
    assert ck.latest_dir(tmp_path).name == "step-00000001"
    assert [p.name for p in ck.complete_dirs(tmp_path)] == ["step-00000001"]
    save(tmp_path, 2, value=7.0)                           # the next relaunch reruns step 2
    assert torch.equal(ck.load_state(ck.latest_dir(tmp_path))["w"], torch.full((3,), 7.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002"]
