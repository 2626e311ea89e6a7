"""The agent harness: multi-turn loop, tools, confinement, journals, tasks, tokenizer."""
