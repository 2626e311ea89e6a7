"""The RL parts that run without MPI: streaming gradient exactness, dealing, trainer state,
the router-backed harness client under a drain, run sampling, progress reading."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from pathlib import Path

import numpy as np
import pytest
import torch

from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.engines.router import InProcessEngines, Router
from gyre_hpc.config import ConfigError, build_config
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.tasks import Task, TaskTest, load_suite
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.rl.batches import MicroBatchRef, ReplicaSpeeds, group_micro_batches, largest_first, pick_replica
from gyre_hpc.rl.runs import sample_runs
from gyre_hpc.rl.fleet import check_rl_config
from gyre_hpc.jobs.progress import read_progress, render
from gyre_hpc.rl.router_client import RoutedCalls
from gyre_hpc.rl.trainer import OPTIMIZER_FILE, RLTrainer
from gyre_hpc.rundir.metrics import MetricsWriter, RunRow, StepRow, TimelineRow
from gyre_hpc.trees.builder import build_tree
from tests.rl.rl_helpers import REPO
from gyre_hpc.trees.loss import StepWeights, packed_loss, run_targets, step_denominator
from gyre_hpc.trees.packing import collate, pack
from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_runs

SMALL = SyntheticConfig(n_calls=10, system_tokens=6, output_tokens=(1, 10), tool_tokens=(2, 10), context_limit=90,
                        summary_tokens=(3, 6), n_subagents=(1, 2), subagent_calls=(1, 2), subagent_system_tokens=4)


def _trees(n_tasks=2, g=3, seed=0):
    runs = synthetic_runs(n_tasks, g, SMALL, seed=seed)
    return [build_tree(r.journal, run_id=r.run_id, task_id=r.task_id, reward=r.reward) for r in runs]


def _cfg(tmp_path=None, **train):
    return build_config({"workload": "rl", "train": {"lr": 0.01, "row_tokens": 128, "micro_batch_tokens": 200,
                                                     **train}})


@pytest.mark.parametrize("rule,averaging,forest", [("per_sample", "run", True), ("once", "global", True),
                                                   ("per_sample", "global", False)])
def test_streamed_groups_give_the_full_step_gradient(rule, averaging, forest):
    """Group by group (each group one forest, or tree by tree) with per-run weights, summed,
    divided by the step's runs (global: its targets): the loss module's full-batch gradient
    over every tree of the step, to float64 rounding."""
    trees = _trees(n_tasks=2, g=3)
    cfg = _cfg()
    trainer = RLTrainer(cfg, build_model("tiny", seed=3).double())
    mbs = []
    for task in ("task0", "task1"):
        group = [t for t in trees if t.task_id == task]
        mbs += group_micro_batches(group, step=1, first_id=len(mbs), row_tokens=128, micro_batch_tokens=200,
                                   shared_targets=rule, averaging=averaging, forest=forest)
    assert len(mbs) > 2  # really split
    for mb in mbs[::2]:          # two "replicas" each accumulate their share
        trainer.train_micro_batch(mb)
    a = [g.clone() for g in trainer.grad_tensors()]
    trainer.zero_grads()
    for mb in mbs[1::2]:
        trainer.train_micro_batch(mb)
    divisor = step_denominator([run_targets(t, rule) for t in trees], averaging)
    streamed = [(x + y) / divisor for x, y in zip(a, trainer.grad_tensors())]

    ref = build_model("tiny", seed=3).double()
    rows = pack(trees, 128, rule)
    loss = packed_loss(ref, collate(rows), StepWeights.from_trees(trees, rule, averaging), cfg.train.clip_eps, "sdpa")
    loss.backward()
    for got, want in zip(streamed, (p.grad for p in ref.parameters())):
        assert torch.linalg.vector_norm(got - want) <= 1e-10 * torch.linalg.vector_norm(want)


def test_micro_batches_cover_each_trained_token_once_within_budget():
    trees = _trees(n_tasks=1, g=4, seed=1)
    mbs = group_micro_batches(trees, step=2, first_id=10, row_tokens=128, micro_batch_tokens=150)
    assert [mb.mb_id for mb in mbs] == list(range(10, 10 + len(mbs)))
    assert sum(mb.loss_tokens for mb in mbs) == sum(int(t.trained.sum()) for t in trees)
    assert len(mbs) > 1 and all(mb.tokens <= 150 or len(mb.rows) == 1 for mb in mbs)
    assert all(mb.step == 2 and mb.advantages.shape == (4,) for mb in mbs)


def test_dealing_follows_measured_speed():
    speeds = ReplicaSpeeds()
    speeds.record(1, 2000, 1.0)
    speeds.record(2, 1000, 1.0)
    free_at = {1: 0.0, 2: 0.0}
    dealt = {1: 0, 2: 0}
    for _ in range(30):
        r = pick_replica([1, 2], free_at, speeds, 100)
        free_at[r] += 100 / speeds.rate(r)
        dealt[r] += 100
    assert dealt == {1: 2000, 2: 1000}
    assert speeds.rate(7) == 2000   # never measured: as fast as the fastest
    # What a replica holds counts: replica 1 is busy for 0.2 s more, so 2 finishes 100 tokens first.
    assert pick_replica([1, 2], {1: 0.2, 2: 0.0}, speeds, 100) == 2
    assert pick_replica([1, 2], {1: 0.01, 2: 0.0}, speeds, 100) == 1
    with pytest.raises(RuntimeError, match="no TRAIN replica"):
        pick_replica([], {}, speeds, 1)


def _finish_spread(units, speeds) -> float:
    """List scheduling of ``units`` (tokens) in order on replicas 1-3 by predicted finish:
    the spread of the replicas' finish times."""
    free_at = {1: 0.0, 2: 0.0, 3: 0.0}
    for tokens in units:
        r = pick_replica(free_at, free_at, speeds, tokens)
        free_at[r] += tokens / speeds.rate(r)
    return max(free_at.values()) - min(free_at.values())


