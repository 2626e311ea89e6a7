"""Each policy's decisions pinned on hand-built cluster states."""
from __future__ import annotations

import dataclasses

import pytest

from gyre_hpc.sched.async_split import AsyncSplitPolicy
from gyre_hpc.sched.colocate import ColocatePolicy
from gyre_hpc.sched.elastic import ElasticParams, ElasticPolicy, release_order
from gyre_hpc.sched.registry import get_policy, policy_from_config
from gyre_hpc.sched.staleness import may_start_rollout, staleness_bound
from gyre_hpc.sched.state import CellKind, CellState, ClusterState, Role

R, T = Role.ROLLOUT, Role.TRAIN


def cells(roles: str, inflight: dict[int, int] | None = None, switching: set[int] = frozenset(),
          rollout_only: set[int] = frozenset(), no_moments: set[int] = frozenset()) -> tuple[CellState, ...]:
    """'TRRR' -> core cell 0 in TRAIN, cells 1..3 ROLLOUT; every cell trains at 100 tok/s."""
    inflight = inflight or {}
    out = []
    for i, ch in enumerate(roles):
        kind = CellKind.CORE if i == 0 else CellKind.ROLLOUT_ONLY if i in rollout_only else CellKind.ELASTIC
        out.append(CellState(cell=i, kind=kind, role=R if ch == "R" else T, switching=i in switching,
                             inflight_requests=inflight.get(i, 0), train_tokens_per_s=100.0,
                             holds_moments=i not in no_moments))
    return tuple(out)


def state(roles: str, **kw) -> ClusterState:
    cell_kw = {k: kw.pop(k) for k in ("inflight", "switching", "rollout_only", "no_moments") if k in kw}
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


def test_elastic_reclaims_at_once_when_no_engine_serves_or_arrives():
    # A new batch after everything trained: nothing can serve it, so no hysteresis applies.
    s = state("TTTT", unfinished_runs=12, queued_requests=12, train_backlog_tokens=0)
    got = ELASTIC(s)
    assert flips(got) == {1: R, 2: R, 3: R}
    assert "no engine serving or arriving" in got[0].reason


def test_a_batch_starting_with_nothing_to_train_brings_every_replica_back():
    # 2 runs fit one engine at the target, but nothing is left to train: every cell serves
    # the batch (a replica kept would idle while the batch decodes on fewer engines). With a
    # backlog, only as many as the runs need.
    idle = ELASTIC(state("TTTTTT", unfinished_runs=2, queued_requests=2, train_backlog_tokens=0))
    assert flips(idle) == {c: R for c in range(1, 6)}
    busy = ELASTIC(state("TTTTTT", unfinished_runs=2, queued_requests=2, train_backlog_tokens=50_000))
    assert flips(busy) == {5: R}


def test_a_batch_end_sends_the_engines_left_to_train_when_cells_were_released_during_it():
    # The batch is over, cells 3-5 were released during it and train; cells 1-2 still serve.
    # 1000 tokens would not repay their switch on their own, but an engine left serving would
    # take every first call of the next batch before the replicas are back (a run stays on
    # the engine that caches its prefix): they train too, as colocate's would.
    got = ELASTIC(state("TRRTTT", unfinished_runs=0, train_backlog_tokens=1000))
    assert flips(got) == {1: T, 2: T}
    assert "next batch starts on every cell at once" in got[0].reason
    # Nothing released during the batch (every cell serves): the next batch has them all
    # anyway, and a backlog shorter than the switch keeps them (the pay check).
    assert ELASTIC(state("TRRRRR", unfinished_runs=0, train_backlog_tokens=1000)) == []
    # Holding a split at staleness 1, the split's engines stay for the next batch.
    held = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=1.0, max_staleness=1, train_floor_cells=2))
    assert held(state("TRRTTT", unfinished_runs=0, train_backlog_tokens=1000)) == []


