import re

import pytest

from gyre_hpc.config import ConfigError, build_config, load_config


def test_defaults_validate():
    cfg = build_config()
    assert cfg.cells.count == 3 and cfg.cells.core == 0


def test_unknown_key_names_field_and_valid_keys():
    with pytest.raises(ConfigError) as e:
        build_config({"cells": {"cuont": 3}})
    msg = str(e.value)
    assert "cells.cuont" in msg and "count" in msg and "ranks_per_cell" in msg


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"cells\.count"):
        build_config({"cells": {"count": "many"}})


def test_bad_choice_lists_valid_choices():
    with pytest.raises(ConfigError) as e:
        build_config({"scheduler": {"policy": "greedy"}})
    assert "scheduler.policy" in str(e.value) and "colocate" in str(e.value)


def test_core_outside_plan_rejected():
    with pytest.raises(ConfigError, match=r"cells\.core=5"):
        build_config({"cells": {"count": 3, "core": 5}})


def test_core_cannot_be_rollout_only():
    with pytest.raises(ConfigError, match="core cell"):
        build_config({"cells": {"count": 3, "core": 0, "rollout_only": [0]}})


def test_more_cells_than_nodes_rejected():
    cfg = build_config({"cells": {"count": 5}})
    with pytest.raises(ConfigError, match="needs 5 nodes, the cluster has 4"):
        cfg.validate_against_nodes(4)