def test_the_last_work_is_dealt_largest_first_so_replicas_end_on_the_smallest_pieces():
    refs = [MicroBatchRef(1, i, (i,), i, tokens, tokens) for i, tokens in enumerate([100, 300, 100, 200, 300])]
    assert [r.mb_id for r in largest_first(refs)] == [1, 4, 3, 0, 2]   # ties keep queue order
    speeds = ReplicaSpeeds()
    for rank, rate in ((1, 100.0), (2, 100.0), (3, 70.0)):   # replica 3 at speed 0.7
        speeds.record(rank, int(rate), 1.0)
    # A step's last work as it arrives: whole micro-batches of earlier groups, then the last
    # groups cut about a run each (run lengths vary). Dealt in arrival order the replicas end
    # up to a whole big piece apart; largest first, within the smallest piece's time.
    units = [350] * 6 + [220, 90, 400, 60, 150, 310, 80, 120]
    smallest = min(units) / speeds.rate(3)
    assert _finish_spread(units, speeds) > smallest
    assert _finish_spread([r.tokens for r in largest_first(
        [MicroBatchRef(1, i, (i,), 0, t, t) for i, t in enumerate(units)])], speeds) <= smallest


def test_the_finest_cut_of_a_group_is_its_deepest_path_and_trains_every_token_once():
    from gyre_hpc.rl.batches import finest_rows
    from gyre_hpc.trees.builder import group_forest, node_depth

    trees = _trees(n_tasks=1, g=4, seed=3)
    rows = finest_rows(trees)
    forest = group_forest(trees)
    assert rows == int((node_depth(forest) + forest.node_len).max())
    coarse = group_micro_batches(trees, 1, 0, 4 * rows, 4 * rows)
    fine = group_micro_batches(trees, 1, 0, rows, rows)
    assert len(fine) > len(coarse) and max(mb.tokens for mb in fine) <= rows
    assert sum(mb.loss_tokens for mb in fine) == sum(mb.loss_tokens for mb in coarse)
    assert finest_rows(trees, forest=False) == max(int((node_depth(t) + t.node_len).max()) for t in trees)


def test_trainer_state_moves_weights_and_optimizer_moments(tmp_path):
    cfg = _cfg()
    a, b = RLTrainer(cfg), RLTrainer(cfg.model_copy(update={"seed": 5}))
    mb = group_micro_batches(_trees(1, 3), 1, 0, 128, 10_000)[0]
    a.train_micro_batch(mb)
    a.apply_update(1.0 / 3)
    names = a.state_dict().keys()
    assert any(n.startswith("optim.") and n.endswith("exp_avg_sq") for n in names)
    assert set(names) == set(b.state_dict())
    assert (a.applied_updates(), b.applied_updates()) == (1, 0)
    # What a flip does: receive the core's dict in place. Then both apply identical updates.
    with torch.no_grad():
        for name, t in b.state_dict().items():
            t.copy_(a.state_dict()[name])
    assert b.applied_updates() == 1      # the count travels with the state (a join in place checks it)
    for tr in (a, b):
        tr.train_micro_batch(mb)
        tr.apply_update(1.0 / 3)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name


def test_checkpoint_is_hf_format_plus_optimizer_and_round_trips(tmp_path):
    cfg = _cfg()
    a = RLTrainer(cfg)
    mb = group_micro_batches(_trees(1, 3), 1, 0, 128, 10_000)[0]
    a.train_micro_batch(mb)
    a.apply_update(0.5)
    a.save(tmp_path / "ck", extra={"step": 1})
    written = {p.name for p in (tmp_path / "ck").iterdir()}
    assert written == {
        "config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", OPTIMIZER_FILE}
    # The files the step driver requires before it seals a checkpoint are ones the save writes.
    from gyre_hpc.rl.driver import CHECKPOINT_FILES
    assert set(CHECKPOINT_FILES) == {"model.safetensors", "config.json", OPTIMIZER_FILE} and set(CHECKPOINT_FILES) <= written
    b = RLTrainer(cfg.model_copy(update={"seed": 9}))
    b.load(tmp_path / "ck")
    assert b.applied_updates() == 1
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    (tmp_path / "ck" / OPTIMIZER_FILE).unlink()
    from gyre_hpc.models.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="optimizer.safetensors is missing"):
        b.load(tmp_path / "ck")


def test_a_checkpoint_whose_optimizer_state_does_not_fit_names_the_tensor(tmp_path):
    """The trainer loads through the fleet's one state check (cells.rank_state.load_into)."""
    from safetensors.torch import load_file, save_file

    from gyre_hpc.models.checkpoint import CheckpointError

    cfg = _cfg()
    a = RLTrainer(cfg)
    a.save(tmp_path / "ck")
    optim = load_file(str(tmp_path / "ck" / OPTIMIZER_FILE))
    name = sorted(optim)[0]
    optim[name] = torch.zeros(3, 1)
    save_file(optim, str(tmp_path / "ck" / OPTIMIZER_FILE))
    with pytest.raises(CheckpointError, match=f"{name} is torch.float32\\[3, 1\\]"):
        RLTrainer(cfg).load(tmp_path / "ck")


def test_rl_config_refuses_several_ranks_per_cell():
    with pytest.raises(ConfigError, match="cells.ranks_per_cell=2"):
        check_rl_config(build_config({"workload": "rl", "cells": {"ranks_per_cell": 2}}))


