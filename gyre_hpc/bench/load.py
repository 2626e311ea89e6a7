"""``gyre-hpc bench load``: the router and the harness pool under hundreds of concurrent runs.

Workload: N real ``AgentRun``s (``rl.latency.LatencyAgentRun``: a seeded lognormal tool wait
between calls) of one multi-turn task, all started together on one asyncio loop, every model
call going through ``rl.router_client.RoutedCalls`` -> ``engines.router.Router`` -> two
in-process TorchEngines on the tiny model, pumped as the RL controller pumps them (dispatch,
poll, yield). Each run forgets its sessions when it ends, as ``rl.rollouts`` does. The
untrained model's output is no tool call, so each turn appends to the answer file (the
default action), waits its tool latency and calls again: runs stay alive for all their turns,
some waiting on the engines while others sit in tools.

Per size, counted from what crossed the transport (not from what was asked):
- every call the harness queued, every submit, every output an engine returned and every
  call a run journaled; ``count_requests`` finds the lost (queued or submitted, no output),
  the duplicated (queued, submitted or returned twice), the unrequested (an output nobody
  submitted) and runs whose journal disagrees with the outputs of their requests;
- queueing time: from the harness queueing a call to the poll that brought its first token
  (routing wait + engine queue + prefill);
- each engine's decode batch per step (sequences decoding when the step began);
- memory, above the empty harness (engines built, warm-up runs done and forgotten): peak RSS
  sampled by the pump in a pass without tracemalloc, then a second pass of N fresh runs under
  tracemalloc (Python and numpy allocations; torch's KV tensors are not traced) for its peak
  and for what is still allocated once every run ended (a leak would stay there);
- what the router, the engines and the client still book after the runs (all must be 0).
Each size runs in its own spawned process, so one size's heap does not carry into the next.
``memory_slope`` is the least-squares slope of log(RSS above the baseline) on log(runs).
"""
from __future__ import annotations

import asyncio
import gc
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import click

from gyre_hpc.bench.scale import _rss_bytes, growth_exponent, in_child
from gyre_hpc.engines.router import InProcessEngines, Router
from gyre_hpc.harness.loop import HarnessConfig
from gyre_hpc.harness.tasks import Task, TaskTest
from gyre_hpc.report import emit
from gyre_hpc.rl.latency import LatencyAgentRun
from gyre_hpc.rl.router_client import RoutedCalls

DEFAULT_RUNS = (32, 64, 128, 256)
WARMUP_RUNS = 4
SLOPE_TARGET = 1.1


@dataclass(frozen=True)
class Workload:
    """What each size runs; printed in the JSON as is."""

    engines: int = 2
    preset: str = "tiny"
    max_batch: int = 64             # decode slots per engine
    turns: int = 6                  # model calls per run
    max_new_tokens: int = 16
    tool_latency_s: float = 0.4     # median of the lognormal wait after each tool call but the last
    tool_latency_sigma: float = 0.6
    context_limit: int = 1024
    run_timeout_s: float = 600.0    # far beyond the slowest run: a timeout here would be a failure
    temperature: float = 1.0


def count_requests(queued: Sequence[str], submitted: Sequence[str], finished: Sequence[str],
                   journaled: Mapping[str, int], restarts: int = 0) -> dict:
    """Every request accounted for, by id: ``queued`` (calls the harness asked), ``submitted``
    (transport submits), ``finished`` (engine outputs), ``journaled`` (run id -> calls the run
    recorded), ``restarts`` (requests routed again, ``RoutedCalls.restarts``). A request id is
    ``<run id>-<n>`` (``RoutedCalls.generate``)."""
    asked, sent, done = Counter(queued), Counter(submitted), Counter(finished)
    ids = set(asked) | set(sent) | set(done)
    lost = sorted((set(asked) | set(sent)) - set(done))
    duplicated = sorted(r for r in ids if max(asked[r], sent[r], done[r]) > 1)
    unrequested = sorted(set(done) - set(sent))
    per_run = Counter(rid.rsplit("-", 1)[0] for rid in done)
    mismatched = sorted(run for run in set(per_run) | set(journaled) if per_run[run] != journaled.get(run, 0))
    return {"queued": len(queued), "submitted": len(submitted), "finished": len(finished),
            "journaled": sum(journaled.values()), "lost": len(lost), "duplicated": len(duplicated),
            "unrequested": len(unrequested), "restarted": restarts, "runs_journal_mismatch": len(mismatched),
            "ok": not (lost or duplicated or unrequested or mismatched or restarts),
            "examples": {"lost": lost[:5], "duplicated": duplicated[:5], "unrequested": unrequested[:5],
                         "runs_journal_mismatch": mismatched[:5]}}


