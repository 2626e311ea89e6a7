"""The router over in-process TorchEngines: least-outstanding-tokens routing and drains."""
from __future__ import annotations

import pytest

from gyre_hpc.engines import Request
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.engines.router import InProcessEngines, Router

from engine_conformance import greedy, sampled
from engine_helpers import prompt


@pytest.fixture
def fleet(model_dir):
    engines = {i: TorchEngine.from_pretrained(model_dir, name=f"e{i}") for i in range(3)}
    return engines, Router(InProcessEngines(engines), engines)


def test_routes_to_least_outstanding_tokens_not_round_robin(fleet):
    engines, router = fleet
    big = Request("big", prompt(0, length=40), greedy(120))
    assert router.submit(big) == 0                                   # all empty: lowest id
    assert router.submit(Request("s10", prompt(0), greedy(10))) == 1
    assert router.submit(Request("s20", prompt(0), greedy(40))) == 2
    assert router.outstanding_tokens(0) == big.prompt_len + 120
    # Round robin would now pick engine 0; the least loaded is engine 1 (twice).
    assert router.submit(Request("s5", prompt(0), greedy(5))) == 1
    assert router.submit(Request("s6", prompt(0), greedy(5))) == 1
    assert router.outstanding_tokens(1) == 3 * len(prompt(0)) + 20
    assert sorted(engines[1].request_ids()) == ["s10", "s5", "s6"]
    router.poll()   # prefill everything, one token each
    assert router.outstanding_tokens(1) == 20 - 3
    outputs = router.run_until_done()
    assert sorted(o.request_id for o in outputs) == ["big", "s10", "s20", "s5", "s6"]
    assert router.unfinished() == 0 and all(router.outstanding_tokens(e) == 0 for e in range(3))


def test_drain_moves_every_inflight_sequence_which_continues_exactly(fleet, model_dir):
    engines, router = fleet
    reference = TorchEngine.from_pretrained(model_dir, name="ref")
    requests = [Request(f"r{i}", prompt(i), greedy(24) if i % 2 else sampled(24, seed=i)) for i in range(6)]
    expected = {r.request_id: reference.generate(r) for r in requests}
    for r in requests:
        router.submit(r)
    for _ in range(4):
        router.poll()
    on_zero = set(router.inflight(0))
    assert len(on_zero) == 2
    prefill_before = {e: engines[e].counters().prefill_tokens for e in (1, 2)}
    result = router.drain(0)
    assert set(result.moved) == on_zero and set(result.moved.values()) <= {1, 2} and not result.gone
    assert all(0 < n < 24 for n in result.tokens_at_move.values())
    assert result.bytes > 0
    assert engines[0].request_ids() == [] and router.engines == (1, 2)
    outputs = {o.request_id: o for o in router.run_until_done()}
    for rid, out in expected.items():
        assert outputs[rid].token_ids == out.token_ids, rid
        assert outputs[rid].migrations == (1 if rid in on_zero else 0)
    assert {e: engines[e].counters().prefill_tokens for e in (1, 2)} == prefill_before
    assert sum(engines[e].counters().migrations_in for e in (1, 2)) == 2
    # The drained engine gets no new work until it is added back.
    assert router.submit(Request("after", prompt(1), greedy(4))) in (1, 2)
    router.add_engine(0)
    assert router.submit(Request("back", prompt(1), greedy(4))) == 0


def test_drain_spreads_moved_work_largest_first(fleet):
    _, router = fleet
    for i, n in enumerate([300, 200, 100]):
        router.submit(Request(f"x{i}", prompt(0), greedy(n)))   # one per engine
    router.submit(Request("y", prompt(0), greedy(50)))          # engine 2 (least loaded)
    assert router.inflight(2) == ["x2", "y"]
    plan = router.plan_drain(2, router.inflight(2))
    # x2 (100 + prompt) goes to engine 1 (200 + prompt < 300 + prompt); that makes engine 1
    # the heavier one, so y goes to engine 0.
    assert plan == {"x2": 1, "y": 0}
    assert router.plan_drain(0, ["x0"]) == {"x0": 2}   # engine 2: 150 + 2 prompts < engine 1: 200 + 1


def test_drain_with_no_other_engine_refuses_and_names_the_count(model_dir):
    engine = TorchEngine.from_pretrained(model_dir)
    router = Router(InProcessEngines({0: engine}), [0])
    router.submit(Request("only", prompt(0), greedy(8)))
    with pytest.raises(RuntimeError, match="1 sequences in flight and no other"):
        router.drain(0)


def test_router_refuses_duplicate_ids_and_routing_with_no_engine(fleet):
    _, router = fleet
    router.submit(Request("a", prompt(0), greedy(4)))
    with pytest.raises(ValueError, match="already in flight"):
        router.submit(Request("a", prompt(0), greedy(4)))
    empty = Router(InProcessEngines({}), [])
    with pytest.raises(RuntimeError, match="no ROLLOUT engine"):
        empty.submit(Request("b", prompt(0), greedy(4)))


def test_planned_request_that_already_finished_is_reported_gone_not_lost(fleet):
    engines, router = fleet
    transport = router.transport
    engines[0].submit(Request("done", prompt(0), greedy(2)))
    engines[0].submit(Request("live", prompt(1), greedy(30)))
    events = engines[0].step() + engines[0].step()
    assert [e.request_id for e in events if e.finished] == ["done"]
    result = transport.migrate(0, {"done": 1, "live": 2})
    assert result.gone == ("done",) and dict(result.moved) == {"live": 2} and result.tokens_at_move == {"live": 2}
    assert engines[0].pop_output("done").token_ids == tuple(e.token_id for e in events if e.request_id == "done")
    assert engines[2].request_ids() == ["live"]
