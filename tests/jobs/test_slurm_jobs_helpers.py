"""The Slurm test helpers' own logic that needs no cluster."""
from __future__ import annotations

from datetime import datetime, timedelta

from tests.jobs.slurm_jobs import nudge_if_eligible


def test_only_a_pending_job_past_its_begin_time_is_nudged():
    past = (datetime.now() - timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%S")
    future = (datetime.now() + timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M:%S")
    assert not nudge_if_eligible("1", {"JobState": "RUNNING", "EligibleTime": past})
    assert not nudge_if_eligible("1", {"JobState": "PENDING", "EligibleTime": future})
    assert not nudge_if_eligible("1", {"JobState": "PENDING", "EligibleTime": "Unknown"})
    assert not nudge_if_eligible("1", {"JobState": "PENDING"})