def test_sample_runs_is_a_pure_function_of_config_and_step():
    cfg = build_config({"seed": 3, "rollout": {"tasks": "builtin", "tasks_per_step": 2, "runs_per_task": 3}})
    tasks = load_suite("builtin")
    a, b = sample_runs(tasks, cfg, 4), sample_runs(tasks, cfg, 4)
    assert [(s.run_id, s.seed, s.task.task_id) for s in a] == [(s.run_id, s.seed, s.task.task_id) for s in b]
    assert len(a) == 6 and len({s.run_id for s in a}) == 6 and len({s.seed for s in a}) == 6
    assert {s.run_id for s in a}.isdisjoint(s.run_id for s in sample_runs(tasks, cfg, 5))


async def _harness_runs(driver, task, cfg, clients, tmp_path, between=None):
    """Run one AgentRun per client over the driver, pumping it (and ``between``) until all end."""
    runs = [asyncio.create_task(AgentRun(task, tmp_path / f"w{i}", c, tmp_path / f"j{i}.jsonl", cfg,
                                         run_id=c.run_id).run()) for i, c in enumerate(clients)]
    while not all(r.done() for r in runs):
        driver.dispatch()
        driver.pump()
        if between is not None:
            between()
        await asyncio.sleep(0)
    return [r.result() for r in runs]


def test_harness_runs_over_the_router_continue_across_a_drain(tmp_path):
    """Concurrent harness runs call two engines through the router; one engine is drained
    mid-decode: its sequences move with their KV cache and every run finishes, none restarted."""
    model = build_model("tiny", seed=0)
    engines = {0: TorchEngine(model, name="e0", seed=1), 1: TorchEngine(build_model("tiny", seed=0), name="e1", seed=2)}
    transport = InProcessEngines(engines)
    router = Router(transport, [0, 1])
    driver = RoutedCalls(router)
    task = Task("t", "say ok", (TaskTest("ok", "assert True"),), max_turns=1)
    cfg = HarnessConfig(max_new_tokens=40, context_limit=512, run_timeout_s=60)
    clients = [driver.client(f"r{i}", 100 + i) for i in range(4)]

    drained = []

    def drain_once():
        if not drained and len(router.inflight(1)) >= 1 and driver.started & set(router.inflight(1)):
            drained.append(router.drain(1))

    results = asyncio.run(_harness_runs(driver, task, cfg, clients, tmp_path, drain_once))
    drained = drained[0] if drained else None
    assert drained is not None and len(drained.moved) >= 1
    assert sum(c.migrations for c in clients) == len(drained.moved)
    assert all(c.restarts == 0 and c.calls == 1 for c in clients)
    assert all(r.status == "finished" for r in results)
    prefilled = sum(e.counters().prefill_tokens for e in engines.values())
    assert prefilled == driver.prompt_tokens   # no migrated sequence was recomputed


def test_an_agents_calls_reuse_its_context_on_its_engine_and_forget_run_drops_it(tmp_path):
    """Each call of a run's main agent goes back to the engine that holds its context and
    prefills only what the previous prompt + output did not cover; every prompt token is
    filled once (computed or served from the context), and forget_run drops that run's."""
    engines = {e: TorchEngine(build_model("tiny", seed=0), name=f"e{e}", seed=e) for e in (0, 1)}
    router = Router(InProcessEngines(engines), [0, 1])
    driver = RoutedCalls(router)
    task = Task("t", "say ok", (TaskTest("ok", "assert True"),), max_turns=3)
    cfg = HarnessConfig(max_new_tokens=16, context_limit=512, run_timeout_s=60)
    clients = [driver.client(f"r{i}", 100 + i) for i in range(2)]

    results = asyncio.run(_harness_runs(driver, task, cfg, clients, tmp_path))
    assert all(len(r.calls) == 3 for r in results)
    expected = sum(len(prev.prompt) + len(prev.output) - 1 for r in results for prev in r.calls[:-1])
    cached = sum(e.counters().cached_prompt_tokens for e in engines.values())
    prefilled = sum(e.counters().prefill_tokens for e in engines.values())
    assert cached == expected > 0
    assert prefilled + cached == driver.prompt_tokens
    assert set(router.sessions) == {"r0/main", "r1/main"}
    home = router.session_home("r0/main")
    assert driver.forget_run("r0") == 1 and set(router.sessions) == {"r1/main"}
    assert "r0/main" not in engines[home].retained_sessions()
    assert router.session_home("r1/main") is not None


def test_a_call_whose_run_is_gone_is_not_sent_or_leaves_no_context_behind():
    """A run's wall clock cancels its call: before routing, the call is never sent; after,
    the engine finishes it with nobody waiting, and the context it kept is dropped then
    (the run already forgot its sessions), not held until LRU eviction."""
    engines = {0: TorchEngine(build_model("tiny", seed=0), name="e0", seed=0)}
    router = Router(InProcessEngines(engines), [0])
    driver = RoutedCalls(router)
    client = driver.client("r0", 1)

    async def cancelled_calls():
        call = asyncio.create_task(client.complete([5, 6, 7, 8], 8, []))
        await asyncio.sleep(0)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert driver.queue == [] and driver.prompt_tokens == 0
        call = asyncio.create_task(client.complete([5, 6, 7, 8], 8, []))
        await asyncio.sleep(0)
        assert driver.dispatch() == 1
        driver.pump()
        assert router.unfinished() == 1          # mid-decode when its run's clock runs out
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        driver.forget_run("r0")                 # the run ended
        while router.unfinished():
            driver.pump()
        driver.pump()

    asyncio.run(cancelled_calls())
    assert driver.prompt_tokens == 4
    assert not set(router.sessions) and not engines[0].retained_sessions()


