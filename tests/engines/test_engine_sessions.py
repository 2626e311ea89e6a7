"""Retained sessions: an agent context's KV stays on its engine between calls, prefills only
the new tokens, and moves with the engine's other work when the engine is released."""
from __future__ import annotations

import pytest
import torch

from gyre_hpc.engines import Request
from gyre_hpc.engines.router import InProcessEngines, Router
from gyre_hpc.engines.torch_engine import TorchEngine, common_prefix

from engine_conformance import run_all, sampled, step_until
from engine_helpers import prompt

TOOL = tuple(b"\nresult: ok\n")


def _engine(model_dir, name="a", **kw) -> TorchEngine:
    return TorchEngine.from_pretrained(model_dir, name=name, **kw)


def _second_prompt(first, out) -> tuple[int, ...]:
    """The agent loop's next prompt: previous prompt + output + a tool result."""
    return tuple(first) + tuple(out.token_ids) + TOOL


def test_session_second_call_prefills_only_new_tokens_and_matches_a_fresh_engine(model_dir):
    eng = _engine(model_dir)
    first = prompt(3)
    out1 = eng.generate(Request("c0", first, sampled(12, seed=5), session="r/main"))
    assert eng.retained_sessions() == ["r/main"]
    held = len(first) + len(out1.token_ids) - 1
    assert eng.retained_tokens == held
    before = eng.counters()
    second = _second_prompt(first, out1)
    out2 = eng.generate(Request("c1", second, sampled(12, seed=6), session="r/main"))
    after = eng.counters()
    assert after.cached_prompt_tokens - before.cached_prompt_tokens == held
    assert after.prefill_tokens - before.prefill_tokens == len(second) - held
    fresh = _engine(model_dir, "fresh", max_retained_tokens=0)
    ref = fresh.generate(Request("c1", second, sampled(12, seed=6)))
    assert fresh.counters().prefill_tokens == len(second) and fresh.retained_sessions() == []
    assert out2.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(out2.logprobs, ref.logprobs)) < 1e-5


def test_session_reuse_through_the_prefill_budget_staging(model_dir):
    """A prompt longer than the per-step budget fills across steps from the retained context."""
    eng = _engine(model_dir, max_prefill_tokens=7)
    first = prompt(4)
    out1 = eng.generate(Request("c0", first, sampled(10, seed=1), session="s"))
    second = _second_prompt(first, out1)
    out2 = eng.generate(Request("c1", second, sampled(10, seed=2), session="s"))
    ref = _engine(model_dir, "fresh").generate(Request("c1", second, sampled(10, seed=2)))
    assert eng.counters().cached_prompt_tokens == len(first) + len(out1.token_ids) - 1
    assert out2.token_ids == ref.token_ids


def test_a_prompt_sharing_a_prefix_reuses_it_and_matches_a_fresh_engine_bit_for_bit(model_dir):
    """A retry rewinds to its anchor and a compression restarts from the intro: the prompt
    shares only a prefix with the retained context. That prefix's KV is reused, the rest
    prefilled, and the tokens and logprobs are a fresh engine's exactly (invariant kernels)."""
    eng = _engine(model_dir)
    first = prompt(3, 30)
    eng.generate(Request("c0", first, sampled(8, seed=1), session="s"))
    rewound = first[:20] + tuple(b"\nretry 1: 2 tests fail\n")
    before = eng.counters()
    out = eng.generate(Request("c1", rewound, sampled(8, seed=2), session="s"))
    c = eng.counters()
    assert c.cached_prompt_tokens - before.cached_prompt_tokens == 20
    assert c.prefill_tokens - before.prefill_tokens == len(rewound) - 20
    ref = _engine(model_dir, "fresh", max_retained_tokens=0).generate(Request("c1", rewound, sampled(8, seed=2)))
    assert out.token_ids == ref.token_ids and list(out.logprobs) == list(ref.logprobs)


def test_a_prompt_sharing_nothing_prefills_in_full(model_dir):
    eng = _engine(model_dir)
    eng.generate(Request("c0", prompt(3), sampled(8, seed=1), session="s"))
    other = tuple(b"summary: fixed p0\n")     # not even the first token in common
    before = eng.counters().prefill_tokens
    eng.generate(Request("c1", other, sampled(8, seed=2), session="s"))
    c = eng.counters()
    assert c.cached_prompt_tokens == 0 and c.prefill_tokens - before == len(other)


def test_common_prefix_is_the_first_difference_capped_by_the_limit():
    held = (1, 2, 3, 4, 5)
    assert common_prefix(held, [1, 2, 3, 4, 5, 6, 7], 6) == 5        # an extension
    assert common_prefix(held, [1, 2, 9, 4, 5, 6], 5) == 2           # a rewind
    assert common_prefix(held, [7, 2, 3], 2) == 0
    assert common_prefix(held, [1, 2, 3, 4, 5], 4) == 4              # the last token is left to compute
    assert common_prefix((), [1, 2], 1) == 0 and common_prefix(held, [1], 0) == 0


