"""Whether a model can be sharded over a cell's ranks: checked before anything starts.

Why the rule is "every rank holds a slice of every tensor" and not "the ranks divide every
first dimension": FSDP2 (``cells.sharding``) splits each parameter on dim 0 and pads the last
slice, so 101 vocabulary rows over 4 ranks is fine (tests/cells/test_sharding.py trains it).
What it cannot do usefully is give a rank an empty slice: with more ranks than a tensor has
rows, the extra ranks hold nothing of it, and where that is the narrowest tensor of every
layer (a norm's ``d_model``, a kv projection's rows) those ranks only add gathers. The plan
refuses that shape by name, before any rank starts, instead of running a cell that cannot
pay for its ranks.

Pure functions of parameter shapes, so they test without processes; no MPI or torch.distributed
import (the head's preflight calls this before any launch).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence


def narrowest(shapes: Mapping[str, Sequence[int]]) -> tuple[str, int]:
    """The parameter with the fewest rows on dim 0 (the dim FSDP2 shards), and that count."""
    if not shapes:
        raise ValueError("narrowest: the model has no parameters")
    name = min(shapes, key=lambda n: (shapes[n][0] if shapes[n] else 1, n))
    shape = shapes[name]
    return name, (shape[0] if shape else 1)


def check_shardable(shapes: Mapping[str, Sequence[int]], ranks: int, field: str = "cells.ranks_per_cell") -> None:
    """ValueError naming ``field``, the tensor and its rows when ``ranks`` ranks cannot each
    hold a slice of every parameter (``shapes``: name -> shape). One rank always can."""
    if ranks < 1:
        raise ValueError(f"{field}={ranks} must be >= 1")
    if ranks == 1:
        return
    name, rows = narrowest(shapes)
    if rows < ranks:
        raise ValueError(f"{field}={ranks}: the model's {name} has {rows} rows on the sharded dimension, so "
                         f"{ranks - rows} of the cell's {ranks} ranks would hold none of it; "
                         f"at most {rows} ranks per cell shard this model")


def parameter_shapes(named: Iterable[tuple[str, object]]) -> dict[str, tuple[int, ...]]:
    """name -> shape of ``model.named_parameters()`` (a meta-device model costs no memory)."""
    return {name: tuple(p.shape) for name, p in named}
