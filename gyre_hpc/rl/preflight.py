"""Checks of an rl run's config against the registries it names, run by the head before launch
as ``python -m gyre_hpc.rl.preflight CONFIG --result FILE [--prepare build|lookup]``
(``config.WORKLOADS`` names it; ``jobs.preflight`` runs it and reads the answer).

Why here and not in ``config.py``: the task suites and model presets live in packages the
bottom-layer config may not import; without this an unknown name passed validation and
failed inside the fleet after four launches, the error only in the fleet log.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gyre_hpc.config import ConfigError, RunConfig, load_config


def check_config(cfg: RunConfig) -> None:
    """Raise ConfigError naming the field and the valid choices; returns quietly when fine."""
    from gyre_hpc.rl.tasks import load_tasks, task_suite_names

    from gyre_hpc.harness.confine import ConfinementError, check_confinement
    try:   # before any launch: a run whose tool calls would all be refused does not start
        check_confinement(cfg.rollout.allow_unconfined)
    except ConfinementError as exc:
        raise ConfigError(f"rollout.allow_unconfined=false: {exc}") from None
    if cfg.rollout.tasks not in task_suite_names():
        try:   # a directory of tasks is read whole here: a bad spec is refused before any launch
            load_tasks(cfg.rollout.tasks)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.model.gguf:   # found now (a typo fails before launch); imported by prepare_config
        from gyre_hpc.models.gguf_cache import GGUFSourceError, gguf_file

        try:
            gguf_file(cfg.model.gguf)
        except GGUFSourceError as exc:
            raise ConfigError(str(exc)) from None
        return
    if cfg.model.path:
        from gyre_hpc.models.checkpoint import CONFIG_FILE, is_checkpoint, read_config

        if not Path(cfg.model.path).is_dir():
            raise ConfigError(f"model.path={cfg.model.path!r} is not a checkpoint directory")
        if not is_checkpoint(cfg.model.path):
            raise ConfigError(f"model.path={cfg.model.path!r} holds no {CONFIG_FILE}: not an HF-format checkpoint "
                              f"directory")
        check_cell_shards(cfg, lambda: read_config(cfg.model.path))
        return
    from gyre_hpc.models.tiny_lm import PRESETS

    if cfg.model.preset not in PRESETS:
        raise ConfigError(f"model.preset={cfg.model.preset!r} is unknown; valid presets: {', '.join(sorted(PRESETS))}")
    check_cell_shards(cfg, lambda: cfg.model.preset)


def check_ranks_per_cell(cfg: RunConfig) -> None:
    """The rl workload's cells are one rank each for now (an engine or a whole replica): a
    cell of more ranks is refused here, before launch, and again by the fleet at start
    (``rl.fleet.check_rl_config``) for a config that skipped the preflight. The sharded
    training inside a cell exists (``cells.sharding``); the RL step does not use it yet."""
    if cfg.cells.ranks_per_cell != 1:
        raise ConfigError(f"cells.ranks_per_cell={cfg.cells.ranks_per_cell}: the rl workload runs one rank per "
                          f"cell (an engine or a replica each); set cells.ranks_per_cell=1")


def check_cell_shards(cfg: RunConfig, architecture) -> None:
    """ConfigError naming ``cells.ranks_per_cell`` and the tensor when a cell's ranks cannot
    each hold a slice of every parameter (``cells.shard_shape``). ``architecture()``: the
    preset name or LMConfig; the model is built on the meta device, so no weights are made
    (a 7B model is checked in milliseconds)."""
    if cfg.cells.ranks_per_cell == 1:
        return
    import torch

    from gyre_hpc.cells.shard_shape import check_shardable, parameter_shapes
    from gyre_hpc.models.decoder import PRESETS, CausalLM

    arch = architecture()
    with torch.device("meta"):
        model = CausalLM(PRESETS[arch] if isinstance(arch, str) else arch)
    try:
        check_shardable(parameter_shapes(model.named_parameters()), cfg.cells.ranks_per_cell)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_ranks_per_cell(cfg)


def prepare_config(cfg: RunConfig, build: bool, log=print) -> RunConfig:
    """``cfg`` starting from its warm-start checkpoint (``warmstart.cache.with_warmstart``), its
    ``model.path`` made absolute. Why absolute: a relative path is the user's, from where they
    started the run, but the fleet's ranks start in the run directory, where it names nothing
    (found after four launches, the error only in the fleet log). A task directory's path
    likewise."""
    from gyre_hpc.warmstart.cache import with_warmstart

    cfg = with_warmstart(with_gguf_checkpoint(absolute_task_dirs(cfg), log=log), log=log, build=build)
    if cfg.model.path and not Path(cfg.model.path).is_absolute():
        path = str(Path(cfg.model.path).expanduser().resolve())
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": path})})
    return cfg


def with_gguf_checkpoint(cfg: RunConfig, log=print) -> RunConfig:
    """``cfg`` starting from the checkpoint imported from ``model.gguf`` (``models.gguf_cache``;
    imported on first use, a few seconds to a minute, so a login node may do it): ``model.path``
    set to that folder, ``model.gguf`` cleared (the two are exclusive)."""
    if not cfg.model.gguf:
        return cfg
    from gyre_hpc.models.gguf_cache import cached_gguf_checkpoint

    try:
        path = cached_gguf_checkpoint(cfg.model.gguf, Path(cfg.model.gguf_cache_dir).expanduser(), log=log)
    except ValueError as exc:
        raise ConfigError(f"model.gguf={cfg.model.gguf!r}: {exc}") from None
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"gguf": None, "path": str(path)})})


def absolute_task_dirs(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``rollout.tasks`` and ``warmstart.tasks`` made absolute where they name a
    directory of tasks (a suite's name stays as it is)."""
    from gyre_hpc.harness.tasks import is_task_dir
    from gyre_hpc.rl.tasks import task_suite_names

    for section in ("rollout", "warmstart"):
        part = getattr(cfg, section)
        if part.tasks is None or part.tasks in task_suite_names() or not is_task_dir(part.tasks):
            continue
        path = str(Path(part.tasks).expanduser().resolve())
        cfg = cfg.model_copy(update={section: part.model_copy(update={"tasks": path})})
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre_hpc.rl.preflight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--result", required=True, help='where to write {"config": YAML} or {"error": MESSAGE}')
    parser.add_argument("--prepare", choices=("build", "lookup"),
                        help="also resolve the warm start (build: train it if missing; lookup: only find it)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        check_config(cfg)
        if args.prepare is not None:
            cfg = prepare_config(cfg, build=args.prepare == "build", log=lambda m: print(m, flush=True))
        answer = {"config": cfg.to_yaml()}
    except ConfigError as exc:
        answer = {"error": str(exc)}
    Path(args.result).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
