"""The device model (``gyre_hpc.devices``): the durations and capacities the simulator
prices events with and paced cells hold their work to. Pure functions, checked by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gyre_hpc.devices import DEVICE_PRESETS, DeviceError, EngineModel, TrainModel, device_preset


def test_decode_step_amortises_weights_and_reads_the_batchs_kv():
    e = EngineModel(single_seq_tokens_per_s=100.0, half_saturation_seqs=9.0, gpus=4, kv_bytes_per_token=1e3,
                    gpu_bandwidth_gb_s=1.0)
    assert e.step_s(1) == pytest.approx(0.01)
    assert e.step_s(11) == pytest.approx(0.01 * 20 / 10)          # (h + n) / (h + 1) x the single step
    assert e.kv_read_s_per_token == pytest.approx(1e3 / 4e9)
    assert e.step_s(1, 4e6) == pytest.approx(0.01 + 1.0)          # 4M KV tokens read over 4 GPUs at 1 GB/s
    assert e.per_seq_tokens_per_s(1, 4e6) == pytest.approx(1 / 1.01)
    assert e.decode_s(10, 11) == pytest.approx(10 * e.step_s(11))


def test_prefill_is_compute_priced_and_grows_with_position():
    e = EngineModel(prefill_tokens_per_s=1000.0, prefill_ctx_tokens=500.0)
    assert e.prefill_s(100) == pytest.approx(0.1 * (1 + 50 / 500))
    assert e.prefill_s(100, 1000) == pytest.approx(0.1 * (1 + 1050 / 500))
    assert np.allclose(e.prefill_s(np.array([100.0, 0.0]), np.array([0.0, 5.0])), [e.prefill_s(100), 0.0])
    flat = EngineModel(prefill_tokens_per_s=1000.0)
    assert flat.prefill_s(100, 10_000) == pytest.approx(0.1)


def test_an_engine_step_takes_its_prefills_after_the_decode_or_beside_it():
    e = EngineModel(single_seq_tokens_per_s=100.0, half_saturation_seqs=9.0, prefill_tokens_per_s=1000.0)
    assert e.batch_step_s(2, 0.0, []) == pytest.approx(e.step_s(2))
    assert e.batch_step_s(2, 0.0, [(5, 0), (3, 10)]) == pytest.approx(e.step_s(2))          # 8 ms beside an 11 ms step
    assert e.batch_step_s(2, 0.0, [(50, 0)]) == pytest.approx(0.05)                         # the prefill is longer
    in_step = EngineModel(single_seq_tokens_per_s=100.0, half_saturation_seqs=9.0, prefill_tokens_per_s=1000.0,
                          prefill_in_step=True)
    assert in_step.batch_step_s(2, 0.0, [(5, 0), (3, 10)]) == pytest.approx(e.step_s(2) + 0.008)
    assert in_step.batch_step_s(0, 0.0, [(50, 0)]) == pytest.approx(0.05)
    assert device_preset("paper-local")[0].prefill_in_step      # paced TorchEngines prefill inside the step


def test_kv_lives_per_gpu_beside_its_share_of_the_weights():
    e = EngineModel(gpus=8, gpu_memory_gb=80.0, weights_gb=320.0, memory_utilization=0.9, kv_bytes_per_token=1e5,
                    attention_gpus=2)
    per_gpu = int((72.0 - 40.0) * 1e9 / 1e5)
    assert e.kv_per_gpu_tokens() == per_gpu and e.kv_capacity_tokens() == 8 * per_gpu
    assert e.max_context_tokens() == 2 * per_gpu
    assert EngineModel().kv_capacity_tokens() == 0 and EngineModel().max_context_tokens() == 0
    with pytest.raises(DeviceError, match="attention_gpus=9"):
        EngineModel(gpus=8, attention_gpus=9)


def test_the_elastic_target_is_where_per_sequence_speed_drops_by_the_tolerance():
    e = EngineModel(single_seq_tokens_per_s=60, half_saturation_seqs=100, max_seqs=256, tolerated_slowdown=0.1)
    n = e.target_seqs()
    assert e.per_seq_tokens_per_s(n) >= 0.9 * 60 > e.per_seq_tokens_per_s(n + 1)


def test_training_rate_time_and_state_memory():
    t = TrainModel(tokens_per_s=1000.0, dp_sync_overhead=0.1, params=1e9, state_bytes_per_param=16.0,
                   memory_gb=4.0, memory_utilization=1.0)
    assert t.rate(0) == 0.0 and t.rate(1) == 1000.0 and t.rate(3) == pytest.approx(2700.0)
    assert t.train_s(900, 3) == pytest.approx(1.0)
    assert t.state_gb() == 16.0 and t.min_replicas() == 4
    assert t.memory_shortfall(4) == "" and "needs >= 4 cells" in t.memory_shortfall(3)
    assert TrainModel().min_replicas() == 1     # not modelled


def test_device_presets_are_valid_and_named_errors_list_them():
    for name in DEVICE_PRESETS:
        engine, train = device_preset(name)
        assert engine.step_s(1) > 0 and train.tokens_per_s > 0
    with pytest.raises(DeviceError, match="valid presets: paper-local"):
        device_preset("h100")
    assert math.isfinite(device_preset("paper-local")[0].prefill_s(100, 100))
