"""gyre-hpc: Slurm-native online RL for long-horizon LLM agents."""
from __future__ import annotations

__version__ = "0.1.0"


def submit(cfg, **kwargs):
    """Submit the head job with submitit from a Python session; returns the submitit Job.

    Imported lazily so ``import gyre_hpc`` stays cheap on a login node.
    """
    from gyre_hpc.jobs.submit import submit as _submit

    return _submit(cfg, **kwargs)
