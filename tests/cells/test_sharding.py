"""FSDP2 cells of many ranks (issue 51): real mpiexec ranks, gloo process groups, MPI replicas.

The one-replica reference in every rank program is the unsharded decoder training the whole
step's batch in one process; a sharded cell, or cells reducing over MPI, must give its loss and
(gathered) gradient within float32 rounding.
"""
import json
import socket

import pytest
import torch
import torch.distributed as dist

from gyre_hpc.cells import sharding
from gyre_hpc.cells.checkpoint import CheckpointMeta
from gyre_hpc.models.checkpoint import CheckpointError
from gyre_hpc.models.decoder import LMConfig, build_model

from cells_mpi import RANKS, mpiexec, ok

PROGRAM = str(RANKS / "sharded_step.py")
MEMORY = str(RANKS / "sharded_memory.py")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run(tmp_path, n, program, mode, *args, name="out.json"):
    """``program [mode] OUT PORT args...`` on n ranks; what rank 0 wrote."""
    out = tmp_path / name
    lead = [program] if mode is None else [program, mode]
    ok(mpiexec(n, [*lead, str(out), free_port(), *map(str, args)], timeout=180))
    return json.loads(out.read_text())


@pytest.mark.mpi
@pytest.mark.parametrize("cells,ranks", [(1, 2), (2, 1), (2, 2)])
def test_sharded_cells_give_one_replicas_loss_and_gradient(tmp_path, cells, ranks):
    got = run(tmp_path, cells * ranks, PROGRAM, "grad", cells, ranks)
    assert got["max_rel_grad"] <= 1e-5
    assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-6)
    assert got["master_dtype"] == "torch.float32"


@pytest.mark.mpi
def test_per_layer_activation_checkpointing_under_fsdp_gives_the_same_gradient(tmp_path):
    """train.activation_checkpointing: each FSDP layer is gathered again for its recompute."""
    got = run(tmp_path, 2, PROGRAM, "grad", 1, 2, "float32", "checkpoint-layers")
    assert got["max_rel_grad"] <= 1e-5
    assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-6)


@pytest.mark.mpi
def test_bf16_parameters_reduce_and_keep_float32(tmp_path):
    got = run(tmp_path, 2, PROGRAM, "grad", 1, 2, "bfloat16")
    assert (got["grad_dtype"], got["master_dtype"]) == ("torch.float32", "torch.float32")
    # bf16 compute: near the float32 replica (8 bits of mantissa), but not equal to it.
    assert 1e-5 < got["max_rel_grad"] < 0.05
    assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-2)


@pytest.mark.mpi
@pytest.mark.slow   # three launches, 7 ranks in all
def test_a_checkpoint_of_2_ranks_resumes_at_1_and_4(tmp_path):
    saved = run(tmp_path, 2, PROGRAM, "save", 2, tmp_path, name="save.json")
    assert saved["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "config.json", "meta.json"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    for n in (1, 4):
        got = run(tmp_path, n, PROGRAM, "load", n, tmp_path, name=f"load{n}.json")
        assert got["step"] == 1 and got["keys"] > 0
        assert got["unequal"] == [] and got["extra_keys"] == []        # the full state, bitwise
        for step in ("2", "3"):       # step 3 shows AdamW's moments came back too
            assert got["losses"][step] == pytest.approx(saved["losses"][step], rel=1e-6, abs=0)


@pytest.mark.mpi
def test_two_ranks_hold_half_the_training_state(tmp_path):
    one = run(tmp_path, 1, MEMORY, None, 2, name="m1.json")
    two = run(tmp_path, 2, MEMORY, None, 2, name="m2.json")
    assert one["n_params"] == two["n_params"] > 0
    full = one["per_rank"][0]
    assert full["params"] == full["grads"] == 4 * one["n_params"] and full["optimizer"] == 2 * full["params"]
    for row in two["per_rank"]:
        assert row["total"] <= 0.55 * full["total"]
    assert sum(r["params"] for r in two["per_rank"]) == full["params"]


# -- one process, no ranks --------------------------------------------------------------------

def test_a_model_dtype_other_than_float32_or_bfloat16_is_named():
    with pytest.raises(ValueError, match=r"model.dtype='float16'"):
        sharding.mixed_precision("float16")
    assert sharding.mixed_precision("bfloat16").param_dtype == torch.bfloat16
    assert sharding.mixed_precision("bfloat16").reduce_dtype == torch.float32
    assert sharding.mixed_precision("float32").param_dtype is None


def test_shard_model_refuses_what_is_not_the_decoder():
    with pytest.raises(TypeError, match="Linear, not the project's CausalLM"):
        sharding.shard_model(torch.nn.Linear(2, 2), None)


def test_replica_comm_refuses_a_negative_shard():
    from mpi4py import MPI
    with pytest.raises(ValueError, match="shard_index=-1"):
        sharding.replica_comm(MPI.COMM_SELF, -1)
    assert sharding.replica_comm(MPI.COMM_SELF, 3).Get_size() == 1


def test_local_grads_names_parameters_without_a_gradient():
    model = build_model(LMConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, d_ff=40))
    with pytest.raises(ValueError, match="no gradient on .* run the backward first"):
        sharding.local_grads(model)


