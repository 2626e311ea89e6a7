"""``gyre-hpc``: one console command; each subcommand lives beside the code it drives.

Subcommands are imported lazily so ``gyre-hpc cluster status`` does not pay for torch.
"""
from __future__ import annotations

import importlib

import click

from gyre_hpc.bench import BENCHMARKS  # the table of names only; each benchmark loads when asked

# name -> "module:click_command". A later part adds its subcommand here and nowhere else.
COMMANDS = {
    "run": "gyre_hpc.jobs.cli:run",
    "submit": "gyre_hpc.jobs.cli:submit",
    "cluster": "gyre_hpc.jobs.cluster_cli:cluster",
    "inspect": "gyre_hpc.rundir.inspect:inspect",
    "report": "gyre_hpc.rundir.report:report",
    "bench": "gyre_hpc.cli:bench",
    "sim": "gyre_hpc.sim.cli:sim",
    "warmstart": "gyre_hpc.warmstart.cli:warmstart",
    "models": "gyre_hpc.models.cli:models",
    "export": "gyre_hpc.cells.export:export",
}


class LazyGroup(click.Group):
    def __init__(self, *args, lazy: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def get_command(self, ctx, name):
        if name in self._lazy:
            module, attr = self._lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Slurm-native elastic RL for long-horizon LLM agents."""


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench() -> None:
    """Measure a part against its baseline, in one run; `--json` for machine-readable output."""