def test_restarts_count_requests_routed_again_not_a_context_asked_twice():
    """A run asking twice for the same context is answered twice (same seed, same sample)
    and is no restart; a request of the run routed a second time is one."""
    router = Router(InProcessEngines({0: TorchEngine(build_model("tiny", seed=0), name="e0", seed=0)}), [0])
    driver = RoutedCalls(router)
    client = driver.client("run-a", 7)

    async def ask_twice():
        outs = []
        for _ in range(2):
            call = asyncio.create_task(client.complete([257, 65, 66], 4, (258,)))
            while not call.done():
                driver.dispatch()
                driver.pump()
                await asyncio.sleep(0)
            outs.append(call.result())
        return outs

    first, second = asyncio.run(ask_twice())
    assert first == second and client.calls == 2 and client.restarts == 0

    async def routed_again():
        call = asyncio.create_task(driver.generate([257, 67], 3, (258,), seed=1, tag="run-a"))
        await asyncio.sleep(0)
        request = driver.queue[0]
        driver.dispatch()
        lost = []
        while not lost:                        # the output never reaches the run: lost
            router.poll()
            lost = router.pop_finished()
        driver.queue.append(request)           # begun again from scratch
        driver.dispatch()
        while not call.done():
            driver.pump()
            await asyncio.sleep(0)

    asyncio.run(routed_again())
    assert client.restarts == 1 and driver.restarts == {"run-a": 1}


def test_requests_wait_for_dispatch_then_spread_over_engines():
    """Calls wait in the queue until dispatch, which spreads a burst over the engines open then."""
    engines = {e: TorchEngine(build_model("tiny", seed=0), name=f"e{e}", seed=e) for e in (0, 1)}
    router = Router(InProcessEngines(engines), [0])
    driver = RoutedCalls(router)

    async def main():
        calls = [asyncio.create_task(driver.generate([257, 65 + i], 4, (258,), seed=i)) for i in range(4)]
        await asyncio.sleep(0)
        assert len(driver.queue) == 4 and router.unfinished() == 0   # nothing routed yet
        router.add_engine(1)          # what a reclaim does before the routing
        assert driver.dispatch() == 4
        assert {e: len(router.inflight(e)) for e in (0, 1)} == {0: 2, 1: 2}
        while not all(c.done() for c in calls):
            driver.pump()
            await asyncio.sleep(0)
        return [c.result() for c in calls]

    outs = asyncio.run(main())
    assert all(1 <= len(o.token_ids) <= 4 for o in outs)


def test_progress_reads_steps_roles_and_runs(tmp_path):
    cfg = build_config({"workload": "rl", "run_dir": str(tmp_path), "train": {"steps": 3}})
    with MetricsWriter(tmp_path / "metrics.h5") as m:
        m.add(StepRow(step=1, time=0.0, wall_s=1.0, reward_mean=0.25, loss=0.1))
        m.add(StepRow(step=2, time=1.0, wall_s=1.0, reward_mean=0.5, loss=0.05))
        m.add(TimelineRow(time=0.5, cell=2, role="TRAIN", event="flip_end"))
        m.add(TimelineRow(time=0.6, cell=2, role="TRAIN", event="migrate", requests=5, sessions=2))
        m.add(RunRow(time=1.0, step=2, run_id="s2", task_id="t", status="finished", reward=0.5, migrations=3))
    p = read_progress(tmp_path / "metrics.h5", cfg)
    assert (p.step, p.reward, p.flips, p.migrations, p.contexts_moved, p.restarts) == (2, [0.25, 0.5], 1, 3, 2, 0)
    assert p.roles == {0: "TRAIN", 1: "ROLLOUT", 2: "TRAIN"}
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(render(p, 3.0))
    text = console.export_text()
    assert "KV moved: requests mid-decode + retained contexts" in text and "3 + 2 = 5" in text
    assert "KV migrations" not in text


def test_checkpointed_step_rows_are_restored_only_when_missing(tmp_path):
    import dataclasses
    import json

    from gyre_hpc.cells.step_rows import STEP_ROWS_FILE, restore_step_rows

    rows = [RunRow(time=1.0, step=3, run_id="s3", task_id="t", status="finished", reward=0.5),
            StepRow(step=3, time=1.0, wall_s=2.0, loss=0.25, reward_mean=0.5, logprob_gap_max=0.0,
                        logprob_gap_mean=0.0, pre_update_clip_share=0.0, behaviour_kl=0.0)]   # NaN != NaN
    (tmp_path / STEP_ROWS_FILE).write_text(json.dumps([[type(r).__name__, dataclasses.asdict(r)] for r in rows]))
    metrics = tmp_path / "metrics.h5"
    with MetricsWriter(metrics) as m:
        m.add(StepRow(step=2, time=0.0, wall_s=1.0))
    assert restore_step_rows(tmp_path, metrics) == rows          # killed after the commit, before the rows
    with MetricsWriter(metrics) as m:
        m.append(rows)
    assert restore_step_rows(tmp_path, metrics) == []            # already there: never twice
    assert restore_step_rows(tmp_path / "nothing", metrics) == []


def test_a_kill_between_the_run_rows_and_the_step_row_restores_only_the_step_row(tmp_path):
    """MetricsWriter.append writes table after table: killed in between, the runs table has
    the step's rows and the steps table not; the relaunch must add the step row alone."""
    import dataclasses
    import json

    from gyre_hpc.cells.step_rows import STEP_ROWS_FILE, restore_step_rows

    runs = [RunRow(time=1.0, step=3, run_id=f"s3-g{g}", task_id="t", status="finished", reward=0.5) for g in range(2)]
    step = StepRow(step=3, time=1.0, wall_s=2.0, loss=0.25, reward_mean=0.5, logprob_gap_max=0.0,
                   logprob_gap_mean=0.0, pre_update_clip_share=0.0, behaviour_kl=0.0)   # NaN != NaN
    (tmp_path / STEP_ROWS_FILE).write_text(json.dumps([[type(r).__name__, dataclasses.asdict(r)]
                                                       for r in [*runs, step]]))
    metrics = tmp_path / "metrics.h5"
    with MetricsWriter(metrics) as m:
        m.append(runs[:1])                  # one run row landed, the other and the step row did not
    assert restore_step_rows(tmp_path, metrics) == [runs[1], step]


