"""Scheduler policies: pure functions from observed state to role changes."""
