"""``--model PATH`` for the benchmarks: a checkpoint folder in place of the random-init preset."""
from __future__ import annotations

import dataclasses
import json

import click
import pytest
import torch
from click.testing import CliRunner

from gyre_hpc.bench import migrate, model_option
from gyre_hpc.bench.engines import CASES, select_cases
from gyre_hpc.models.checkpoint import save_pretrained
from gyre_hpc.models.decoder import PRESETS, build_model


@pytest.fixture(scope="module")
def short_checkpoint(tmp_path_factory):
    """The tiny preset with 1024 positions, saved as a checkpoint folder: a model that cannot
    hold the benchmarks' longer defaults, as SmolLM2's 8192 cannot hold the 16K prefill."""
    model = build_model(dataclasses.replace(PRESETS["tiny"], max_position=1024), seed=3)
    path = tmp_path_factory.mktemp("ckpt") / "short"
    save_pretrained(model, path)
    return str(path), model


def test_load_model_reads_the_checkpoint_and_counts_its_bytes(short_checkpoint):
    path, model = short_checkpoint
    loaded = model_option.load_model(path)
    assert loaded.n_params == model.n_params == 123968
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert model_option.max_position(path) == 1024
    assert model_option.state_bytes(path) == 4 * 123968
    info = model_option.describe(path, loaded, "tiny")
    assert info["weights"] == "checkpoint short" and info["preset"] is None and info["max_position"] == 1024
    assert model_option.describe(None, model, "tiny")["weights"] == "preset tiny (random init)"


def test_a_folder_that_is_no_checkpoint_is_a_usage_error_naming_model(tmp_path):
    with pytest.raises(click.BadParameter, match="config.json") as err:
        model_option.load_model(str(tmp_path))
    assert err.value.param_hint == "--model"


def test_engine_cases_leave_out_the_defaults_the_model_cannot_hold_and_refuse_named_ones():
    cases, skipped = select_cases(None, 1.0, 8192)
    assert set(cases) == set(CASES) - {"c_prefill_16k"}
    assert skipped == {"c_prefill_16k": "longer than the model's max_position=8192"}
    assert cases["b_16x512+128"] == (16, 512, 128)
    assert select_cases(None, 1.0, 32768) == (CASES, {})
    assert select_cases("c_prefill_16k", 0.25, 8192)[0] == {"c_prefill_16k": (1, 4096, 1)}
    with pytest.raises(click.BadParameter, match="max_position=8192"):
        select_cases("a_1x256+256,c_prefill_16k", 1.0, 8192)
    with pytest.raises(click.BadParameter, match="valid cases are"):
        select_cases("d_nothing", 1.0, 8192)


def test_bench_migrate_on_a_checkpoint_measures_the_contexts_it_holds(short_checkpoint):
    path, _ = short_checkpoint
    out = CliRunner().invoke(migrate.command, ["--json", "--model", path, "--no-mpi", "--repeats", "1"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert list(result["contexts"]) == ["1024"]
    assert set(result["contexts_skipped"]) == {"8192", "32768"}
    assert "at most 1024" in result["contexts_skipped"]["8192"]
    assert result["model"]["weights"] == "checkpoint short" and result["model"]["kv_bytes_per_token"] == 512
    row = result["contexts"]["1024"]
    assert row["kv_tokens"] == 1024 - migrate.NEW_TOKENS + 1 and row["speedup_inprocess"] > 0
    out = CliRunner().invoke(migrate.command, ["--model", path, "--contexts", "2048", "--no-mpi"])
    assert out.exit_code != 0 and "--contexts" in out.output and "at most 1024" in out.output
