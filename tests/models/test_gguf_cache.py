"""model.gguf: a GGUF file or the distribution shipping one, imported once into a cached folder.

The GGUF is the tiny one tests/models/test_gguf_import.py writes (the gguf package writes it)."""
from __future__ import annotations

import shutil

import pytest

from gyre_hpc.config import ConfigError, RunConfig, build_config
from gyre_hpc.models.checkpoint import is_checkpoint
from gyre_hpc.models.tokenizer import load_tokenizer
from gyre_hpc.models.gguf_cache import GGUFSourceError, cached_gguf_checkpoint, gguf_file, gguf_key
from gyre_hpc.rl.preflight import check_config, with_gguf_checkpoint

from tests.models.test_gguf_import import reference, tokenizer, written  # noqa: F401  (fixtures)

pytest.importorskip("gguf", reason="the gguf package is not installed (the test extra has it)")


def test_a_gguf_is_imported_once_and_found_by_content(written, tmp_path):
    path, _ = written
    logs: list[str] = []
    first = cached_gguf_checkpoint(str(path), tmp_path / "cache", log=logs.append)
    assert is_checkpoint(first) and first.name == f"{path.stem}-{gguf_key(path)}"
    assert load_tokenizer(first).vocab_size > 0
    mtime = (first / "config.json").stat().st_mtime_ns
    copy = tmp_path / "elsewhere" / "same.gguf"     # the same bytes on another path: the same folder
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    assert gguf_key(copy) == gguf_key(path)
    again = cached_gguf_checkpoint(str(path), tmp_path / "cache", log=logs.append)
    assert again == first and (first / "config.json").stat().st_mtime_ns == mtime
    assert logs[0].startswith("[model] importing") and logs[1].startswith("[model] using cached")


def test_a_changed_file_gets_a_new_key(written, tmp_path):
    path, _ = written
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes() + b"\0")
    assert gguf_key(other) != gguf_key(path)


def test_a_distribution_name_finds_its_one_gguf_or_is_refused_by_field():
    with pytest.raises(GGUFSourceError, match=r"model.gguf='no-such-dist-h54' is neither"):
        gguf_file("no-such-dist-h54")
    with pytest.raises(GGUFSourceError, match=r"model.gguf='pytest': the distribution holds 0 .gguf"):
        gguf_file("pytest")
    with pytest.raises(GGUFSourceError, match="no such file"):
        gguf_file("/nonexistent/x.gguf")


def test_the_preflight_sets_model_path_from_model_gguf(written, tmp_path):
    path, _ = written
    cfg = RunConfig.model_validate({"workload": "rl", "model": {"gguf": str(path),
                                                                "gguf_cache_dir": str(tmp_path / "c")}})
    check_config(cfg)
    out = with_gguf_checkpoint(cfg, log=lambda m: None)
    assert out.model.gguf is None and is_checkpoint(out.model.path)
    assert build_config(out.model_dump()).model.path == out.model.path   # reloads: the two stay exclusive
    bad = cfg.model_copy(update={"model": cfg.model.model_copy(update={"gguf": str(tmp_path / "none.gguf")})})
    with pytest.raises(ConfigError, match="model.gguf=.*no such file"):
        check_config(bad)


def test_model_gguf_and_model_path_are_exclusive():
    with pytest.raises(ConfigError, match="model.gguf='a.gguf' and model.path='x': set one"):
        build_config({"model": {"gguf": "a.gguf", "path": "x"}})