def test_a_split_held_off_policy_releases_what_the_open_runs_do_not_need_once_no_run_can_start():
    # Floor 3 of 6 cells (0, 4, 5 train); engines 1-3 hold 10 open runs; an engine admits 8.
    held = ElasticPolicy(ElasticParams(target_requests_per_engine=2, fill=1.0, max_staleness=1,
                                       train_floor_cells=3, max_requests_per_engine=8))
    engines = {1: 4, 2: 4, 3: 2}
    # A batch may still start: every engine of the split stays, whatever the occupancy.
    assert held(state("TRRRTT", inflight=engines, train_backlog_tokens=BIG_BACKLOG)) == []
    # No run starts before the update: 10 runs need 2 engines of 8; the one with the least to
    # migrate trains (the on-policy sizing, 2 a engine, would keep all three).
    got = held(state("TRRRTT", inflight=engines, train_backlog_tokens=BIG_BACKLOG, next_batch_waits=True))
    assert flips(got) == {3: T} and "no run starts before the update" in got[0].reason
    # Nothing to train, or a device whose admission limit is unknown: nothing goes.
    assert held(state("TRRRTT", inflight=engines, next_batch_waits=True)) == []
    unknown = ElasticPolicy(dataclasses.replace(held.params, max_requests_per_engine=0))
    assert unknown(state("TRRRTT", inflight=engines, train_backlog_tokens=BIG_BACKLOG, next_batch_waits=True)) == []
    # KV decides when it binds: 3 x 1000 tokens of capacity, 1500 in flight, need 2 engines.
    kv = ElasticPolicy(dataclasses.replace(held.params, kv_tokens_per_engine=1000))
    assert flips(kv(state("TRRRTT", inflight={1: 1, 2: 1, 3: 1}, tokens_inflight=1500,
                          train_backlog_tokens=BIG_BACKLOG, next_batch_waits=True))) == {3: T}
    # Released, the cell trains until a batch may start (or a call waits): then the split is back.
    after = dict(inflight={1: 5, 2: 5}, train_backlog_tokens=BIG_BACKLOG)
    assert held(state("TRRTTT", next_batch_waits=True, **after)) == []
    back = held(state("TRRTTT", **after))
    assert flips(back) == {5: R} and "a batch may start" in back[0].reason
    assert flips(held(state("TRRTTT", next_batch_waits=True, queued_requests=1, **after))) == {5: R}


def test_a_held_split_releases_an_engine_that_holds_the_moments_and_returns_one_that_does_not():
    """A cell without the core's moments joins weights only and takes the core's new weights at
    every update it trains for, a broadcast the step's end waits on (paper-local, paced: the
    update took 0.6-1.1 s with one, 0.4-0.5 s with a joiner that held the moments)."""
    held = ElasticPolicy(ElasticParams(target_requests_per_engine=2, fill=1.0, max_staleness=1,
                                       train_floor_cells=3, max_requests_per_engine=8))
    go = dict(inflight={1: 4, 2: 4, 3: 2}, train_backlog_tokens=BIG_BACKLOG, next_batch_waits=True)
    # 10 open runs need 2 engines. Cell 3 has the least to migrate but no moments: cell 2 goes.
    assert flips(held(state("TRRRTT", no_moments={3}, **go))) == {2: T}
    # Where no engine holds them, the least to migrate decides, as before.
    assert flips(held(state("TRRRTT", no_moments={1, 2, 3}, **go))) == {3: T}
    # A batch may start: the one replica beyond the floor returns, the one without moments
    # (cell 3) rather than the highest id (cell 5), which would leave cell 3 training weights only.
    back = dict(inflight={1: 5, 2: 5}, train_backlog_tokens=BIG_BACKLOG)
    assert flips(held(state("TRRTTT", no_moments={3}, **back))) == {3: R}
    assert flips(held(state("TRRTTT", **back))) == {5: R}


def test_release_order_puts_the_moments_first_then_the_least_to_migrate():
    cs = cells("TRRRR", inflight={1: 3, 2: 1, 3: 1, 4: 0}, no_moments={4})
    assert [c.cell for c in sorted(cs[1:], key=release_order)] == [3, 2, 1, 4]


STEP = dict(step_fixed_s=0.01, step_per_seq_s=0.0001, step_per_kv_token_s=1e-9)


