"""The agent harness: multi-turn loop, tools, confinement, journals, tasks, tokenizer.

Entry points: ``loop.AgentRun`` / ``loop.HarnessConfig``, ``journal.load_journal``,
``tasks.load_suite``, ``engine_client.EngineCalls``; see docs/harness.md.
"""