def test_other_sessions_and_sessionless_requests_do_not_touch_an_entry(model_dir):
    eng = _engine(model_dir)
    eng.generate(Request("m0", prompt(1), sampled(6, seed=1), session="r/main"))
    eng.generate(Request("s0", prompt(2), sampled(6, seed=1), session="r/sub1"))
    eng.generate(Request("x", prompt(3), sampled(6, seed=1)))
    assert eng.retained_sessions() == ["r/main", "r/sub1"]


def test_retained_contexts_are_bounded_least_recently_used_first(model_dir):
    eng = _engine(model_dir, max_retained_tokens=60)
    for i, s in enumerate(("a", "b", "c")):
        eng.generate(Request(f"q{i}", prompt(i, 12), sampled(8, seed=i), session=s))
    assert eng.retained_tokens <= 60
    assert eng.retained_sessions()[-1] == "c" and "a" not in eng.retained_sessions()
    too_long = _engine(model_dir, "small", max_retained_tokens=5)
    too_long.generate(Request("q", prompt(1), sampled(4, seed=0), session="s"))
    assert too_long.retained_sessions() == [] and too_long.retained_tokens == 0


def test_weight_version_change_and_sleep_drop_every_context(model_dir):
    eng = _engine(model_dir)
    eng.generate(Request("q0", prompt(1), sampled(4, seed=0), session="s"))
    eng.adopt_weights(eng.policy_version)          # same version: the tensors are the same weights
    assert eng.retained_sessions() == ["s"]
    eng.adopt_weights(eng.policy_version + 1)
    assert eng.retained_sessions() == []
    eng.generate(Request("q1", prompt(1), sampled(4, seed=0), session="s"))
    eng.load_weights(eng.model.state_dict(), eng.policy_version + 1)
    assert eng.retained_sessions() == []
    eng.generate(Request("q2", prompt(1), sampled(4, seed=0), session="s"))
    eng.sleep(1)
    assert eng.retained_sessions() == [] and eng.retained_tokens == 0


def test_export_import_session_moves_the_context_exactly(model_dir):
    a, b = _engine(model_dir, "a"), _engine(model_dir, "b")
    first = prompt(2)
    out1 = a.generate(Request("c0", first, sampled(10, seed=3), session="s"))
    state = a.export_session("s")
    assert state.retained and state.cached_len == len(first) + len(out1.token_ids) - 1
    assert a.retained_sessions() == []
    b.import_session(state)
    second = _second_prompt(first, out1)
    out2 = b.generate(Request("c1", second, sampled(10, seed=4), session="s"))
    assert b.counters().cached_prompt_tokens == state.cached_len
    assert b.counters().prefill_tokens == len(second) - state.cached_len
    ref = _engine(model_dir, "fresh").generate(Request("c1", second, sampled(10, seed=4)))
    assert out2.token_ids == ref.token_ids
    with pytest.raises(KeyError, match="no retained context"):
        a.export_session("s")
    stale = _engine(model_dir, "c", version=7)
    stale.import_session(state)                    # computed by version 0: not kept
    assert stale.retained_sessions() == []


def _router(model_dir, n=2, **kw):
    engines = {i: _engine(model_dir, f"e{i}", **kw) for i in range(n)}
    return Router(InProcessEngines(engines), engines), engines


def test_router_sends_a_session_back_to_the_engine_holding_its_context(model_dir):
    router, engines = _router(model_dir)
    first = prompt(2)
    home = router.submit(Request("c0", first, sampled(8, seed=1), session="s"))
    out1 = router.run_until_done()[0]
    assert router.session_home("s") == home
    # Both engines idle: ties go to the lower id, so "busy" lands on the home engine (0) and
    # least-loaded routing alone would now pick the other one.
    assert home == 0 and router.submit(Request("busy", prompt(6), sampled(40, seed=2))) == home
    assert router.choose() == 1
    assert router.submit(Request("c1", _second_prompt(first, out1), sampled(8, seed=3), session="s")) == home
    router.run_until_done()
    assert engines[home].counters().cached_prompt_tokens > 0


def test_drain_moves_retained_sessions_and_the_session_continues_without_recompute(model_dir):
    router, engines = _router(model_dir)
    first = prompt(3)
    src = router.submit(Request("c0", first, sampled(8, seed=1), session="r0/main"))
    out1 = router.run_until_done()[0]
    dest = 1 - src
    router.submit(Request("live", prompt(5), sampled(30, seed=2), session="r1/main"))
    router.poll()
    live_on_src = "live" in engines[src].request_ids()
    result = router.drain(src)
    assert result.moved_sessions == {"r0/main": dest}
    assert result.session_kv_tokens == len(first) + len(out1.token_ids) - 1 and result.session_bytes > 0
    assert engines[src].retained_sessions() == [] and "r0/main" in engines[dest].retained_sessions()
    assert router.session_home("r0/main") == dest
    assert set(result.moved) == ({"live"} if live_on_src else set())
    prefill_before = engines[dest].counters().prefill_tokens
    second = _second_prompt(first, out1)
    router.submit(Request("c1", second, sampled(8, seed=3), session="r0/main"))
    outs = {o.request_id: o for o in router.run_until_done()}
    assert engines[dest].counters().cached_prompt_tokens == result.session_kv_tokens
    # Only the new tokens of c1 (and whatever "live" still had to decode) went through the model.
    assert engines[dest].counters().prefill_tokens - prefill_before == len(second) - result.session_kv_tokens
    ref = _engine(model_dir, "fresh").generate(Request("c1", second, sampled(8, seed=3)))
    assert outs["c1"].token_ids == ref.token_ids