def test_elastic_release_keeps_the_step_within_tail_slowdown_of_every_cell_serving():
    # 8 runs on 4 engines; by requests they fit one engine of 8 (fill 1). What a step reads
    # decides. The step: 10 ms + 0.1 ms a sequence + 1 ms per 1M KV tokens, spread over the
    # engines. Against the 5 non-core cells serving (10.36 ms with 1M KV tokens), 3 engines
    # take 2.3% longer, 2 engines 5.2%: with tail_slowdown 5% one engine (cell 4) goes, with
    # 2% none.
    inflight = {1: 2, 2: 2, 3: 2, 4: 2}

    def go(slowdown: float, kv: int):
        p = ElasticPolicy(ElasticParams(target_requests_per_engine=8, fill=1.0, tail_slowdown=slowdown, **STEP))
        return flips(p(state("TRRRRT", inflight=inflight, tokens_inflight=kv, train_backlog_tokens=BIG_BACKLOG)))
    assert go(0.05, 1_000_000) == {4: T}
    assert go(0.02, 1_000_000) == {}
    # Short contexts (10K KV tokens): 2 engines are 2.4% slower, 1 engine 6.4%: two go.
    assert go(0.05, 10_000) == {4: T, 3: T}
    # Without a step model (a fleet that never measured one) requests and KV capacity decide.
    unmodelled = ElasticPolicy(ElasticParams(target_requests_per_engine=8, fill=1.0))
    assert flips(unmodelled(state("TRRRRT", inflight=inflight, tokens_inflight=1_000_000,
                                  train_backlog_tokens=BIG_BACKLOG))) == {2: T, 3: T, 4: T}


def test_elastic_step_model_is_the_device_models_step():
    from gyre_hpc.devices import EngineModel, TrainModel
    from gyre_hpc.sched.elastic import device_sized

    e = EngineModel(single_seq_tokens_per_s=100.0, half_saturation_seqs=256.0, max_seqs=256, gpus=64,
                    gpu_memory_gb=80.0, weights_gb=2400.0, kv_bytes_per_token=104_000.0, gpu_bandwidth_gb_s=3350.0)
    p = device_sized(e, TrainModel())
    assert p.tail_slowdown == e.tolerated_slowdown
    for n, kv in ((1, 0.0), (10, 3.5e6), (85, 3e7)):
        assert p.step_s(1, n, kv) == pytest.approx(e.step_s(n, kv), rel=1e-12)
        assert p.step_s(4, 4 * n, 4 * kv) == pytest.approx(e.step_s(n, kv), rel=1e-12)   # spread evenly


def test_elastic_reclaims_only_after_demand_is_sustained_for_reclaim_after_s():
    # 6 requests of 3 runs (sub-agents call in parallel), 1 engine (target 4): one more engine
    # is needed, but only once the queue has outlasted the hysteresis interval; the runs
    # alone fit, so nothing else brings a cell back, and the rest keep training.
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=1.0, reclaim_after_s=30.0))
    kw = dict(inflight={1: 4}, queued_requests=2, unfinished_runs=3, train_backlog_tokens=BIG_BACKLOG)
    assert p(state("TRTTT", demand_over_capacity_s=0.0, **kw)) == []     # queued for an instant
    assert p(state("TRTTT", demand_over_capacity_s=29.0, **kw)) == []
    got = p(state("TRTTT", demand_over_capacity_s=30.0, **kw))
    assert flips(got) == {4: R}
    assert "demand 6 > 1 engines x 4" in got[0].reason and "30s >= 30s" in got[0].reason
    # Demand above the target with nothing queued (engines hold more than the target) is
    # still demand once sustained.
    over = state("TRTTT", inflight={1: 6}, unfinished_runs=3, train_backlog_tokens=BIG_BACKLOG,
                 demand_over_capacity_s=31.0)
    assert flips(p(over)) == {4: R}


