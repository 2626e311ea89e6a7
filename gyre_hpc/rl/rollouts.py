"""The harness side of a step: its agent runs as tasks on the controller's event loop, and
their trees handed on an advantage group at a time.

A run's trees go to training only as a whole group (their advantages are relative to each
other), and only in step order: a step rolled out ahead (async) holds its finished groups
until it is the current step (``TrainQueue.store_ahead`` stores them once the current step's
trees all are, so ``trees.zarr`` stays ordered by step). A run whose tree a
killed launch already committed is read back from the store instead of being rolled out again.

With ``rollout.agent`` naming an outside scaffold (``mini-swe-agent``, or ``{command: [...]}``)
a run is a ``harness.scaffold.ScaffoldRun`` instead of the project's own loop: the controller
serves the OpenAI-compatible endpoint on this loop (``harness.endpoint_server``), each run is
a session whose calls go through the same ``CountingRunClient`` (router, KV affinity,
migrations, restarts counted) and are journaled as the engine saw them, so the tree, the store
and training are the same code. Each run's endpoint figures (calls, extends, branches, drift,
overhead per call) are written beside its journal (``<run>.endpoint.json``).
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable

from gyre_hpc.cells.controller import Controller
from gyre_hpc import fsio
from gyre_hpc.harness.beneath import remove_tree
from gyre_hpc.harness.loop import AgentRun, HarnessConfig, RunResult
from gyre_hpc.harness.scaffold import ScaffoldRun, mini_swe_command
from gyre_hpc.harness.snapshot import SnapshotStore
from gyre_hpc.rl.latency import LatencyAgentRun
from gyre_hpc.rl.router_client import CountingRunClient, RoutedCalls
from gyre_hpc.rl.runs import RunSpec, sample_runs
from gyre_hpc.rl.step_state import RunOutcome, StepState
from gyre_hpc.rl.tasks import load_tasks
from gyre_hpc.rl.trainer import policy_tokenizer
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.model import Tree
from gyre_hpc.trees.store import TreeStore


class Rollouts:
    def __init__(self, fleet: Controller, store: TreeStore, calls: RoutedCalls,
                 on_group: Callable[[StepState, list[RunOutcome]], None]):
        self.fleet, self.cfg, self.run, self.store, self.calls = fleet, fleet.cfg, fleet.run, store, calls
        self.on_group = on_group            # a whole advantage group of the current step finished
        self.tasks = load_tasks(self.cfg.rollout.tasks)
        self.harness_cfg = HarnessConfig.from_rollout(self.cfg.rollout)
        self.tokenizer = policy_tokenizer(self.cfg)   # prompts in the policy's own chat template
        self.places = self.cfg.rollout.tasks_per_step * self.cfg.rollout.runs_per_task
        self._pool: asyncio.Semaphore | None = None   # the harness pool: places for one step's runs
        self.scaffold = scaffold_command(self.cfg.rollout.agent)   # None: the project's own loop
        self.endpoint = None       # served from the first step on, when a scaffold drives the runs

    def _serve(self):
        if self.endpoint is None:
            # Here, not at the top: FastAPI and uvicorn are the endpoint extra, which a run of
            # the project's own loop does not need.
            from gyre_hpc.harness.chat_render import ChatRenderer
            from gyre_hpc.harness.endpoint_server import EndpointServer
            rc = self.cfg.rollout
            self.endpoint = EndpointServer(ChatRenderer(self.tokenizer), model_name=model_name(self.cfg),
                                           context_window=rc.context_limit, default_max_tokens=rc.max_new_tokens,
                                           max_tokens_limit=rc.max_new_tokens)
            self.endpoint.start()
        return self.endpoint

    async def stop(self) -> None:
        """Stop serving the endpoint (the fleet is stopping)."""
        if self.endpoint is not None:
            await self.endpoint.stop()
            self.endpoint = None

    def start(self, step: int, active: bool, trained_upto: int) -> tuple[StepState, list[asyncio.Task]]:
        """The step's state and a task per run still to roll out (call on the event loop)."""
        if self._pool is None:
            self._pool = asyncio.Semaphore(self.places)
        st = StepState(step, sample_runs(self.tasks, self.cfg, step), start_version=self.fleet.policy_version,
                       active=active)
        stored = self.stored_trees(step, trained_upto)
        tasks = []
        for spec in st.specs:
            if spec.run_id in stored:
                index, tree = stored[spec.run_id]
                self._run_done(st, RunOutcome(spec, tree, stored=True, store_index=index))
            else:
                tasks.append(asyncio.create_task(self._agent(spec, st)))
        return st, tasks

    def activate(self, st: StepState) -> None:
        """A step rolled out ahead becomes the current one: hand on the groups it held."""
        st.active = True
        for outs in st.held:
            self.on_group(st, outs)
        st.held = []

    def stored_trees(self, step: int, trained_upto: int) -> dict[str, tuple[int, Tree]]:
        """Trees of ``step`` committed after the last checkpoint (a kill came before training
        them), with their store indices."""
        prefix = f"s{step:05d}-"
        ids = self.store.run_ids()
        return {rid: (i, self.store.read(i)) for i, rid in enumerate(ids)
                if i >= trained_upto and rid.startswith(prefix)}

    async def _agent(self, spec: RunSpec, st: StepState) -> None:
        # The harness pool (one step's runs): a run rolled out ahead (async) starts when a run
        # of the current step finishes and frees its place, as in the simulator.
        async with self._pool:
            await self._agent_run(spec, st)

    async def _agent_run(self, spec: RunSpec, st: StepState) -> None:
        st.run_started[spec.run_id] = time.time()
        client: CountingRunClient = self.calls.client(spec.run_id, spec.seed)
        st.run_calls[spec.run_id] = client
        args = (spec.task, self.run.workspaces / spec.run_id, client, self.run.journals / f"{spec.run_id}.journal",
                self.harness_cfg)
        rc = self.cfg.rollout
        snapshots = None
        if self.scaffold is not None:
            agent = ScaffoldRun(*args, endpoint=self._serve(), command=self.scaffold, run_id=spec.run_id)
        else:
            # A relaunch resumes the run from its journal and the newest of these snapshots
            # (harness.loop): at most rollout.snapshot_every calls' tools run again.
            snapshots = SnapshotStore(self.run.snapshots / spec.run_id)
            resume = dict(run_id=spec.run_id, tokenizer=self.tokenizer, snapshot_every=rc.snapshot_every,
                          snapshots=snapshots)
            if rc.tool_latency_s > 0:
                agent = LatencyAgentRun(*args, run_seed=spec.seed, median_s=rc.tool_latency_s,
                                        sigma=rc.tool_latency_sigma, **resume)
            else:
                agent = AgentRun(*args, **resume)
        try:
            result: RunResult = await agent.run(resume=True)
        finally:
            self.calls.forget_run(spec.run_id)     # its contexts are dead: no memory, no migration
        if snapshots is not None:
            # Its journal is ended: a relaunch reads the result from it and needs no workspace.
            await asyncio.to_thread(remove_tree, snapshots.root)
        versions = result.calls.policy_versions
        tree = build_tree(result.calls, run_id=spec.run_id, task_id=spec.task.task_id, reward=result.reward,
                          status=result.status,
                          policy_version=min(versions) if versions else self.fleet.policy_version,
                          wall_s=result.wall_s)
        if self.scaffold is not None and agent.session is not None:
            expanded = sum(c.prompt.size + c.output.size for c in result.calls)
            figures = {**agent.session.stats.as_dict(), "status": result.status, "reward": result.reward,
                       "tree_tokens": int(tree.n_tokens), "trained_tokens": int(tree.trained.sum()),
                       "sharing_ratio": expanded / tree.n_tokens if tree.n_tokens else None, "error": result.error}
            fsio.write_text(self.run.journals / f"{spec.run_id}.endpoint.json", json.dumps(figures))
        self._run_done(st, RunOutcome(spec, tree, client.migrations, client.restarts, client.calls, client.model_s,
                                      resumed_calls=result.replayed, tools_redone=result.tools_redone,
                                      restarted_from_first=result.restarted))

    def _run_done(self, st: StepState, outcome: RunOutcome) -> None:
        st.outcomes[outcome.spec.run_id] = outcome
        group = outcome.spec.group
        members = [s for s in st.specs if s.group == group]
        if group in st.groups_done or any(s.run_id not in st.outcomes for s in members):
            return
        st.groups_done.add(group)
        outs = [st.outcomes[s.run_id] for s in members]
        if not st.active:
            st.held.append(outs)    # rolled out ahead (async): handed on once its step is the current one
            return
        self.on_group(st, outs)


def scaffold_command(agent) -> list[str] | None:
    """The command line of ``rollout.agent``'s scaffold; None for the project's own loop."""
    if agent == "harness":
        return None
    if agent == "mini-swe-agent":
        return mini_swe_command()
    return list(agent.command)


def model_name(cfg) -> str:
    """What ``/v1/models`` lists: the checkpoint folder's name, or the preset's."""
    return Path(cfg.model.path).name if cfg.model.path else f"gyre-{cfg.model.preset}"
