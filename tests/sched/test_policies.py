"""Each policy's decisions pinned on hand-built cluster states."""
from __future__ import annotations

import pytest

from gyre_hpc.sched.async_split import AsyncSplitPolicy
from gyre_hpc.sched.colocate import ColocatePolicy
from gyre_hpc.sched.elastic import ElasticParams, ElasticPolicy
from gyre_hpc.sched.registry import get_policy, policy_from_config
from gyre_hpc.sched.staleness import may_start_rollout, staleness_bound
from gyre_hpc.sched.state import CellKind, CellState, ClusterState, Role

R, T = Role.ROLLOUT, Role.TRAIN


def cells(roles: str, inflight: dict[int, int] | None = None, switching: set[int] = frozenset(),
          rollout_only: set[int] = frozenset()) -> tuple[CellState, ...]:
    """'TRRR' -> core cell 0 in TRAIN, cells 1..3 ROLLOUT; every cell trains at 100 tok/s."""
    inflight = inflight or {}
    out = []
    for i, ch in enumerate(roles):
        kind = CellKind.CORE if i == 0 else CellKind.ROLLOUT_ONLY if i in rollout_only else CellKind.ELASTIC
        out.append(CellState(cell=i, kind=kind, role=R if ch == "R" else T, switching=i in switching,
                             inflight_requests=inflight.get(i, 0), train_tokens_per_s=100.0))
    return tuple(out)


def state(roles: str, **kw) -> ClusterState:
    cell_kw = {k: kw.pop(k) for k in ("inflight", "switching", "rollout_only") if k in kw}
    inflight = sum((cell_kw.get("inflight") or {}).values())
    kw.setdefault("inflight_requests", inflight)
    kw.setdefault("unfinished_runs", inflight)
    return ClusterState(time=0.0, step=0, cells=cells(roles, **cell_kw), **kw)


ELASTIC = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=1.0))
BIG_BACKLOG = 10**6  # 10^6 tokens at 100 tok/s per replica: far more than a switch round trip


def flips(changes) -> dict[int, Role]:
    return {c.cell: c.to for c in changes}


# ---- elastic -------------------------------------------------------------------------

def test_elastic_releases_rollout_cell_when_unfinished_work_fits_remaining_engines():
    # 4 engines, 5 runs left (target 4 per engine): they fit in 2 engines, so 2 cells train,
    # the ones with the least to migrate (cells 2 and 4 hold 1 and 0 requests).
    s = state("TRRRR", inflight={1: 2, 2: 1, 3: 2, 4: 0}, train_backlog_tokens=BIG_BACKLOG)
    got = ELASTIC(s)
    assert flips(got) == {4: T, 2: T}
    assert all(c.reason for c in got)


def test_elastic_counts_kv_tokens_in_flight_when_engines_report_their_capacity():
    # 3 requests fit 1 engine by count, but 2500 KV tokens need 2 engines of 2000 (fill 1).
    kv = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=1.0, kv_tokens_per_engine=2000))
    s = state("TRRRR", inflight={1: 1, 2: 1, 3: 1, 4: 0}, tokens_inflight=2500, train_backlog_tokens=BIG_BACKLOG)
    assert len(kv(s)) == 2           # 4 engines -> 2
    assert len(ELASTIC(s)) == 3      # by requests alone: 4 engines -> 1


def test_elastic_keeps_engines_when_unfinished_work_would_not_fit():
    s = state("TRRR", inflight={1: 4, 2: 4, 3: 3}, train_backlog_tokens=BIG_BACKLOG)
    assert ELASTIC(s) == []


def test_elastic_counts_runs_in_tool_calls_as_demand():
    # Nothing decodes, but 8 runs are in tool calls and come back: 8 runs need 2 engines of 4.
    s = state("TRRR", unfinished_runs=8, train_backlog_tokens=BIG_BACKLOG)
    assert flips(ELASTIC(s)) == {3: T}


def test_elastic_never_drains_last_engine_while_runs_unfinished():
    s = state("TRR", inflight={1: 1, 2: 0}, train_backlog_tokens=BIG_BACKLOG)
    assert flips(ELASTIC(s)) == {2: T}
    last = state("TRT", inflight={1: 1}, train_backlog_tokens=BIG_BACKLOG)
    assert ELASTIC(last) == []
    # A run in a tool call (nothing in flight) still holds the last engine.
    idle_tail = state("TRT", unfinished_runs=1, train_backlog_tokens=BIG_BACKLOG)
    assert ELASTIC(idle_tail) == []


