"""``gyre-hpc warmstart CONFIG``: build (or find) the warm-start checkpoint of a run config."""
from __future__ import annotations

import json
from pathlib import Path

import click

from gyre_hpc.config import ConfigError, load_config


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config field")
@click.option("--force", is_flag=True, help="rebuild even if a cached checkpoint exists")
@click.option("--ship", is_flag=True, help="also copy the checkpoint into the package (gyre_hpc/warmstart/shipped)")
@click.option("--json", "as_json", is_flag=True, help="print the build report as JSON")
def warmstart(config: str, overrides: tuple[str, ...], force: bool, ship: bool, as_json: bool) -> None:
    """Train the model on scripted-teacher trajectories of the suite; save an HF checkpoint."""
    from gyre_hpc.warmstart.cache import ensure_warmstart, ship_warmstart

    try:
        cfg = load_config(config, list(overrides))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        path = ensure_warmstart(cfg, force=force, log=(lambda m: click.echo(m, err=True)))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    report = json.loads((Path(path) / "warmstart.json").read_text())
    report["checkpoint"] = str(path)
    if ship:
        report["shipped"] = str(ship_warmstart(path))
        click.echo(f"shipped as {report['shipped']}", err=True)
    click.echo(json.dumps(report, indent=1) if as_json else f"warm-start checkpoint: {path}")
