"""Scheduler policies by name, as the config and the simulator spell them.

Each entry is a factory taking the policy's parameters as keywords. Unknown names and
unknown parameters raise an error listing what would have been valid. Entries are module
paths imported on demand, so ``scripted`` (written with the cells runtime) is only imported
when asked for.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from gyre_hpc.sched.state import Policy

# THE list of policy names: the run config validates ``scheduler.policy`` against it and
# the simulator and benchmarks take their names from it.
# name -> "module:factory"; factory(**params) -> Policy
POLICIES: dict[str, str] = {
    "elastic": "gyre_hpc.sched.registry:_elastic",
    "colocate": "gyre_hpc.sched.colocate:ColocatePolicy",
    "async": "gyre_hpc.sched.async_split:AsyncSplitPolicy",
    "scripted": "gyre_hpc.sched.scripted:make_policy",
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def _elastic(**params: Any) -> Policy:
    from gyre_hpc.sched.elastic import ElasticParams, ElasticPolicy
    _check_params("elastic", ElasticParams, params)
    return ElasticPolicy(ElasticParams(**params))


def _check_params(name: str, factory: Callable[..., Any], params: dict[str, Any]) -> None:
    if dataclasses.is_dataclass(factory):
        fields = dataclasses.fields(factory)
        valid = sorted(f.name for f in fields)
        missing = sorted(f.name for f in fields if f.name not in params and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ValueError(f"policy {name!r} needs {', '.join(missing)} (no default: an explicit input)")
    else:
        sig = inspect.signature(factory)
        if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            return  # the factory checks its own keywords (e.g. ``_elastic``)
        valid = sorted(sig.parameters)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no parameter {', '.join(unknown)}; valid parameters: {', '.join(valid) or '(none)'}")


def _load(name: str) -> Callable[..., Policy]:
    module, attr = POLICIES[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ValueError(f"policy {name!r} is registered but its module {module} is missing: {exc}") from None
    factory = getattr(mod, attr, None)
    if factory is None:
        raise ValueError(f"policy {name!r}: module {module} defines no {attr}")
    return factory


def get_policy(name: str, **params: Any) -> Policy:
    """The policy ``name`` built with ``params``; the result is a callable ClusterState -> RoleChanges."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduler policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}")
    factory = _load(name)
    _check_params(name, factory, params)
    return factory(**params)


def policy_from_config(scheduler: Any) -> Policy:
    """The policy a run's ``scheduler`` config section names, with the parameters it sets."""
    if scheduler.policy == "async":
        return get_policy("async", train_cells=scheduler.async_train_cells, max_staleness=scheduler.max_staleness)
    if scheduler.policy == "elastic":
        return get_policy("elastic", **dict(getattr(scheduler, "elastic", None) or {}))
    return get_policy(scheduler.policy)