def test_elastic_releases_every_engine_once_all_runs_finished():
    s = state("TRRR", unfinished_runs=0, train_backlog_tokens=BIG_BACKLOG)
    assert flips(ELASTIC(s)) == {1: T, 2: T, 3: T}


def test_elastic_does_not_release_when_backlog_is_shorter_than_the_switch():
    # 1000 tokens at 100 tok/s is gone in 10 s, before an 8.5 s switch plus 3.5 s back pays off.
    s = state("TRRR", unfinished_runs=0, train_backlog_tokens=1000)
    assert ELASTIC(s) == []


def test_elastic_reclaims_train_cells_when_queue_grows_and_backlog_is_low():
    s = state("TTTT", unfinished_runs=12, queued_requests=12, train_backlog_tokens=0)
    assert flips(ELASTIC(s)) == {1: R, 2: R, 3: R}


def test_elastic_reclaims_only_what_the_queue_needs_while_backlog_is_high():
    # 6 requests waiting, 1 engine (target 4): one more engine is needed; the rest keep training.
    s = state("TRTTT", inflight={1: 4}, queued_requests=2, unfinished_runs=6, train_backlog_tokens=BIG_BACKLOG)
    assert flips(ELASTIC(s)) == {4: R}


def test_elastic_never_flips_core_rollout_only_or_switching_cells():
    s = state("TRRRR", unfinished_runs=0, train_backlog_tokens=BIG_BACKLOG, switching={2}, rollout_only={3})
    got = flips(ELASTIC(s))
    assert got == {1: T, 4: T}
    assert 0 not in flips(ELASTIC(state("TTT", queued_requests=50, unfinished_runs=50)))


def test_elastic_release_and_reclaim_do_not_flap():
    # After a release, the state the policy sees next must not trigger a reclaim.
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=0.8))
    s = state("TRRRR", inflight={1: 3, 2: 3, 3: 0, 4: 0}, train_backlog_tokens=BIG_BACKLOG)
    released = flips(p(s))
    assert released
    roles = "".join("T" if i == 0 or i in released else "R" for i in range(5))
    after = state(roles, inflight={1: 3, 2: 3}, train_backlog_tokens=BIG_BACKLOG)
    assert p(after) == []


def test_elastic_params_reject_bad_values_by_name():
    with pytest.raises(ValueError, match="fill"):
        ElasticParams(fill=0)
    with pytest.raises(ValueError, match="target_requests_per_engine"):
        ElasticParams(target_requests_per_engine=0)


# ---- colocate ------------------------------------------------------------------------

def test_colocate_rolls_out_everything_while_runs_unfinished():
    s = state("TTTT", unfinished_runs=3, queued_requests=3)
    assert flips(ColocatePolicy()(s)) == {1: R, 2: R, 3: R}


def test_colocate_trains_everything_once_batch_done():
    s = state("TRRR", unfinished_runs=0, train_backlog_tokens=10)
    assert flips(ColocatePolicy()(s)) == {1: T, 2: T, 3: T}


@pytest.mark.parametrize("roles,unfinished,backlog", [
    ("TRRRR", 1, 5), ("TTTTT", 4, 0), ("TRRRR", 0, 100), ("TRTRT", 2, 0), ("TRTRT", 0, 9), ("TRRTT", 0, 0)])
def test_colocate_never_mixes_roles_among_elastic_cells(roles, unfinished, backlog):
    s = state(roles, unfinished_runs=unfinished, train_backlog_tokens=backlog)
    got = flips(ColocatePolicy()(s))
    after = {c.cell: got.get(c.cell, c.role) for c in s.cells if c.kind is CellKind.ELASTIC}
    if unfinished or backlog:
        assert len(set(after.values())) == 1, after
    assert 0 not in got


def test_colocate_leaves_rollout_only_and_switching_cells():
    s = state("TRRR", unfinished_runs=0, train_backlog_tokens=10, rollout_only={3}, switching={2})
    assert flips(ColocatePolicy()(s)) == {1: T}


