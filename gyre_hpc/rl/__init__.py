"""End-to-end elastic RL: the ``workload: rl`` mode of the fleet (see docs/rl.md)."""
