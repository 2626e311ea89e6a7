"""Fixtures for the engine tests: the sharp test model (see engine_helpers) saved once per
session as an HF-format checkpoint, the way engines load real policies."""
from __future__ import annotations

import pytest

from gyre_hpc.models.checkpoint import save_pretrained

from engine_helpers import make_sharp_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharp_tiny")
    save_pretrained(make_sharp_model(1), d)
    return d


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory):
    """Same shape, different weights: for load_weights tests."""
    d = tmp_path_factory.mktemp("sharp_tiny_other")
    save_pretrained(make_sharp_model(2), d)
    return d
