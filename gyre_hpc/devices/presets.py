"""Named devices for paced cells (``cells.device: paced``, ``cells.pace.preset``)."""
from __future__ import annotations

from gyre_hpc.devices.model import DeviceError, EngineModel, TrainModel

# ``paper-local``: the cells of ``examples/paper-local.yaml`` (a small model, 8 cells sharing a
# small machine's cores) given the dimensionless shape of the paper preset's regime
# (docs/sim.md "paper-local"): decode bound by the engine, a step's KV reads a real share of
# it, training a large share of a colocate step, prefill by compute, inside the engine step
# (a TorchEngine step prefills what it admits, then decodes). Every rate is below what
# the real compute does here, so pacing, not CPU contention, sets the durations (overruns
# are recorded; above ~5% the emulation is not valid).
DEVICE_PRESETS: dict[str, tuple[EngineModel, TrainModel]] = {
    "paper-local": (
        EngineModel(single_seq_tokens_per_s=20.0, half_saturation_seqs=8.0, max_seqs=32,
                    prefill_tokens_per_s=2000.0, prefill_ctx_tokens=2000.0, prefill_in_step=True,
                    gpus=1, gpu_memory_gb=1.0, weights_gb=0.1, memory_utilization=0.9,
                    kv_bytes_per_token=50_000.0, gpu_bandwidth_gb_s=7.7),
        TrainModel(tokens_per_s=80.0, dp_sync_overhead=0.1, optimizer_step_s=0.5, weight_sync_s=0.5),
    ),
}


def device_preset(name: str) -> tuple[EngineModel, TrainModel]:
    if name not in DEVICE_PRESETS:
        raise DeviceError(f"unknown device preset {name!r}; valid presets: {', '.join(sorted(DEVICE_PRESETS))}")
    return DEVICE_PRESETS[name]