def test_notebook_hint_names_the_notebooks_and_the_run(tmp_path):
    from gyre_hpc.jobs.progress import notebook_hint

    assert notebook_hint(tmp_path / "runs" / "r", root=tmp_path / "none") is None
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "steps.ipynb").write_text("{}")
    hint = notebook_hint(tmp_path / "runs" / "r", root=tmp_path / "analysis")
    assert "steps.ipynb" in hint and f"GYRE_RUNS={tmp_path / 'runs'}" in hint and f"GYRE_TREES_RUN={tmp_path / 'runs' / 'r'}" in hint
    execute = Path(sys.executable).with_name("jupyter-execute")
    assert hint.endswith(f"{execute} steps.ipynb") and execute.exists()   # the base install carries it


def test_tool_latency_is_seeded_lognormal_and_only_between_calls(tmp_path):
    import time

    from gyre_hpc.rl.latency import LatencyAgentRun, latency_s
    from gyre_hpc.rl.tasks import load_tasks

    draws = [latency_s(7, k, 1.0, 0.6) for k in range(400)]
    assert draws == [latency_s(7, k, 1.0, 0.6) for k in range(400)]        # same seed, same waits
    assert 0.85 < float(np.median(draws)) < 1.15 and np.std(np.log(draws)) == pytest.approx(0.6, abs=0.08)
    assert latency_s(8, 0, 1.0, 0.6) != draws[0]

    task = next(t for t in load_tasks("easy-3turn"))
    assert task.max_turns == 3
    engines = {0: TorchEngine(build_model("tiny", seed=0), name="e0", seed=1)}
    driver = RoutedCalls(Router(InProcessEngines(engines), [0]))
    cfg = HarnessConfig(max_new_tokens=8, context_limit=512, run_timeout_s=60, max_retries=0)
    run = LatencyAgentRun(task, tmp_path / "w", driver.client("r", 5), tmp_path / "j.jsonl", cfg, run_id="r",
                          run_seed=5, median_s=0.05, sigma=0.6)

    async def main():
        t = asyncio.create_task(run.run())
        while not t.done():
            driver.dispatch()
            driver.pump()
            await asyncio.sleep(0)
        return t.result()

    t0 = time.monotonic()
    result = asyncio.run(main())
    assert len(result.calls) == 3
    # two waits (after calls 1 and 2), none after the last call
    assert run.added_s == pytest.approx(latency_s(5, 1, 0.05, 0.6) + latency_s(5, 2, 0.05, 0.6))
    assert time.monotonic() - t0 >= run.added_s


def test_demand_clock_counts_only_sustained_demand_over_capacity():
    from gyre_hpc.rl.policy_inputs import DemandClock

    clock = DemandClock(per_engine=4)
    assert clock.update(10.0, queued=0, inflight=8, engines=2) == 0.0       # fits exactly
    assert clock.update(11.0, queued=1, inflight=8, engines=2) == 0.0       # starts now
    assert clock.update(13.5, queued=0, inflight=9, engines=2) == 2.5       # still over
    assert clock.update(14.0, queued=0, inflight=5, engines=2) == 0.0       # fits: reset
    assert clock.update(15.0, queued=0, inflight=9, engines=2) == 0.0
    assert clock.update(15.0, queued=1, inflight=0, engines=0) == 0.0 and clock.update(16.0, 1, 0, 0) == 1.0


def test_requests_name_their_run():
    from gyre_hpc.rl.policy_inputs import run_of_request

    assert run_of_request("s00001-t0-g3-17") == "s00001-t0-g3"


WRITER = """
import sys
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.store import TreeStore
from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_runs
cfg = SyntheticConfig()
with TreeStore.open(sys.argv[1], "a") as store:
    for seed in (1, 2):   # two commits: one advantage group each
        store.append([build_tree(r.journal, run_id=f"s{seed}-{r.run_id}", task_id=r.task_id, reward=r.reward)
                      for r in synthetic_runs(n_tasks=1, runs_per_task=3, cfg=cfg, seed=seed)])
"""