def test_elastic_reclaims_at_once_when_the_unfinished_runs_exceed_the_engines():
    # A new batch of 12 runs starting on the one engine left from the last batch's tail
    # (target 16, tail of 3 runs at <= 8 requests an engine): the runs are not a blip, each
    # calls the model again, so one replica comes back without waiting for reclaim_after_s.
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=16, reclaim_after_s=30.0))
    s = state("TRTT", inflight={1: 12}, unfinished_runs=12, tail_runs=3, train_backlog_tokens=0)
    got = p(s)
    assert flips(got) == {3: R}
    assert got[0].reason == ("12 unfinished runs (each calls the model again) exceed 1 engines x 16 "
                             "with the tail of 3 runs at <= 8 each: 1 more engines")
    # 8 runs with a tail of 2 hold on one engine (8 <= 16, the tail fits its light engine).
    assert p(state("TRTT", inflight={1: 8}, unfinished_runs=8, tail_runs=2, train_backlog_tokens=0)) == []


def test_elastic_never_undoes_a_release_within_a_batch():
    # Along a batch the unfinished runs only fall: whatever the requests do, a cell released
    # at some point of the batch is never reclaimed later in it (sustained request demand
    # aside, which a release at fill < 1 leaves no room for in these states).
    import random
    rng = random.Random(1)
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=0.8, reclaim_after_s=10.0))
    for _ in range(200):
        roles = list("TRRRR")
        released: set[int] = set()
        for runs in range(rng.randint(8, 16), -1, -1):
            on = [i for i, ch in enumerate(roles) if ch == "R"]
            inflight = {i: 0 for i in on}
            for _ in range(rng.randint(0, runs)):
                inflight[rng.choice(on)] += 1
            s = state("".join(roles), inflight=inflight, unfinished_runs=runs, tail_runs=(runs + 3) // 4,
                      train_backlog_tokens=BIG_BACKLOG)
            for ch in p(s):
                assert not (ch.to is R and ch.cell in released), (runs, roles, ch.reason)
                roles[ch.cell] = "R" if ch.to is R else "T"
                if ch.to is T:
                    released.add(ch.cell)


def test_elastic_plans_with_the_work_the_unfinished_runs_will_add():
    # 1000 tokens waiting alone do not pay an 8.5 s switch; with 50000 more expected from the
    # runs still rolling out (measured per finished run) the released cell has work to do.
    s = state("TRRR", inflight={1: 1, 2: 1, 3: 0}, train_backlog_tokens=1000)
    assert ELASTIC(s) == []
    got = ELASTIC(dataclasses.replace(s, expected_train_tokens=50_000))
    assert flips(got) == {2: T, 3: T}       # 2 requests fit the one engine that stays
    assert "51000 tok (backlog 1000 + 50000 from 2 runs) trains in" in got[0].reason


def test_elastic_reclaim_reason_is_true():
    # The old policy printed "demand 5 > 1 engines x 16" for demand that fitted: every figure
    # in a reason must hold. With demand within capacity there is no reclaim at all.
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=16, reclaim_after_s=0.0))
    s = state("TRTT", inflight={1: 4}, queued_requests=1, unfinished_runs=5, demand_over_capacity_s=100.0,
              train_backlog_tokens=0)
    assert p(s) == []


def test_elastic_releases_while_runs_are_in_flight_not_only_when_all_are_done():
    # 20 runs still decoding over 5 engines of target 8 (fill 0.8 -> 6.4 each): they fit 4.
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=8, fill=0.8))
    s = state("TRRRRR", inflight={1: 4, 2: 4, 3: 4, 4: 4, 5: 4}, train_backlog_tokens=BIG_BACKLOG)
    got = flips(p(s))
    assert list(got.values()) == [T] and len(got) == 1
    assert s.unfinished_runs == 20


def test_elastic_never_releases_an_engine_holding_tail_requests():
    # Cell 2 holds the fewest requests but also the run expected to finish last: cell 3 goes.
    base = cells("TRRR", inflight={1: 3, 2: 1, 3: 2})
    tailed = tuple(CellState(**{**c.__dict__, "tail_requests": 1}) if c.cell == 2 else c for c in base)
    s = ClusterState(time=0.0, step=0, cells=tailed, unfinished_runs=6, inflight_requests=6, tail_runs=1,
                     train_backlog_tokens=BIG_BACKLOG)
    assert flips(ELASTIC(s)) == {3: T}


