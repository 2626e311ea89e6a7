"""The environment a rank sets up before MPI and torch start."""
import os
import shutil
import uuid

from gyre_hpc.cells.rank_env import prepare_rank_env


def test_outside_slurm_only_huge_pages_are_asked_for():
    env = {}
    assert prepare_rank_env(env) == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert env == {"THP_MEM_ALLOC_ENABLE": "1"}


def test_under_slurm_each_node_gets_its_own_shared_memory_directory():
    node = f"test-{uuid.uuid4().hex[:8]}"
    env = {"SLURMD_NODENAME": node, "THP_MEM_ALLOC_ENABLE": "0"}
    try:
        done = prepare_rank_env(env)
        backing = env["OMPI_MCA_btl_vader_backing_directory"]
        assert done == {"OMPI_MCA_btl_vader_backing_directory": backing}
        assert backing.endswith(f"gyre-{node}") and os.path.isdir(backing)
        assert env["THP_MEM_ALLOC_ENABLE"] == "0"                     # the user's choice stands
        other = prepare_rank_env({"SLURMD_NODENAME": node + "x"})["OMPI_MCA_btl_vader_backing_directory"]
        assert other != backing                                      # two virtual nodes, two dirs
        shutil.rmtree(other, ignore_errors=True)
    finally:
        shutil.rmtree(env.get("OMPI_MCA_btl_vader_backing_directory", "/nonexistent"), ignore_errors=True)


def test_a_backing_directory_the_user_chose_is_kept():
    env = {"SLURMD_NODENAME": "c9", "OMPI_MCA_btl_vader_backing_directory": "/somewhere"}
    assert "OMPI_MCA_btl_vader_backing_directory" not in prepare_rank_env(env)
    assert env["OMPI_MCA_btl_vader_backing_directory"] == "/somewhere"
