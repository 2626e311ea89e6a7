"""The substrate workload and the fleet's resume helpers, in one process."""
import pytest
import torch

from gyre_hpc.models.checkpoint import CheckpointError
from gyre_hpc.cells.fleet import resolve_policy
from gyre_hpc.cells.rank_state import load_into as _load_into
from gyre_hpc.cells.weights import state_bytes, state_checksum
from gyre_hpc.substrate.workload import SubstrateWorkload
from gyre_hpc.config import build_config
from gyre_hpc.sched.scripted import scripted_policy


def workload(mb=2.0, seed=0):
    return SubstrateWorkload(build_config({"model": {"substrate_state_mb": mb}, "seed": seed}))


def test_ballast_sizes_the_state_dict_with_mixed_dtypes():
    w = workload(50.0)
    sd = w.state_dict()
    assert abs(state_bytes(sd) - 50 * (1 << 20)) < 200_000    # MLP on top of the 50 MB ballast
    assert {t.dtype for t in sd.values()} >= {torch.float32, torch.bfloat16, torch.int64}
    assert state_bytes(workload(0.0).state_dict()) < 300_000


def test_micro_batch_gradients_depend_on_step_and_micro_batch_only():
    a, b = workload(), workload()
    a.train_micro_batch(3, 1)
    b.train_micro_batch(3, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.grad_tensors(), b.grad_tensors()))
    b.zero_grads()
    b.train_micro_batch(3, 2)
    assert not all(torch.equal(x, y) for x, y in zip(a.grad_tensors(), b.grad_tensors()))


def test_update_moves_the_weights_and_counts_itself():
    w = workload()
    before = state_checksum(w.state_dict())
    w.train_micro_batch(1, 0)
    w.apply_update(1)
    assert state_checksum(w.state_dict()) != before
    assert int(w.state_dict()["updates"]) == 1 and w.applied_updates() == 1
    assert all(float(g.abs().sum()) == 0 for g in w.grad_tensors())   # grads cleared for the next step


def test_resume_refuses_a_checkpoint_of_another_model_by_tensor_name(tmp_path):
    local = workload(1.0).state_dict()
    stored = {k: v.clone() for k, v in local.items()}
    stored["ballast_f32"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"ballast_f32 is torch.float32\[3\]"):
        _load_into(local, stored, tmp_path)
    with pytest.raises(CheckpointError, match=r"missing \['updates'\]"):
        _load_into(local, {k: v for k, v in local.items() if k != "updates"}, tmp_path)
    other = workload(1.0, seed=5).state_dict()
    _load_into(local, other, tmp_path)
    assert state_checksum(local) == state_checksum(other)


def test_scheduler_policy_name_resolves_through_the_registry():
    assert resolve_policy(build_config({"scheduler": {"policy": "scripted"}})) is scripted_policy


def test_paced_elastic_is_sized_from_its_device_as_the_simulator_sizes_it():
    from gyre_hpc.devices import device_preset
    from gyre_hpc.sim.cluster import policy_for
    from gyre_hpc.sim.workload import preset

    engine, train = device_preset("paper-local")
    paced = {"cells": {"count": 3, "device": "paced", "pace": {"preset": "paper-local"}}}
    p = resolve_policy(build_config({**paced, "scheduler": {"policy": "elastic"}})).params
    assert (p.target_requests_per_engine, p.kv_tokens_per_engine, p.default_train_tokens_per_s) == \
        (engine.target_seqs(), engine.kv_capacity_tokens(), train.tokens_per_s) == (2, 16000, 80.0)
    assert p == policy_for(preset("paper-local"), "elastic").params       # the policy the simulator forecasts
    # A field the config sets wins over the device's sizing; a native fleet keeps the defaults.
    set_ = resolve_policy(build_config({**paced, "scheduler": {"policy": "elastic",
                                                               "elastic": {"target_requests_per_engine": 5}}}))
    assert set_.params.target_requests_per_engine == 5 and set_.params.default_train_tokens_per_s == 80.0
    native = resolve_policy(build_config({"scheduler": {"policy": "elastic"}})).params
    assert native.target_requests_per_engine == 16 and native.default_train_tokens_per_s == 2000.0
