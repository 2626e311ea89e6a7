"""bench/engine_cases: contract 4's cases measured on TorchEngine, and the side-by-side rows."""
from __future__ import annotations

import json

import pytest

from gyre_hpc.bench.engine_cases import DEFAULT_CASES, EngineCase, case_prompts, compare, main, torch_engine_cases
from gyre_hpc.models.tiny_lm import build_model


def test_contract_cases_are_the_four_of_contract_4():
    assert [(c.streams, c.prompt_len, c.new_tokens) for c in DEFAULT_CASES] == [
        (1, 256, 256), (16, 512, 128), (1, 4096, 1), (1, 16384, 1)]


def test_torch_engine_cases_report_throughput_and_the_tokens_of_every_stream():
    cases = [EngineCase("two", 2, 20, 6), EngineCase("pf", 1, 40, 1)]
    out = torch_engine_cases(build_model("tiny", seed=0), cases, repeats=2)
    rows = out["torch_engine"]["cases"]
    two = rows["two"]
    assert len(two["token_ids"]) == 2 and all(len(t) == 6 for t in two["token_ids"])
    assert two["tokens_per_s"] == pytest.approx(12 / two["seconds"]) and two["repeats_agree"]
    assert two["seconds"] == min(two["all_seconds"]) and 0 < two["cpu_seconds"] <= two["seconds"] * 1.5
    assert rows["pf"]["unit"] == "prompt tokens/s" and rows["pf"]["tokens_per_s"] == pytest.approx(40 / rows["pf"]["seconds"])
    assert "vllm" not in out


def test_compare_reports_the_ratio_and_whether_tokens_agree():
    case = EngineCase("c", 2, 8, 3)
    ours = {"cases": {"c": {"unit": "new tokens/s", "tokens_per_s": 100.0, "seconds": 0.06, "cpu_seconds": 0.05,
                            "token_ids": [[1, 2, 3], [4, 5, 6]], "case": {}}}}
    theirs = {"cases": {"c": {"unit": "new tokens/s", "tokens_per_s": 150.0, "seconds": 0.04, "cpu_seconds": 0.02,
                              "token_ids": [[1, 2, 3], [4, 5, 7]], "case": {}}}}
    row = compare(ours, theirs)["c"]
    assert row["vllm_faster_by"] == pytest.approx(1.5) and row["vllm_faster_by_cpu_time"] == pytest.approx(2.5)
    assert row["tokens_identical"] is False and row["tokens_matching"] == "5/6"
    assert case_prompts(case, 264) == case_prompts(case, 264) != case_prompts(case, 264, seed=1)


def test_main_without_vllm_prints_torch_engine_figures(capsys):
    main(["--preset", "tiny", "--cases", "1x256+256", "--repeats", "1"])
    result = json.loads(capsys.readouterr().out)
    assert result["torch_engine"]["1x256+256"]["case"]["new_tokens"] == 256
    assert "comparison" not in result


def test_an_unknown_case_is_named_with_the_valid_ones():
    with pytest.raises(SystemExit):
        main(["--cases", "1x1"])


def test_main_with_model_runs_the_checkpoint_and_refuses_cases_past_its_positions(tmp_path, capsys):
    import dataclasses

    from gyre_hpc.models.checkpoint import save_pretrained
    from gyre_hpc.models.decoder import PRESETS
    from gyre_hpc.models.decoder import build_model as build_decoder

    save_pretrained(build_decoder(dataclasses.replace(PRESETS["tiny"], max_position=1024), seed=0), tmp_path / "ckpt")
    main(["--model", str(tmp_path / "ckpt"), "--cases", "1x256+256", "--repeats", "1"])
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == str(tmp_path / "ckpt") and result["preset"] is None and result["sharpen"] is None
    assert result["torch_engine"]["1x256+256"]["case"]["new_tokens"] == 256
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "ckpt"), "--cases", "prefill4k"])
    assert "max_position=1024" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path)])
    assert "--model" in capsys.readouterr().err