class LedgerEngines(InProcessEngines):
    """The in-process transport, recording what crosses it: submits, first tokens, outputs and
    each engine's decode batch per step."""

    def __init__(self, engines):
        super().__init__(engines)
        self.clear()

    def clear(self) -> None:
        self.submitted: list[str] = []
        self.finished: list[str] = []
        self.first_token_at: dict[str, float] = {}
        self.batches: dict[int, list[int]] = {e: [] for e in self.engines}
        self.peak_kv_tokens = 0               # tokens in the engines' decode caches, all engines

    def submit(self, engine, request) -> None:
        super().submit(engine, request)
        self.submitted.append(request.request_id)

    def poll(self):
        in_flight = 0
        for idx, eng in self.engines.items():
            load = eng.load()
            in_flight += load.kv_tokens
            if load.running:                  # what the step about to run decodes together
                self.batches[idx].append(load.running)
        self.peak_kv_tokens = max(self.peak_kv_tokens, in_flight)
        reports = super().poll()
        now = time.monotonic()
        for report in reports:
            for ev in report.events:
                if ev.index == 0:
                    self.first_token_at.setdefault(ev.request_id, now)
            self.finished += [o.request_id for o in report.outputs]
        return reports


class _StampingList(list):
    """A queue whose ``append`` records when each request was queued, by request id."""

    def __init__(self, items, stamps: dict[str, float]):
        super().__init__(items)
        self.stamps = stamps

    def append(self, request) -> None:
        self.stamps.setdefault(request.request_id, time.monotonic())
        super().append(request)


class TimedCalls(RoutedCalls):
    """``RoutedCalls`` stamping each request as the harness queues it (``queued_at``)."""

    def __init__(self, router: Router, **kwargs):
        self.queued_at: dict[str, float] = {}
        super().__init__(router, **kwargs)

    @property
    def queue(self) -> list:
        return self._stamped

    @queue.setter
    def queue(self, items) -> None:      # dispatch replaces the queue: stamp the new one too
        self._stamped = _StampingList(items, self.queued_at)