def test_elastic_keeps_a_lightly_loaded_engine_for_the_tail():
    # 7 requests fit 2 engines of 4, but then the tail run shares an engine with 3 others;
    # with tail_engine_requests=1 the tail needs an engine of its own, so 3 engines stay.
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=1.0, tail_engine_requests=1))
    s = state("TRRRR", inflight={1: 3, 2: 2, 3: 2, 4: 0}, tail_runs=1, train_backlog_tokens=BIG_BACKLOG)
    assert len(p(s)) == 1
    assert len(p(dataclasses.replace(s, tail_runs=0))) == 2


def test_elastic_checks_each_cells_own_kv_capacity():
    # Requests fit 1 engine, but 3000 KV tokens in flight need 2 engines of 2000 each.
    base = cells("TRRR", inflight={1: 1, 2: 1, 3: 0})
    kv = tuple(CellState(**{**c.__dict__, "kv_capacity_tokens": 2000}) for c in base)
    s = ClusterState(time=0.0, step=0, cells=kv, unfinished_runs=2, inflight_requests=2, tokens_inflight=3000,
                     train_backlog_tokens=BIG_BACKLOG)
    assert len(ELASTIC(s)) == 1


def test_elastic_default_train_rate_is_a_sane_prior():
    assert ElasticParams().default_train_tokens_per_s >= 100.0


def test_elastic_never_flips_core_rollout_only_or_switching_cells():
    s = state("TRRRR", unfinished_runs=0, train_backlog_tokens=BIG_BACKLOG, switching={2}, rollout_only={3})
    got = flips(ELASTIC(s))
    assert got == {1: T, 4: T}
    assert 0 not in flips(ELASTIC(state("TTT", queued_requests=50, unfinished_runs=50)))


def test_elastic_release_and_reclaim_do_not_flap():
    # After a release, the state the policy sees next must not trigger a reclaim, even with
    # a call queued for the instant before dispatch (demand not sustained).
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=0.8))
    s = state("TRRRR", inflight={1: 3, 2: 3, 3: 0, 4: 0}, train_backlog_tokens=BIG_BACKLOG)
    released = flips(p(s))
    assert released
    roles = "".join("T" if i == 0 or i in released else "R" for i in range(5))
    after = state(roles, inflight={1: 3, 2: 3}, train_backlog_tokens=BIG_BACKLOG)
    assert p(after) == []
    blip = state(roles, inflight={1: 4, 2: 4}, queued_requests=1, unfinished_runs=6, train_backlog_tokens=BIG_BACKLOG)
    assert p(blip) == []


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


def test_no_run_can_start_before_the_update_once_all_started_and_the_bound_holds_the_next():
    from gyre_hpc.sched.staleness import next_batch_waits
    # Staleness 1, version 3 (step 3 training): batch 4 may launch, batch 5 waits for version 4.
    assert not next_batch_waits(True, next_batch=4, policy_version=3, max_staleness=1, batches=10)
    assert next_batch_waits(True, next_batch=5, policy_version=3, max_staleness=1, batches=10)
    # A run launched but not started yet starts whenever a place frees.
    assert not next_batch_waits(False, next_batch=5, policy_version=3, max_staleness=1, batches=10)
    # No batch left: nothing more can start.
    assert next_batch_waits(True, next_batch=10, policy_version=9, max_staleness=1, batches=10)


def test_next_batch_launches_while_stragglers_run_only_within_staleness():
    from gyre_hpc.sched.staleness import may_launch_batch
    # async, staleness 1: batch 4 may launch while batch 3's stragglers run (version 3 is
    # being trained), once all of batch 3's runs have started
    assert may_launch_batch(4, policy_version=3, max_staleness=1, previous_all_started=True)
    assert not may_launch_batch(4, policy_version=3, max_staleness=1, previous_all_started=False)
    assert not may_launch_batch(5, policy_version=3, max_staleness=1, previous_all_started=True)
    # on-policy: batch 4 needs version 4
    assert not may_launch_batch(4, policy_version=3, max_staleness=0, previous_all_started=True)


# ---- registry ------------------------------------------------------------------------