@pytest.mark.slow   # a writer process (imports torch, zarr) and two groups packed twice
def test_replicas_train_trees_another_process_committed_byte_equal_to_the_store(tmp_path):
    """The trainer's input comes from trees.zarr by index: what another writer committed."""
    from gyre_hpc.rl.batches import StoreMicroBatches, group_refs
    from gyre_hpc.trees.store import TreeStore

    path = tmp_path / "trees.zarr"
    subprocess.run([sys.executable, "-c", WRITER, str(path)], check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    reader = StoreMicroBatches(path, row_tokens=8192, micro_batch_tokens=16384)
    with TreeStore.open(path, "r") as store:
        for group in (range(0, 3), range(3, 6)):
            trees = [store.read(i) for i in group]
            expected = group_micro_batches(trees, 1, 10, 8192, 16384)
            got = [reader.get(ref) for ref in group_refs(list(group), expected)]
            assert [m.mb_id for m in got] == [m.mb_id for m in expected]
            for g, e in zip(got, expected):
                assert len(g.rows) == len(e.rows)
                for gr, er in zip(g.rows, e.rows):
                    for name in ("input_ids", "position_ids", "subtree_end", "pred_index", "loss_mask",
                                 "behaviour_logprobs", "run_index"):
                        assert getattr(gr, name).tobytes() == getattr(er, name).tobytes(), name
                np.testing.assert_array_equal(g.advantages, e.advantages)
            # ...and they are the store's bytes: every trained token and its behaviour logprob.
            want = np.concatenate([t.logprobs[t.trained] for t in trees])
            seen = np.concatenate([r.behaviour_logprobs[r.loss_mask] for m in got for r in m.rows])
            assert sorted(want.tobytes()[i:i + 4] for i in range(0, want.nbytes, 4)) == \
                sorted(seen.astype(want.dtype).tobytes()[i:i + 4] for i in range(0, seen.nbytes, 4))
    with pytest.raises(RuntimeError, match="past the commit marker"):
        reader.get(group_refs([6, 7], expected)[0])
    reader.close()


def test_replica_packs_store_trees_with_the_controllers_target_and_averaging_settings(tmp_path):
    """``StoreMicroBatches.of(train)`` cuts a group as the controller did under non-default
    ``shared_targets``/``averaging``/``group_forest``; with the defaults the packing differs."""
    from gyre_hpc.rl.batches import StoreMicroBatches, group_refs
    from gyre_hpc.trees.store import TreeStore

    trees = [t for t in _trees(n_tasks=1, g=3)]
    path = tmp_path / "trees.zarr"
    with TreeStore.open(path, "a") as store:
        indices = list(store.append(trees))
    with TreeStore.open(path, "r") as store:
        stored = [store.read(i) for i in indices]
    train = _cfg(shared_targets="once", averaging="global", group_forest=False).train
    expected = group_micro_batches(stored, 1, 0, 128, 200, "once", "global", False)
    default = group_micro_batches(stored, 1, 0, 128, 200)
    assert sum(m.tokens for m in expected) != sum(m.tokens for m in default)   # the settings matter here
    reader = StoreMicroBatches.of(path, train)
    got = [reader.get(ref) for ref in group_refs(indices, expected)]
    reader.close()
    assert [m.mb_id for m in got] == [m.mb_id for m in expected]
    for g, e in zip(got, expected):
        assert g.averaging == "global" and len(g.rows) == len(e.rows)
        np.testing.assert_array_equal(g.run_tokens, e.run_tokens)
        for gr, er in zip(g.rows, e.rows):
            assert gr.input_ids.tobytes() == er.input_ids.tobytes()
            assert gr.loss_mask.tobytes() == er.loss_mask.tobytes()


def test_rank_handler_reloads_an_engine_with_its_own_weights_and_only_versions_a_shared_one(tmp_path):
    """After an update, an engine decoding with the trainer's tensors only learns the version;
    one holding its own copy (as VLLMEngine does) gets the trainer's new tensors loaded."""
    from mpi4py import MPI

    from gyre_hpc.engines.torch_engine import TorchEngine
    from gyre_hpc.rl.batches import StoreMicroBatches
    from gyre_hpc.rl.rank import RLRankHandler

    trainer = RLTrainer(_cfg(), build_model("tiny", seed=3))
    reader = StoreMicroBatches.of(tmp_path / "trees.zarr", trainer.cfg.train)
    shared = TorchEngine(trainer.model, name="shared")
    own = TorchEngine(build_model("tiny", seed=4), name="own")
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)
    for engine in (shared, own):
        RLRankHandler(trainer, engine, MPI.COMM_SELF, reader).adopt(7)
        assert engine.policy_version == 7
    assert own.model is not trainer.model
    for key, t in trainer.model_state().items():
        torch.testing.assert_close(own.model.state_dict()[key], t, rtol=0, atol=0)


def test_model_numerics_selects_the_engines_and_the_trainers_kernels(tmp_path):
    """invariant (default): the cell's TorchEngine and the trainer's tree attention are the
    invariant ones; native: neither is."""
    from gyre_hpc.rl.fleet import rollout_engine
    from tests.rl.rl_helpers import rl_config

    for numerics, invariant in (("invariant", True), ("native", False)):
        cfg = rl_config(tmp_path, f"model.numerics={numerics}")
        trainer = RLTrainer(cfg)
        engine = rollout_engine(cfg, trainer, tmp_path, cell_id=1, version=0, max_batch=4)
        assert engine.invariant is invariant
        assert (trainer.attention == "invariant") is invariant
    assert rl_config(tmp_path).model.numerics == "invariant"


def test_a_micro_batch_reports_its_logprob_gap():
    """The trainer's gap figures: 0 against its own logprobs, the true difference against
    behaviour logprobs shifted by 0.5 (clip share and k3 KL computed from it)."""
    from dataclasses import replace

    from gyre_hpc.rl.trainer import MicroBatch
    from gyre_hpc.trees.attention import tree_attention
    from gyre_hpc.trees.loss import LogprobGap, sample_logprobs
    from gyre_hpc.trees.synthetic import synthetic_journal

    trainer = RLTrainer(build_config({"workload": "rl"}, []))
    trees = [build_tree(synthetic_journal(SyntheticConfig(n_calls=6), seed=i), run_id=f"r{i}", task_id="t",
                        reward=float(i)) for i in range(2)]
    rows = pack(trees, 4096)
    batch = collate(rows)
    fn = tree_attention("invariant", batch.subtree_end, needs_grad=False, position_ids=batch.position_ids)
    with torch.no_grad():
        own = sample_logprobs(trainer.model(batch.input_ids, batch.position_ids, attention_fn=fn, invariant=True),
                              batch).numpy()
    exact, at = [], 0
    for r in rows:
        exact.append(replace(r, sample_logprobs=own[at:at + r.n_samples].astype(np.float32)))
        at += r.n_samples
    mb = MicroBatch(1, 0, tuple(exact), np.zeros(2), np.array([run_targets(t, "per_sample") for t in trees]))
    gap = trainer.train_micro_batch(mb).gap
    assert gap.targets == at > 0 and gap.max_abs == 0.0 and gap.kl == 0.0 and gap.clip_share == 0.0
    shifted = tuple(replace(r, sample_logprobs=r.sample_logprobs - np.float32(0.5)) for r in exact)
    gap = trainer.train_micro_batch(replace(mb, rows=shifted)).gap
    assert gap.max_abs == pytest.approx(0.5, abs=1e-5) and gap.mean_abs == pytest.approx(0.5, abs=1e-5)
    assert gap.clip_share == 1.0 and gap.kl == pytest.approx(np.exp(0.5) - 1 - 0.5, rel=1e-4)
    merged = LogprobGap(2, 0.1, 0.1, 0, 0.0).merge(LogprobGap(2, 0.3, 0.4, 1, 0.2))
    assert (merged.targets, merged.max_abs, merged.mean_abs, merged.clip_share) == (4, 0.3, 0.125, 0.25)
    assert merged.kl == pytest.approx(0.05)
    empty = LogprobGap()   # no targets: every figure NaN, and merging it changes nothing
    assert all(np.isnan(x) for x in (empty.max_abs, empty.mean_abs, empty.clip_share, empty.kl))
    assert empty.merge(merged) == merged and merged.merge(empty) == merged
    empty.add(torch.zeros(0), torch.zeros(0), 0.2)
    assert np.isnan(empty.max_abs)