class LoadHarness:
    """Engines, router and client of one size's process, and the pool that runs N runs on them."""

    def __init__(self, workload: Workload, root: str, transport: type[LedgerEngines] = LedgerEngines):
        """``transport``: the recording transport (a test plants a lost or doubled request through it)."""
        from gyre_hpc.engines.torch_engine import TorchEngine
        from gyre_hpc.models.tiny_lm import build_model

        w = self.workload = workload
        self.root = root
        model = build_model(w.preset, seed=0)
        self.engines = {e: TorchEngine(model, name=f"e{e}", seed=e, max_batch=w.max_batch) for e in range(w.engines)}
        self.transport = transport(self.engines)
        self.router = Router(self.transport, list(self.engines))
        self.calls = TimedCalls(self.router, temperature=w.temperature)
        self.task = Task("load", "Append notes to answer.txt, one line per turn.",
                         (TaskTest("answered", "import os\nassert os.path.getsize('answer.txt') > 0"),),
                         max_turns=w.turns)
        self.cfg = HarnessConfig(max_new_tokens=w.max_new_tokens, context_limit=w.context_limit,
                                 run_timeout_s=w.run_timeout_s, max_retries=0)
        self.peak: dict[str, int] = {}

    async def _one(self, run_id: str, seed: int):
        w = self.workload
        client = self.calls.client(run_id, seed)
        run = LatencyAgentRun(self.task, f"{self.root}/{run_id}", client, f"{self.root}/{run_id}.journal", self.cfg,
                              run_id=run_id, run_seed=seed, median_s=w.tool_latency_s, sigma=w.tool_latency_sigma)
        try:
            return await run.run()
        finally:
            self.calls.forget_run(run_id)     # its contexts are dead, as rl.rollouts does

    async def pool(self, n: int, prefix: str) -> list:
        """Start ``n`` runs together and pump the router until every one ended."""
        self.transport.clear()
        self.calls.queued_at.clear()
        self.peak = {"rss": _rss_bytes(), "retained_kv_tokens": 0, "awaiting_model": 0, "in_tools": 0}
        runs = [asyncio.create_task(self._one(f"{prefix}{i:04d}", 1000 + i)) for i in range(n)]
        while True:
            alive = sum(not r.done() for r in runs)
            if not alive:
                break
            self.calls.dispatch()
            self.calls.pump()
            p = self.peak
            p["rss"] = max(p["rss"], _rss_bytes())
            p["retained_kv_tokens"] = max(p["retained_kv_tokens"], sum(e.retained_tokens for e in self.engines.values()))
            p["awaiting_model"] = max(p["awaiting_model"], self.calls.waiting)
            p["in_tools"] = max(p["in_tools"], alive - self.calls.waiting)
            # Every run in a tool wait: nothing to step, so do not spin the shared cores.
            await asyncio.sleep(0 if self.router.unfinished() or self.calls.queue else 0.002)
        return [r.result() for r in runs]

    def ledger(self, results) -> dict:
        return count_requests(list(self.calls.queued_at), self.transport.submitted, self.transport.finished,
                              {r.run_id: len(r.calls) for r in results}, sum(self.calls.restarts.values()))

    def queue_s(self) -> list[float]:
        first, queued = self.transport.first_token_at, self.calls.queued_at
        return [first[r] - t for r, t in queued.items() if r in first]

    def left_after(self) -> dict:
        """What the router, engines and client still hold once every run ended (all 0)."""
        return {"router_in_flight": self.router.unfinished(), "router_sessions": len(self.router.sessions),
                "engine_sessions": sum(len(e.retained_sessions()) for e in self.engines.values()),
                "engine_requests": sum(len(e.request_ids()) for e in self.engines.values()),
                "waiting_calls": self.calls.waiting, "queued_calls": len(self.calls.queue),
                "started_not_finished": len(self.calls.started)}


def _quantiles(values: Sequence[float]) -> dict:
    if not values:
        return {"median": None, "p95": None, "max": None}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "max": ordered[-1]}


async def _passes(h: LoadHarness, n_runs: int) -> dict:
    """Warm up, then the measured pass (RSS, no tracemalloc), then the traced pass."""
    await h.pool(WARMUP_RUNS, "warm")          # worker threads, the jail, torch kernels
    gc.collect()
    base_rss = _rss_bytes()
    t0 = time.monotonic()
    results = await h.pool(n_runs, "run")
    wall = time.monotonic() - t0
    out = {
        "runs": n_runs,
        "status": dict(Counter(r.status for r in results)),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "calls_per_run": _quantiles([len(r.calls) for r in results]),
        "requests": h.ledger(results),
        "queue_s": _quantiles(h.queue_s()),
        "batch": {f"engine{e}": {"steps": len(b), "mean": statistics.fmean(b) if b else 0.0, "max": max(b, default=0)}
                  for e, b in h.transport.batches.items()},
        # Runs alive at once: waiting on a model call, and between calls (a tool, its wait, the checker).
        "peak_runs_awaiting_model": h.peak["awaiting_model"],
        "peak_runs_in_tools": h.peak["in_tools"],
        "wall_s": wall,
    }
    rss_above = h.peak["rss"] - base_rss
    memory = {"baseline_rss_mb": base_rss / 2**20, "peak_rss_mb": h.peak["rss"] / 2**20,
              "rss_above_baseline_mb": rss_above / 2**20, "rss_kb_per_run": rss_above / 1024 / n_runs,
              "peak_decoding_kv_tokens": h.transport.peak_kv_tokens,
              "peak_retained_kv_tokens": h.peak["retained_kv_tokens"],
              "kv_bytes_per_token": h.engines[0].kv_layout.bytes_per_token}
    del results
    gc.collect()
    tracemalloc.start()
    traced = await h.pool(n_runs, "traced")
    traced_peak = tracemalloc.get_traced_memory()[1]
    out["status_traced_pass"] = dict(Counter(r.status for r in traced))
    out["requests_traced_pass"] = h.ledger(traced)
    del traced
    h.transport.clear()          # the bench's own ledgers are not the harness's memory
    h.calls.queued_at.clear()
    gc.collect()
    traced_left = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    memory.update({"traced_peak_mb": traced_peak / 2**20, "traced_kb_per_run": traced_peak / 1024 / n_runs,
                   "traced_left_after_mb": traced_left / 2**20})
    out["memory"] = memory
    out["left_after"] = h.left_after()
    return out


