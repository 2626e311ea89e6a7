import json
import time

import click
import numpy as np
import pytest
from click.testing import CliRunner

from gyre_hpc.bench.scale import command, growth_exponent, in_child, json_journal_bytes
from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_journal


def test_growth_exponent_is_the_log_log_slope():
    x = np.array([1e3, 2e3, 4e3, 8e3])
    assert abs(growth_exponent(x, 3 * x) - 1) < 1e-12
    assert abs(growth_exponent(x, x**2) - 2) < 1e-12
    assert growth_exponent([1e3], [1.0]) is None and growth_exponent(x, [0, 1, 2, 3]) is None


def test_json_baseline_is_the_exact_size_of_the_old_format():
    calls = synthetic_journal(SyntheticConfig(n_calls=12), seed=4)
    old = sum(len(json.dumps({"type": "call", "role": c.role, "agent": c.agent, "policy_version": c.policy_version,
                              "prompt": c.prompt.tolist(), "output": c.output.tolist(),
                              "logprobs": [float(x) for x in c.logprobs]}, separators=(",", ":"))) + 1 for c in calls)
    assert json_journal_bytes(calls) == old


@pytest.mark.slow  # a dozen spawned processes importing torch: ~1 min on a busy 2-core box
def test_quick_bench_prints_figures_with_growth_exponents():
    result = CliRunner().invoke(command, ["--json", "--quick", "--calls", "6,12", "--train-tokens", "1848,3348",
                                          "--chunked-tokens", "1848", "--chunk", "512"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # stderr carries the per-measurement log
    runs = out["runs"]
    assert [r["calls"] for r in runs] == [6, 12] and all(r["store_read_exact"] for r in runs)
    assert all(r["build_identical"] for r in runs)     # from increments == from whole prompts
    assert all(r["loaded_calls"] == r["calls"] for r in runs)
    assert all(r["json_journal_bytes"] > 2 * r["journal_bytes"] for r in runs)
    series = out["runs_vs_unique_tokens"]["journal_bytes"]
    assert series["values"] == [r["journal_bytes"] for r in runs] and series["growth_exponent"] < 1.5
    whole, chunked = out["training"]["whole"], out["training"]["chunked"]
    assert [r["tokens"] for r in whole] == [1848, 3348] and chunked[0]["tokens"] == 1848
    assert all(r["grad_finite"] and r["step_s"] > 0 and r["attention_bound_s"] > 0 for r in whole + chunked)
    # The same path gives the same loss whole and in chunks.
    assert abs(chunked[0]["loss"] - whole[0]["loss"]) <= 1e-5 * abs(whole[0]["loss"])
    assert out["training_vs_tokens"]["whole"]["peak_mem_mb"]["growth_exponent"] is not None


def test_bad_sizes_are_named():
    result = CliRunner().invoke(command, ["--calls", "5,x"])
    assert result.exit_code != 0 and "--calls" in result.output


def _reports(value, queue):
    queue.put({"value": value})


def _raises(value, queue):
    raise RuntimeError(f"measurement {value} broke")


def test_in_child_returns_the_childs_figures_and_fails_fast_when_the_child_dies():
    assert in_child(_reports, 3, label="t") == {"value": 3}
    t0 = time.monotonic()
    with pytest.raises(click.ClickException, match="exited with 1 before reporting"):
        in_child(_raises, 4, label="t", timeout_s=120)
    assert time.monotonic() - t0 < 60          # not the timeout: the child's death is noticed


def test_real_width_model_is_smollm2s_shape_and_layers_can_be_cut():
    from gyre_hpc.bench.scale import REAL_WIDTH_PRESET, TrainModel

    spec = TrainModel(REAL_WIDTH_PRESET, layers=1)
    model = spec.build(seed=0)
    about = spec.describe(model)
    assert (about["d_model"], about["n_heads"], about["n_kv_heads"], about["d_ff"]) == (576, 9, 3, 1536)
    assert about["vocab_size"] == 49152 and about["n_layers"] == 1 == len(model.model.layers)
    assert model.lm_head is None and "random init" in about["weights"]
    # the embedding (tied head) is 28.3M of the parameters, one layer 3.5M
    assert about["params"] == 49152 * 576 + 576 + (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576)


def test_full_logits_step_is_the_chunked_heads_loss_and_is_refused_for_chunked_rows():
    from gyre_hpc.bench.scale import _step
    from gyre_hpc.models.decoder import build_model
    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.loss import StepWeights
    from gyre_hpc.trees.packing import collate, pack

    tree = build_tree(synthetic_journal(SyntheticConfig(n_calls=4), seed=1), task_id="t", reward=1.0)
    batch = collate(pack([tree], tree.n_tokens))
    weights = StepWeights(np.array([1.0]), np.array([int(tree.trained.sum())]), 1)
    model = build_model("tiny", seed=2)
    full = _step(model, batch, weights, None, 0)
    g_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    chunked = _step(model, batch, weights, None, 16)
    assert abs(full - chunked) <= 1e-6 * abs(full)
    for p, g in zip(model.parameters(), g_full):
        assert float((p.grad - g).abs().max()) <= 1e-5 * float(g.abs().max())
    result = CliRunner().invoke(command, ["--calls", "", "--train-tokens", "", "--logit-chunk", "0"])
    assert result.exit_code != 0 and "--logit-chunk" in result.output
