"""Printing a command's figures: JSON for tools, an indented listing for people.

A bottom-layer module so that every command (the benchmarks, ``gyre-hpc sim``) prints the
same way without a lower package importing a higher one.
"""
from __future__ import annotations

import json
import sys

import click


def emit(result: dict, as_json: bool) -> None:
    """Print ``result``: JSON (``as_json``) or one ``key: value`` line per leaf, indented by depth."""
    if as_json:
        json.dump(result, sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
        return

    def walk(d: dict, indent: int = 0) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                click.echo(" " * indent + f"{k}:")
                walk(v, indent + 2)
            else:
                click.echo(" " * indent + f"{k}: {v}")
    walk(result)
