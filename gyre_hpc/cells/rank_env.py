"""Process environment a fleet rank needs before MPI and torch start.

Called first thing by the rank entry points (``python -m gyre_hpc.substrate``, ``gyre_hpc.rl``, the switch
benchmark's rank program), because both settings are read once, at MPI_Init and at torch's
first large allocation. Values the user already set are left alone.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping


def prepare_rank_env(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set what is missing; returns what it set.

    - ``THP_MEM_ALLOC_ENABLE=1``: torch puts large CPU tensors on transparent huge pages. MPI
      moves weights out of and into torch memory; a 100 MB shared-memory transfer ran at
      ~4.5 GB/s on 4 KB pages and ~12 GB/s on huge pages.
    - ``OMPI_MCA_btl_vader_backing_directory``, under Slurm: Open MPI names its shared-memory
      segments ``vader_segment.<hostname>.<job>.<local rank>`` in /dev/shm. Virtual Slurm nodes
      on one host (the local test cluster) share the hostname, so two cells' ranks took the
      same segment and crashed in ``mca_btl_vader_poll_handle_frag``. A directory per Slurm node
      keeps them apart; on a real cluster it is merely one more directory level.
    """
    done: dict[str, str] = {}
    if "THP_MEM_ALLOC_ENABLE" not in env:
        env["THP_MEM_ALLOC_ENABLE"] = done["THP_MEM_ALLOC_ENABLE"] = "1"
    node = env.get("SLURMD_NODENAME")
    key = "OMPI_MCA_btl_vader_backing_directory"
    if node and key not in env:
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(env.get("TMPDIR", "/tmp"))
        backing = shm / f"gyre-{node}"
        backing.mkdir(mode=0o1777, exist_ok=True)
        env[key] = done[key] = str(backing)
    return done
