"""gyre-hpc export of a 1-rank fleet checkpoint, and what it refuses (the sharded case, with
real ranks, is in test_sharding.py)."""
import json

import pytest
import torch

from gyre_hpc.cells import checkpoint as ckpt
from gyre_hpc.cells.export import export_hf, resolve_checkpoint
from gyre_hpc.models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from gyre_hpc.models.tiny_lm import build_model


def _one_rank_checkpoint(root, step=3):
    staged = ckpt.staging_dir(root, step)
    save_pretrained(build_model("tiny", seed=4), staged)
    (staged / "optimizer.safetensors").write_bytes(b"not read by export")
    return ckpt.commit(root, step, ckpt.CheckpointMeta(step=step, policy_version=step, roles={},
                                                       files=["model.safetensors"]))


def test_a_run_directory_exports_its_latest_one_rank_checkpoint_without_the_optimizer(tmp_path):
    sealed = _one_rank_checkpoint(tmp_path / "run" / "checkpoints")
    assert resolve_checkpoint(tmp_path / "run") == sealed
    out = export_hf(tmp_path / "run", tmp_path / "hf", dtype="bfloat16")
    assert not (out / "optimizer.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["gyre"]["step"] == 3 and config["torch_dtype"] == "bfloat16"
    want = build_model("tiny", seed=4).state_dict()
    got = load_pretrained(out).state_dict()
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)


def test_export_refuses_a_folder_that_is_no_checkpoint_and_an_existing_out(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty is no checkpoint: neither \.metadata"):
        export_hf(tmp_path / "empty", tmp_path / "hf")
    sealed = _one_rank_checkpoint(tmp_path / "checkpoints")
    (tmp_path / "hf").mkdir()
    with pytest.raises(CheckpointError, match="exists: pass --force"):
        export_hf(sealed, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="never the checkpoint itself"):
        export_hf(sealed, sealed, replace=True)
    assert export_hf(sealed, tmp_path / "hf", replace=True) == tmp_path / "hf"