def test_progress_lines_print_each_step_as_it_lands(tmp_path):
    """Without a terminal: one flushed line per new step row (step, reward, wall, tokens, flips,
    KV moved, gap, ETA), printed while the run goes on, not at its end; earlier steps of a
    resumed run are not printed again."""
    import io
    import threading

    from gyre_hpc.jobs.progress import progress_lines, step_lines

    cfg = build_config({"workload": "rl", "run_dir": str(tmp_path), "train": {"steps": 3}})
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path) as m:
        m.add(StepRow(step=1, time=1.0, wall_s=10.0, tokens=900, reward_mean=0.25, logprob_gap_max=0.0))
    out = io.StringIO()
    landed = threading.Event()

    class Stream(io.StringIO):
        def write(self, s):
            if "step 2/3" in s:
                landed.set()
            return out.write(s)

    with progress_lines(cfg, poll_s=0.05, stream=Stream()):
        with MetricsWriter(path) as m:
            m.add(TimelineRow(time=2.0, cell=1, role="TRAIN", event="flip_end", step=2))
            m.add(TimelineRow(time=2.5, cell=1, role="TRAIN", event="migrate", step=2, requests=5, sessions=3))
            m.add(StepRow(step=2, time=3.0, wall_s=20.0, tokens=1200, reward_mean=0.5, logprob_gap_max=0.0))
        assert landed.wait(10), "the step's line did not appear while the run was going"
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "step 1/3" not in out.getvalue()
    assert ("step 2/3 reward 0.500 wall 20.0s trained 1200 tok flips 1 KV moved 2 requests + 3 contexts "
            "logprob gap 0 ETA 15s") in lines[0]
    assert step_lines(path, cfg, 2, 0.0) == [] and len(step_lines(path, cfg, 0, 0.0)) == 2


def test_prompt_totals_count_cached_and_recomputed_prompt_tokens_across_engines():
    """Two paused engines: 100 tokens asked, 30 of them served from retained contexts, 75
    prefilled (5 of them a second time, as a migrated sequence recomputed would be)."""
    from types import SimpleNamespace

    from gyre_hpc.engines.requests import EngineCounters
    from gyre_hpc.rl.engine_pool import EnginePool

    pool = SimpleNamespace(counters={1: EngineCounters(prefill_tokens=40, cached_prompt_tokens=10),
                                     2: EngineCounters(prefill_tokens=35, cached_prompt_tokens=20)})
    assert EnginePool.prompt_totals(pool, 100) == {"recomputed_prefill_tokens": 5, "cached_prompt_tokens": 30}
    assert EnginePool.prompt_totals(pool, 105) == {"recomputed_prefill_tokens": 0, "cached_prompt_tokens": 30}


def test_a_step_has_all_started_once_every_run_took_its_place_or_is_done():
    from gyre_hpc.rl.runs import RunSpec
    from gyre_hpc.rl.step_state import RunOutcome, StepState

    specs = [RunSpec(step=2, group=0, index=g, task=None, seed=g) for g in range(3)]
    st = StepState(step=2, specs=specs)
    assert not st.all_started
    st.run_started = {specs[0].run_id: 1.0, specs[1].run_id: 2.0}
    assert not st.all_started
    st.outcomes[specs[2].run_id] = RunOutcome(spec=specs[2], tree=None)   # done: it started long ago
    assert st.all_started


def test_a_step_rolled_out_ahead_stores_its_groups_only_once_the_current_steps_trees_are_stored(tmp_path):
    """``TrainQueue.store_ahead``: the ahead step's finished groups reach ``trees.zarr`` while
    the current step trains (one group a call), never before every tree of the current step is
    there, so the store stays in step order; activating the step then only cuts them."""
    import dataclasses
    from types import SimpleNamespace

    from gyre_hpc.rl.runs import RunSpec
    from gyre_hpc.rl.step_state import RunOutcome, StepState
    from gyre_hpc.rl.train_queue import TrainQueue
    from gyre_hpc.trees.store import TreeStore

    trees = _trees(n_tasks=2, g=2)
    cfg = build_config({"workload": "rl", "cells": {"count": 2}})

    def step(n: int) -> tuple[StepState, list[list[RunOutcome]]]:
        specs = [RunSpec(step=n, group=g, index=i, task=None, seed=i) for g in range(2) for i in range(2)]
        outs = [RunOutcome(spec=s, tree=dataclasses.replace(t, run_id=s.run_id)) for s, t in zip(specs, trees)]
        return StepState(step=n, specs=specs), [outs[:2], outs[2:]]

    with TreeStore.open(tmp_path / "trees.zarr", "a") as store:
        queue = TrainQueue(SimpleNamespace(cfg=cfg, cells=[None, None]), store)
        current, (c0, c1) = step(1)
        ahead, held = step(2)
        ahead.active, ahead.held = False, held
        for o in c0:
            current.outcomes[o.spec.run_id] = o
        queue.commit_group(current, c0)
        queue.store_ahead(current, ahead)
        assert len(store) == 2 and not any(o.stored for g in held for o in g)   # step 1 still rolls out
        for o in c1:
            current.outcomes[o.spec.run_id] = o
        queue.commit_group(current, c1)
        queue.store_ahead(current, ahead)
        assert len(store) == 6 and [o.store_index for o in held[0]] == [4, 5] and not held[1][0].stored
        queue.store_ahead(current, ahead)
        queue.store_ahead(current, ahead)                                        # nothing left: no append
        assert len(store) == 8 and [o.store_index for o in held[1]] == [6, 7]
        assert store.run_ids()[4:] == [o.spec.run_id for g in held for o in g]
        for g in held:
            queue.commit_group(ahead, g)                                         # activation: cut, not stored again
        assert len(store) == 8 and ahead.store_end == 8 and ahead.pending