def _measure(n_runs: int, workload: Workload, out) -> None:
    """Child process: one size's figures onto ``out``."""
    os.dup2(2, 1)          # library output to stderr: the parent's stdout carries the JSON alone
    sys.stdout = sys.stderr
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-load-") as root:
        out.put(asyncio.run(_passes(LoadHarness(workload, root), n_runs)))


def measure(sizes: Sequence[int], workload: Workload = Workload()) -> dict:
    t0 = time.monotonic()
    rows = [in_child(_measure, n, workload, label=f"bench load: {n} runs", timeout_s=1800) for n in sizes]
    xs = [r["runs"] for r in rows]
    slope = growth_exponent(xs, [r["memory"]["rss_above_baseline_mb"] for r in rows])
    ledgers = [r[k] for r in rows for k in ("requests", "requests_traced_pass")]
    return {
        "workload": {**asdict(workload),
                     "task": f"{workload.turns} turns; the untrained model's output is appended to answer.txt "
                             "(no tool call), then a lognormal tool wait, then the next call; scored by the "
                             "confined checker at the end",
                     "path": f"LatencyAgentRun -> RoutedCalls -> Router -> {workload.engines} in-process "
                             "TorchEngines, one asyncio loop; every run of a size started at once",
                     "queue_s": "the harness queues a call -> the poll that brings its first token",
                     "batch": "sequences decoding when an engine step began (steps with any)",
                     "memory": "rss: peak RSS sampled by the pump minus RSS of the empty harness (engines "
                               f"built, {WARMUP_RUNS} warm-up runs done and forgotten); traced: tracemalloc "
                               "over a second pass of N fresh runs (no torch tensors), its peak and what "
                               "was still allocated after; each size in its own process",
                     "memory_slope": "least-squares slope of log(rss above baseline) on log(runs)"},
        "sizes": rows,
        "lost": sum(ledger["lost"] for ledger in ledgers),
        "duplicated": sum(ledger["duplicated"] for ledger in ledgers),
        "requests_ok": all(ledger["ok"] for ledger in ledgers),
        "every_run_finished": all(r[k] == {"finished": r["runs"]} for r in rows for k in ("status", "status_traced_pass")),
        "nothing_left_after": all(not any(r["left_after"].values()) for r in rows),
        "max_concurrent_runs": max(xs, default=0),
        "memory_slope": slope,
        "traced_memory_slope": growth_exponent(xs, [r["memory"]["traced_peak_mb"] for r in rows]),
        "memory_slope_target": SLOPE_TARGET,
        "memory_slope_within_target": None if slope is None else slope <= SLOPE_TARGET,
        "wall_s": time.monotonic() - t0,
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--runs", "sizes_opt", default=",".join(map(str, DEFAULT_RUNS)), show_default=True,
              help="comma-separated numbers of concurrent runs, one measurement each")
@click.option("--turns", default=Workload.turns, show_default=True, type=click.IntRange(1, 64))
@click.option("--max-new-tokens", default=Workload.max_new_tokens, show_default=True, type=click.IntRange(1, 512))
@click.option("--tool-latency-s", default=Workload.tool_latency_s, show_default=True, type=click.FloatRange(0.0))
def command(as_json: bool, sizes_opt: str, turns: int, max_new_tokens: int, tool_latency_s: float) -> None:
    """Hundreds of concurrent harness runs over the router: lost/duplicated requests, queueing, batches, memory."""
    try:
        sizes = [int(t) for t in sizes_opt.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"{sizes_opt!r} is not a comma-separated list of integers", param_hint="--runs") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{sizes_opt!r}: give at least one size, each >= 1", param_hint="--runs")
    emit(measure(sizes, Workload(turns=turns, max_new_tokens=max_new_tokens, tool_latency_s=tool_latency_s)), as_json)