def test_forget_drops_a_finished_runs_contexts_so_they_do_not_migrate(model_dir):
    router, engines = _router(model_dir)
    home = router.submit(Request("c0", prompt(1), sampled(6, seed=1), session="r0/main"))
    router.run_until_done()
    router.submit(Request("c1", prompt(2), sampled(6, seed=1), session="r0/sub1"))
    router.run_until_done()
    assert router.forget(["r0/main", "r0/sub1"]) == 2
    assert all(e.retained_sessions() == [] for e in engines.values())
    assert router.drain(home).moved_sessions == {}


@pytest.mark.mpi
def test_drain_over_mpi_moves_a_retained_session_that_then_continues_without_recompute(model_dir, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_engine_migration_mpi import mpi_env

    here = Path(__file__).parent
    first = list(prompt(3))
    (Path(model_dir) / "session_prompt.json").write_text(json.dumps(first))
    out_path = tmp_path / "result.json"
    proc = subprocess.run(["mpiexec", "-n", "3", "--oversubscribe", sys.executable, str(here / "mpi_session_program.py"),
                           str(model_dir), str(out_path)], env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out_path.read_text())
    held = len(first) + len(r["first_output"]) - 1
    assert r["home"] == 1 and r["held_before"] == ["r0/main"]
    assert r["moved"] == {} and r["moved_sessions"] == {"r0/main": 2}
    assert r["session_kv_tokens"] == held and r["session_bytes"] > 0 and r["source_after"] == []
    assert r["routed"] == 2
    cached = r["after"]["cached_prompt_tokens"] - r["before"]["cached_prompt_tokens"]
    assert cached == held
    assert r["after"]["prefill_tokens"] - r["before"]["prefill_tokens"] == len(r["second"]) - held
    ref = _engine(model_dir, "fresh").generate(Request("c1", tuple(r["second"]), sampled_params(2)))
    assert r["second_output"] == list(ref.token_ids)
    assert max(abs(a - b) for a, b in zip(r["second_logprobs"], ref.logprobs)) < 1e-5
    assert r["forgotten"] == 1 and r["dest_after_forget"] == []


def sampled_params(seed: int):
    from mpi_session_program import params

    return params(seed)


def test_a_queued_call_and_its_sessions_context_move_to_the_same_engine(model_dir):
    """Drained before its prefill, a session's call lands where its context lands, and
    prefills only its new tokens there."""
    engines = {i: _engine(model_dir, f"e{i}") for i in range(3)}
    router = Router(InProcessEngines(engines), [2])
    router.submit(Request("x0", prompt(1), sampled(6, seed=0), session="x"))   # engine 2 holds a context
    router.run_until_done()
    router.add_engine(0)
    first = prompt(2)
    assert router.submit(Request("c0", first, sampled(8, seed=1), session="s")) == 0
    out1 = router.run_until_done()[0]
    router.add_engine(1)
    second = _second_prompt(first, out1)
    assert router.submit(Request("c1", second, sampled(8, seed=3), session="s")) == 0   # queued, not stepped
    assert router.submit(Request("other", prompt(4), sampled(30, seed=2))) == 1
    # The call goes to 2 (least loaded); alone, the context would go to 1 (holding the fewest).
    before = engines[2].counters()
    result = router.drain(0)
    assert result.moved == {"c1": 2} and result.moved_sessions == {"s": 2}
    router.run_until_done()
    after = engines[2].counters()
    held = len(first) + len(out1.token_ids) - 1
    assert after.cached_prompt_tokens - before.cached_prompt_tokens == held
    assert after.prefill_tokens - before.prefill_tokens == len(second) - held


def test_migration_items_put_in_flight_requests_before_session_contexts():
    from gyre_hpc.engines.router import migration_items

    assert migration_items({"r1": 2, "r2": 3}, {"s1": 3}) == [("r1", 2, False), ("r2", 3, False), ("s1", 3, True)]
    assert migration_items({"r1": 2}, None) == [("r1", 2, False)]


@pytest.mark.mpi
def test_a_burst_of_long_prompts_over_mpi_finishes_while_the_engine_sends_outputs_back(model_dir, tmp_path):
    """Submits past MPI's eager limit meet outputs past it coming back: neither side may block
    in its send (the engine's are non-blocking), or an xlong step stalls at 4K contexts."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_engine_migration_mpi import mpi_env

    out_path = tmp_path / "result.json"
    proc = subprocess.run(["mpiexec", "-n", "2", "--oversubscribe", sys.executable,
                           str(Path(__file__).parent / "mpi_long_prompts_program.py"), str(model_dir), str(out_path),
                           "24", "3000"], env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out_path.read_text())
    assert r["finished"] == sorted(f"c{i}" for i in range(24)) and r["prompts_intact"]