def test_state_bytes_of_an_unsharded_model_after_a_step():
    model = build_model(LMConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, d_ff=40))
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 50, (1, 6))
    model(ids, torch.arange(6)[None]).sum().backward()
    opt.step()
    b = sharding.state_bytes(model, opt)
    n = model.n_params
    assert (b.params, b.grads, b.optimizer, b.total) == (4 * n, 4 * n, 8 * n, 16 * n)
    assert len(sharding.local_grads(model)) == len(list(model.parameters()))


def test_loading_a_directory_that_is_not_a_sealed_sharded_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        sharding.load_sharded(tmp_path, torch.nn.Linear(2, 2), None, None)


def test_save_sharded_in_a_one_rank_group_seals_a_checkpoint(tmp_path):
    """A 1-rank gloo group in this process: the staged dir is sealed and loads back."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        cfg = LMConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, d_ff=40)
        model = sharding.shard_model(build_model(cfg, seed=1), dist.group.WORLD)
        opt = torch.optim.AdamW(model.parameters())
        sealed = sharding.save_sharded(tmp_path, CheckpointMeta(step=5, policy_version=5, roles={}),
                                       model, opt, dist.group.WORLD)
        assert sealed.name == "step-00000005" and (tmp_path / "latest").read_text().strip() == sealed.name
        other = sharding.shard_model(build_model(cfg, seed=2), dist.group.WORLD)
        meta = sharding.load_sharded(sealed, other, torch.optim.AdamW(other.parameters()), dist.group.WORLD)
        assert meta.step == 5 and ".metadata" in meta.files
        for a, b in zip(model.parameters(), other.parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi
def test_export_of_a_2_rank_checkpoint_opens_in_transformers_with_the_models_logits(tmp_path):
    import transformers
    from click.testing import CliRunner

    from gyre_hpc.cli import main
    from gyre_hpc.models.tokenizer import embedded_tokenizer

    saved = run(tmp_path, 2, PROGRAM, "hf", 2, tmp_path)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "__1_0.distcp"} <= set(saved["files"])
    out = tmp_path / "hf"
    res = CliRunner().invoke(main, ["export", str(tmp_path / "checkpoints"), str(out)])   # latest
    assert res.exit_code == 0, res.output
    state = torch.load(tmp_path / "model-1.pt")
    ours = build_model(LMConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=90))
    ours.load_state_dict(state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([embedded_tokenizer().encode("Create mathx.py with a function add(a, b).")])
    with torch.no_grad():
        want = ours(ids, torch.arange(ids.shape[1])[None])
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=0, atol=1e-5)
    assert want.abs().max() > 0.1
    assert transformers.AutoTokenizer.from_pretrained(str(out)).encode("add(a, b)", add_special_tokens=False) == \
        embedded_tokenizer().encode("add(a, b)")
