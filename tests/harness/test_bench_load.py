"""``gyre-hpc bench load``: concurrent harness runs over the router lose and double no request.

The CLI runs at two small sizes (the default sweep's 32-256 runs are the documented
figures); the counting is pinned on planted ledgers, and the real pipeline with a transport
that drops one output or sends one request to both engines must be caught by it."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from gyre_hpc.bench.load import LedgerEngines, LoadHarness, Workload, count_requests

REPO = Path(__file__).resolve().parents[2]


def test_bench_load_small_sizes_finish_every_run_with_no_lost_or_duplicated_request():
    proc = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "bench", "load", "--json",
                           "--runs", "8,16", "--turns", "4"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)             # stdout carries the JSON object alone
    assert (rep["lost"], rep["duplicated"]) == (0, 0)
    assert rep["requests_ok"] and rep["every_run_finished"] and rep["nothing_left_after"]
    assert rep["workload"]["turns"] == 4 and rep["max_concurrent_runs"] == 16
    for size in rep["sizes"]:
        n = size["runs"]
        assert size["status"] == size["status_traced_pass"] == {"finished": n}
        for ledger in (size["requests"], size["requests_traced_pass"]):
            assert ledger["queued"] == ledger["submitted"] == ledger["finished"] == ledger["journaled"] == 4 * n
        # The runs were alive together: both engines decoded batches of several runs' calls.
        assert all(b["max"] >= 2 for b in size["batch"].values()) and len(size["batch"]) == 2
        assert size["peak_runs_awaiting_model"] >= 2
        assert size["queue_s"]["median"] is not None and size["memory"]["traced_peak_mb"] > 0
        assert not any(size["left_after"].values())


def _clean(runs=3, calls=2):
    ids = [f"r{i}-{i * calls + k}" for i in range(runs) for k in range(calls)]
    return ids, {f"r{i}": calls for i in range(runs)}


def test_count_requests_finds_a_planted_lost_duplicated_or_unrequested_request():
    ids, journaled = _clean()
    clean = count_requests(ids, ids, ids, journaled)
    assert clean["ok"] and (clean["lost"], clean["duplicated"], clean["unrequested"]) == (0, 0, 0)

    lost = count_requests(ids, ids, ids[1:], journaled)            # one output never came back
    assert not lost["ok"] and lost["lost"] == 1 and lost["examples"]["lost"] == [ids[0]]
    assert lost["runs_journal_mismatch"] == 1                      # r0 journaled a call no output answered

    never_sent = count_requests(ids, ids[1:], ids[1:], journaled)  # queued, never submitted
    assert not never_sent["ok"] and never_sent["lost"] == 1

    doubled = count_requests(ids, ids, ids + [ids[3]], journaled)  # an engine returned one twice
    assert not doubled["ok"] and doubled["duplicated"] == 1 and doubled["examples"]["duplicated"] == [ids[3]]

    resent = count_requests(ids, ids + [ids[2]], ids, journaled)   # submitted to two engines
    assert not resent["ok"] and resent["duplicated"] == 1

    phantom = count_requests(ids, ids, ids + ["r9-99"], journaled)
    assert not phantom["ok"] and phantom["unrequested"] == 1

    assert not count_requests(ids, ids, ids, journaled, restarts=1)["ok"]


class _DropsFirstOutput(LedgerEngines):
    """A transport that loses the first output an engine returns."""

    def __init__(self, engines):
        super().__init__(engines)
        self.dropped: list[str] = []

    def poll(self):
        reports = super().poll()
        if not self.dropped:
            for i, report in enumerate(reports):
                if report.outputs:
                    self.dropped.append(report.outputs[0].request_id)
                    self.finished.remove(self.dropped[0])
                    reports[i] = type(report)(report.engine, report.events, report.outputs[1:],
                                              report.prefill_tokens, report.cached_prompt_tokens)
                    break
        return reports


class _SendsFirstRequestTwice(LedgerEngines):
    """A transport that sends the first request to both engines."""

    def __init__(self, engines):
        super().__init__(engines)
        self.sent_twice: list[str] = []

    def submit(self, engine, request):
        super().submit(engine, request)
        if not self.sent_twice:
            self.sent_twice.append(request.request_id)
            super().submit(1 - engine, request)


def _pool(transport, workload, tmp_path, n=3):
    async def go():
        h = LoadHarness(workload, str(tmp_path), transport=transport)
        results = await h.pool(n, "p")
        return h, results
    return asyncio.run(go())


def test_the_bench_ledger_catches_a_transport_that_loses_or_doubles_a_request(tmp_path):
    quick = Workload(turns=2, max_new_tokens=4, tool_latency_s=0.01, run_timeout_s=3.0)
    h, results = _pool(_DropsFirstOutput, quick, tmp_path / "lost")
    ledger = h.ledger(results)
    assert not ledger["ok"] and ledger["lost"] == 1 and ledger["examples"]["lost"] == h.transport.dropped
    assert sorted(r.status for r in results) == ["finished", "finished", "timeout"]   # its run waited in vain

    h, results = _pool(_SendsFirstRequestTwice, quick, tmp_path / "doubled")
    ledger = h.ledger(results)
    assert not ledger["ok"] and ledger["duplicated"] == 1
    assert ledger["examples"]["duplicated"] == h.transport.sent_twice
    assert all(r.status == "finished" for r in results)   # the harness itself never sees the double