# ---- async ---------------------------------------------------------------------------

def test_async_sets_and_keeps_its_fixed_split():
    p = AsyncSplitPolicy(train_cells=2, max_staleness=1)
    assert flips(p(state("TRRR", unfinished_runs=9))) == {1: T}
    # Once at the split it never moves, whatever the load.
    for kw in (dict(unfinished_runs=0, train_backlog_tokens=BIG_BACKLOG), dict(unfinished_runs=50, queued_requests=50)):
        assert p(state("TTRR", **kw)) == []


def test_async_split_that_leaves_no_engine_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="async_train_cells=3"):
        AsyncSplitPolicy(train_cells=3)(state("TRR"))


def test_async_respects_staleness_bound():
    p = AsyncSplitPolicy(train_cells=2, max_staleness=1)
    assert staleness_bound(p) == 1
    assert may_start_rollout(batch_step=4, policy_version=3, max_staleness=staleness_bound(p))
    assert not may_start_rollout(batch_step=5, policy_version=3, max_staleness=staleness_bound(p))
    # On-policy schedules wait for the newest weights.
    assert staleness_bound(ColocatePolicy()) == 0 and staleness_bound(ELASTIC) == 0
    assert not may_start_rollout(batch_step=4, policy_version=3, max_staleness=0)
    assert may_start_rollout(batch_step=3, policy_version=3, max_staleness=0)


# ---- registry ------------------------------------------------------------------------

def test_registry_builds_policies_and_lists_valid_names():
    assert isinstance(get_policy("elastic", fill=0.5), ElasticPolicy)
    assert get_policy("async", train_cells=3).train_cells == 3
    with pytest.raises(ValueError, match="valid policies: async, colocate, elastic, scripted"):
        get_policy("greedy")
    with pytest.raises(ValueError, match="valid parameters: max_staleness, train_cells"):
        get_policy("async", split=3)


def test_policy_from_config_uses_the_scheduler_section():
    from gyre_hpc.config import build_config
    cfg = build_config({"cells": {"count": 4}, "scheduler": {"policy": "async", "async_train_cells": 2, "max_staleness": 2}})
    p = policy_from_config(cfg.scheduler)
    assert (p.train_cells, p.max_staleness) == (2, 2)


def test_registry_resolves_scripted_lazily_from_its_module():
    p = get_policy("scripted")
    s = state("TRR", unfinished_runs=1)
    assert p(s) == p(s)  # pure: asking twice decides the same
    assert all(c.cell != 0 for c in p(s))
    with pytest.raises(ValueError, match=r"'scripted' has no parameter speed; valid parameters: \(none\)"):
        get_policy("scripted", speed=2)


def test_policy_from_config_passes_elastic_parameters_and_names_bad_ones():
    from gyre_hpc.config import build_config
    cfg = build_config({"scheduler": {"policy": "elastic", "elastic": {"target_requests_per_engine": 8, "fill": 0.5}}})
    p = policy_from_config(cfg.scheduler)
    assert (p.params.target_requests_per_engine, p.params.fill) == (8, 0.5)
    # refused when the config is built (before anything starts), by the same registry check
    with pytest.raises(ValueError, match="no parameter slots; valid parameters: .*target_requests_per_engine"):
        build_config({"scheduler": {"elastic": {"slots": 3}}})


def test_capacity_helpers_count_engines_demand_and_trainers():
    from gyre_hpc.sched.capacity import arriving_engines, flippable, rollout_demand, serving_engines, trainers_rate
    s = state("TRRTR", inflight={1: 2, 2: 1}, switching={2, 3}, rollout_only={4}, unfinished_runs=7, queued_requests=1)
    assert [c.cell for c in serving_engines(s)] == [1, 4]          # 2 is still switching to ROLLOUT
    assert [c.cell for c in arriving_engines(s)] == [1, 2, 4]
    assert [c.cell for c in flippable(s, Role.ROLLOUT)] == [1]       # not core, not switching, not rollout-only
    assert rollout_demand(s) == 7                                     # max(3 in flight + 1 queued, 7 runs)
    assert trainers_rate(s, 5.0) == 200.0                             # cells 0 and 3 at 100 tok/s each
    with pytest.raises(ValueError, match="max_staleness"):
        may_start_rollout(1, 0, -1)
