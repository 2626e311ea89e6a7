"""Paced cells: real compute held to the device model's duration, overruns recorded.

The pacer is tested on a fake clock (its arithmetic), and a paced TorchEngine against a
native one on the same requests: the same tokens and logprobs, bit for bit (pacing changes
durations, never outputs), each step at least the device model's duration, and admission
bounded by the modelled KV.
"""
from __future__ import annotations

import dataclasses
import time

import pytest

from gyre_hpc.engines import Request
from gyre_hpc.engines.pacing import EnginePace, Pacer, TrainPace
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.devices import EngineModel, TrainModel

from engine_conformance import run_all, sampled
from engine_helpers import prompt


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        assert s >= 0
        self.t += s


def test_the_pacer_holds_work_to_its_target_and_records_overruns():
    clock = FakeClock()
    p = Pacer(clock=clock, sleep=clock.sleep)
    clock.t = 0.3                                  # 0.3 s of real compute
    assert p.hold(0.0, 1.0) == 1.0 and clock.t == 1.0
    start = clock.t
    clock.t += 2.0                                 # real compute beyond the model: an overrun
    assert p.hold(start, 0.5) == pytest.approx(2.0)
    r = p.record
    assert (r.intervals, r.overruns) == (2, 1)
    assert r.paced_s == pytest.approx(3.0) and r.overrun_s == pytest.approx(1.5)
    assert r.overrun_share == pytest.approx(0.5) and r.as_dict()["emulated"] is True


def test_a_slower_device_holds_every_duration_longer():
    clock = FakeClock()
    slow = Pacer(speed=0.5, clock=clock, sleep=clock.sleep)
    assert slow.hold(0.0, 1.0) == 2.0
    with pytest.raises(ValueError, match="speed"):
        Pacer(speed=0.0)


def test_targets_are_the_device_models_durations():
    e = EngineModel(single_seq_tokens_per_s=100.0, half_saturation_seqs=4.0, prefill_tokens_per_s=1000.0,
                    prefill_ctx_tokens=1000.0)
    pace = EnginePace(e, Pacer())
    assert pace.step_s(0, 0, []) == 0.0
    assert pace.step_s(2, 0, []) == pytest.approx(e.step_s(2))
    prefills = e.prefill_s(100) + e.prefill_s(50, 500)
    # The device's prefill server beside its decode: the step takes the longer of the two;
    # inside the step (a TorchEngine's own way, paper-local's device): their sum.
    assert pace.step_s(1, 0, [(100, 0), (50, 500)]) == pytest.approx(max(e.step_s(1), prefills))
    in_step = EnginePace(dataclasses.replace(e, prefill_in_step=True), Pacer())
    assert in_step.step_s(1, 0, [(100, 0), (50, 500)]) == pytest.approx(e.step_s(1) + prefills)
    assert in_step.step_s(0, 0, [(100, 0)]) == pytest.approx(e.prefill_s(100))
    t = TrainModel(tokens_per_s=1000.0, dp_sync_overhead=0.2)
    assert TrainPace(t, Pacer()).micro_batch_s(500, 1) == pytest.approx(0.5)
    assert TrainPace(t, Pacer()).micro_batch_s(500, 4) == pytest.approx(0.5 / 0.8)


def _requests():
    return [Request(f"r{i}", prompt(i, length=8 + 5 * i), sampled(6 + i, seed=i)) for i in range(4)]


def test_paced_and_native_engines_give_the_same_tokens(model_dir):
    device = EngineModel(single_seq_tokens_per_s=400.0, half_saturation_seqs=2.0, prefill_tokens_per_s=20_000.0)
    native = TorchEngine.from_pretrained(model_dir, name="n", max_batch=8)
    paced = TorchEngine.from_pretrained(model_dir, name="p", max_batch=8, pace=EnginePace(device, Pacer()))
    for r in _requests():
        native.submit(r)
        paced.submit(r)
    t0 = time.monotonic()
    a, b = run_all(native), run_all(paced)
    wall = time.monotonic() - t0
    assert {k: (v.token_ids, v.logprobs) for k, v in a.items()} == {k: (v.token_ids, v.logprobs) for k, v in b.items()}
    rec = paced.pace_record()
    assert native.pace_record() is None
    assert rec["intervals"] > 0 and rec["paced_s"] >= rec["intervals"] * device.step_s(1) * 0.999
    assert wall >= rec["paced_s"] * 0.99       # the paced steps really took their durations


def test_a_paced_engine_admits_no_more_than_its_modelled_kv(model_dir):
    # KV for ~60 tokens: with 4 prompts of 8-23 tokens, never all at once
    device = EngineModel(single_seq_tokens_per_s=5000.0, prefill_tokens_per_s=1e6, gpus=1, gpu_memory_gb=60e-9,
                         memory_utilization=1.0, kv_bytes_per_token=1.0)
    assert device.kv_capacity_tokens() == 60
    paced = TorchEngine.from_pretrained(model_dir, name="p", max_batch=8, pace=EnginePace(device, Pacer()))
    for r in _requests():
        paced.submit(r)
    most = 0
    while paced.has_unfinished():
        paced.step()
        most = max(most, paced.load().running)
    assert 1 <= most < 4
    assert len(paced.pop_finished()) == 4