def test_overrides_keep_yaml_types(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("cells:\n  count: 2\n")
    cfg = load_config(p, ["cells.count=4", "cells.rollout_only=[2,3]", "train.lr=0.01"])
    assert cfg.cells.count == 4 and cfg.cells.rollout_only == [2, 3] and cfg.train.lr == 0.01


def test_malformed_yaml_names_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("cells: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(p)


def test_missing_file_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        build_config(overrides=["cells.count"])


def test_roundtrip_yaml():
    cfg = build_config({"cells": {"count": 4}})
    import yaml
    assert build_config(yaml.safe_load(cfg.to_yaml())) == cfg


# --- strictness: every bad value below is refused before anything starts, naming the field


def test_duplicate_yaml_key_is_refused_naming_key_and_lines(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("train:\n  lr: 0.01\ncells:\n  count: 2\ntrain:\n  steps: 9\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml.*duplicate key 'train'.*line 1.*line 5"):
        load_config(p)


def test_duplicate_key_inside_an_override_value_is_refused():
    with pytest.raises(ConfigError, match="duplicate key 'fill'"):
        build_config(overrides=["scheduler.elastic={fill: 0.5, fill: 0.9}"])


@pytest.mark.parametrize("field,value", [("train.lr", ".inf"), ("train.lr", ".nan"), ("rollout.run_timeout_s", ".inf"),
                                         ("rollout.temperature", "-.inf"), ("scheduler.elastic.fill", ".nan")])
def test_non_finite_floats_are_refused(field, value):
    with pytest.raises(ConfigError, match=re.escape(field) + ".*finite"):
        build_config(overrides=[f"{field}={value}"])


@pytest.mark.parametrize("field,value", [("cells.count", "1e20"), ("cells.count", "100000000000000000000"),
                                         ("cells.count", "1.0e15"), ("train.steps", "99999999999999"),
                                         ("rollout.runs_per_task", "1000000000")])
def test_out_of_range_counts_are_refused(field, value):
    with pytest.raises(ConfigError, match=re.escape(field)):
        build_config(overrides=[f"{field}={value}"])


def test_empty_run_dir_is_refused():
    with pytest.raises(ConfigError, match="run_dir: .*is empty"):
        build_config(overrides=["run_dir="])
    with pytest.raises(ConfigError, match="run_dir: .*is empty"):
        build_config({"run_dir": "  "})


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"run_dir.*afile.*not a directory"):
        build_config(overrides=[f"run_dir={f}"])
    with pytest.raises(ConfigError, match=r"run_dir.*not a directory"):
        build_config(overrides=[f"run_dir={f}/sub"])


def test_unknown_scheduler_parameter_lists_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        build_config(overrides=["scheduler.elastic={target_requests_per_engin: 8}"])
    msg = str(e.value)
    assert "scheduler.elastic" in msg and "target_requests_per_engin" in msg and "target_requests_per_engine" in msg


def test_bad_scheduler_parameter_value_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"scheduler\.elastic.*target_requests_per_engine"):
        build_config(overrides=["scheduler.elastic={target_requests_per_engine: 0}"])


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_top_p_outside_the_unit_interval_is_refused(value):
    with pytest.raises(ConfigError, match=re.escape("rollout.top_p")):
        build_config(overrides=[f"rollout.top_p={value}"])
    assert build_config(overrides=["rollout.top_p=0.9"]).rollout.top_p == 0.9


def test_paced_cells_take_a_named_device_with_fields_over_it():
    cfg = build_config({"cells": {"device": "paced", "pace": {"engine": {"single_seq_tokens_per_s": 10, "max_seqs": 4},
                                                             "speed": {2: 0.7}}}})
    engine, train = cfg.cells.pace.devices()
    assert engine.single_seq_tokens_per_s == 10.0 and engine.max_seqs == 4 and train.tokens_per_s > 0
    with pytest.raises(ConfigError, match=r"cells\.pace.*engine: unknown field speedy"):
        build_config({"cells": {"pace": {"engine": {"speedy": 1}}}})
    with pytest.raises(ConfigError, match=r"cells\.pace.*valid presets: paper-local"):
        build_config({"cells": {"pace": {"preset": "h100"}}})
    with pytest.raises(ConfigError, match=r"single_seq_tokens_per_s"):
        build_config({"cells": {"pace": {"engine": {"single_seq_tokens_per_s": -1}}}})
    with pytest.raises(ConfigError, match=r"cells\.pace\.speed has cells \[7\]"):
        build_config({"cells": {"count": 3, "pace": {"speed": {7: 0.5}}}})
    with pytest.raises(ConfigError, match="must be > 0"):
        build_config({"cells": {"pace": {"speed": {1: 0}}}})


def test_paced_elastic_is_checked_against_its_device_before_launch():
    """Sized from the device in every rank (``device_sized``): refused when the config loads."""
    paced = {"device": "paced", "pace": {"engine": {"max_seqs": 4}}}
    cfg = build_config({"cells": paced, "scheduler": {"elastic": {"max_requests_per_engine": 4}}})
    assert cfg.scheduler.elastic == {"max_requests_per_engine": 4}
    with pytest.raises(ConfigError, match=r"scheduler\.elastic with cells\.device=paced: elastic "
                                          r"max_requests_per_engine=5 is more than the engine admits at once"):
        build_config({"cells": paced, "scheduler": {"elastic": {"max_requests_per_engine": 5}}})
    # native cells have no device to check against
    assert build_config({"scheduler": {"elastic": {"max_requests_per_engine": 5}}}).scheduler.elastic


def test_the_workload_registry_and_the_workload_field_name_the_same_workloads():
    import typing

    from gyre_hpc.config import WORKLOADS, WorkloadName

    assert set(WORKLOADS) == set(typing.get_args(WorkloadName))
    for name, entry in WORKLOADS.items():   # entry points are started as processes, never imported
        assert entry.fleet[0] == "-m" and entry.fleet[1].startswith("gyre_hpc."), name
        assert entry.preflight is None or entry.preflight[0] == "-m", name


def test_snapshot_every_defaults_to_8_and_refuses_zero():
    assert build_config().rollout.snapshot_every == 8
    assert build_config(overrides=["rollout.snapshot_every=32"]).rollout.snapshot_every == 32
    with pytest.raises(ConfigError, match=r"rollout\.snapshot_every"):
        build_config(overrides=["rollout.snapshot_every=0"])