def test_registry_builds_policies_and_lists_valid_names():
    assert isinstance(get_policy("elastic", fill=0.5), ElasticPolicy)
    assert get_policy("async", train_cells=3).train_cells == 3
    with pytest.raises(ValueError, match="valid policies: async, colocate, elastic, scripted"):
        get_policy("greedy")
    with pytest.raises(ValueError, match="valid parameters: max_staleness, train_cells"):
        get_policy("async", train_cells=2, split=3)
    with pytest.raises(ValueError, match="'async' needs train_cells"):
        get_policy("async")


def test_config_validates_policy_names_against_the_registry():
    from gyre_hpc.config import ConfigError, build_config
    from gyre_hpc.sched.registry import POLICY_NAMES
    for name in POLICY_NAMES:
        assert build_config({"scheduler": {"policy": name}}).scheduler.policy == name
    with pytest.raises(ConfigError, match="scheduler.policy"):
        build_config({"scheduler": {"policy": "greedy"}})


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


def test_every_elastic_reason_states_figures_that_hold():
    import random
    import re
    rng = random.Random(0)
    p = ElasticPolicy(ElasticParams(target_requests_per_engine=4, fill=0.8, reclaim_after_s=10.0))
    checked = 0
    for _ in range(400):
        roles = "T" + "".join(rng.choice("RT") for _ in range(5))
        inflight = {i: rng.randint(0, 6) for i, ch in enumerate(roles) if ch == "R"}
        s = state(roles, inflight=inflight, queued_requests=rng.choice([0, 0, 3]),
                  unfinished_runs=sum(inflight.values()) + rng.randint(0, 8),
                  train_backlog_tokens=rng.choice([0, BIG_BACKLOG]), demand_over_capacity_s=rng.choice([0.0, 20.0]),
                  tail_runs=rng.randint(0, 3), expected_train_tokens=rng.choice([0, 12_345_678]))
        for ch in p(s):
            m = re.search(r"demand (\d+) > (\d+) engines x (\d+)", ch.reason)
            if m:
                assert int(m[1]) > int(m[2]) * int(m[3]), ch.reason
                assert s.demand_over_capacity_s >= 10.0
                checked += 1
            m = re.search(r"(\d+) unfinished runs \(each calls the model again\) exceed (\d+) engines x (\d+)",
                          ch.reason)
            if m:
                assert not p.holds_tail(int(m[2]), int(m[1]), s.tail_runs, 1.0), ch.reason
                assert int(m[1]) == s.unfinished_runs
                checked += 1
            assert len(ch.reason) <= 160, ch.reason       # the timeline's detail column keeps it whole
            m = re.search(r"demand (\d+) fits (\d+) engines \(<= ([\d.]+) x (\d+)", ch.reason)
            if m:
                assert int(m[1]) <= float(m[3]) * int(m[4]) * int(m[2]), ch.reason
                checked += 1
    assert checked > 20


def test_device_sized_elastic_takes_the_engines_latency_target_kv_and_training_rate():
    from gyre_hpc.devices import EngineModel, TrainModel
    from gyre_hpc.sched.elastic import device_sized

    e = EngineModel(single_seq_tokens_per_s=20.0, half_saturation_seqs=8.0, max_seqs=32, gpus=1, gpu_memory_gb=1.0,
                    weights_gb=0.1, kv_bytes_per_token=50_000.0)
    p = device_sized(e, TrainModel(tokens_per_s=80.0))
    # (1 + 8) / 0.9 - 8 = 2: two sequences decode within 10% of one alone.
    assert (p.target_requests_per_engine, p.kv_tokens_per_engine, p.default_train_tokens_per_s) == (2, 16000, 80.0)
    assert device_sized(e, TrainModel(), {"fill": 0.5, "target_requests_per_engine": 7}).target_requests_per_engine == 7
    with pytest.raises(TypeError):
        device_sized(e, TrainModel(), {"slots": 3})
    assert device_sized(e, TrainModel(), {"max_requests_per_engine": 32}).max_requests_per_engine == 32
    with pytest.raises(ValueError, match=r"max_requests_per_engine=33 is more than the engine admits at once "
                                         r"\(max_seqs=32\)"):
        device_sized(e, TrainModel(), {"max_requests_per_engine": 33})