def test_new_contexts_wait_for_a_returning_engine_while_calls_with_a_home_go_there():
    """While an engine is coming back (``dispatch(hold_new=True)``), a call that would open a
    context waits, since routed now it would stay on the engine open now with every later call
    of its run; a call whose context an engine holds goes there at once. Once the engine is
    back, the held calls spread over both."""
    engines = {e: TorchEngine(build_model("tiny", seed=0), name=f"e{e}", seed=e) for e in (0, 1)}
    router = Router(InProcessEngines(engines), [0])
    driver = RoutedCalls(router)

    async def main():
        first = asyncio.create_task(driver.generate([257, 65], 2, (258,), seed=0, tag="old", session="old/main"))
        await asyncio.sleep(0)
        driver.dispatch()
        while not first.done():
            driver.pump()
            await asyncio.sleep(0)
        assert router.session_home("old/main") == 0
        again = asyncio.create_task(driver.generate([257, 65, 66], 2, (258,), seed=1, tag="old", session="old/main"))
        new = [asyncio.create_task(driver.generate([257, 70 + i], 2, (258,), seed=i, tag=f"n{i}", session=f"n{i}/main"))
               for i in range(4)]
        await asyncio.sleep(0)
        assert driver.dispatch(hold_new=True) == 1          # the call with a home only
        assert len(driver.queue) == 4 and len(router.inflight(0)) == 1
        router.add_engine(1)                                 # the returning engine is open
        assert driver.dispatch() == 4
        assert len(router.inflight(1)) >= 2                  # the new runs spread, not all on engine 0
        while not all(c.done() for c in [again, *new]):
            driver.pump()
            await asyncio.sleep(0)

    asyncio.run(main())


def test_engines_are_arriving_only_while_a_flip_to_rollout_is_young():
    """The driver holds new contexts (``dispatch(hold_new=...)``) while a flip brings an engine
    back, for at most the hold: a release (to TRAIN) brings none."""
    from types import SimpleNamespace
    from gyre_hpc.rl.flips import Flips
    from gyre_hpc.sched.state import Role, RoleChange
    flips = Flips(SimpleNamespace(cells=[]), None, None, None)
    assert not flips.engines_arriving(10.0, 1.0)
    flips.pending = (SimpleNamespace(changes=[RoleChange(3, Role.ROLLOUT)]), {}, 10.0)
    assert flips.engines_arriving(10.5, 1.0) and not flips.engines_arriving(11.0, 1.0)
    flips.pending = (SimpleNamespace(changes=[RoleChange(3, Role.TRAIN)]), {}, 10.0)
    assert not flips.engines_arriving(10.5, 1.0)


def test_a_resumed_runs_counts_reach_its_runs_row_and_a_run_never_interrupted_has_zeros(tmp_path):
    """``rl.step_rows``: what a relaunch's resume cost each run (issue 53) is in its ``runs``
    row, and reads back from metrics.h5 as written."""
    import dataclasses

    from gyre_hpc.rl.runs import RunSpec
    from gyre_hpc.rl.step_rows import step_rows
    from types import SimpleNamespace

    from gyre_hpc.rl.step_state import RLStepRecord, RunOutcome, StepState
    from gyre_hpc.rundir.metrics import read_table

    trees = _trees(n_tasks=1, g=2)
    specs = [RunSpec(step=1, group=0, index=i, task=SimpleNamespace(task_id=t.task_id), seed=i)
             for i, t in enumerate(trees)]
    st = StepState(step=1, specs=specs)
    st.outcomes[specs[0].run_id] = RunOutcome(specs[0], dataclasses.replace(trees[0], run_id=specs[0].run_id),
                                              resumed_calls=9, tools_redone=3)
    st.outcomes[specs[1].run_id] = RunOutcome(specs[1], dataclasses.replace(trees[1], run_id=specs[1].run_id))
    rec = RLStepRecord(step=1, wall_s=1.0, loss=0.5, train_cells=(0,), tokens=10, policy_version=1,
                       reward_mean=0.5, runs=2, migrations=0, restarts=0, flips=0)
    rows = step_rows(st, rec, replicas=1, now=1.0)[:2]
    assert [(r.resumed_calls, r.tools_redone, r.restarted_from_first) for r in rows] == [(9, 3, 0), (0, 0, 0)]
    with MetricsWriter(tmp_path / "metrics.h5") as m:
        m.append(rows)
    runs = read_table(tmp_path / "metrics.h5", "runs")
    assert runs["resumed_calls"].tolist() == [9, 0] and runs["tools_redone"].tolist() == [3, 0]
