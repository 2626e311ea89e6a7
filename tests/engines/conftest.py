"""Fixtures for the engine tests: the sharp test model (see engine_helpers) saved once per
session as an HF-format checkpoint, the way engines load real policies."""
from __future__ import annotations

import pytest
import torch

from gyre_hpc.models.checkpoint import save_pretrained

from engine_helpers import make_sharp_model


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny-model decode steps are ~1 ms; with intra-op threads on a shared 2-core machine
    they spend 10x that spinning. Restored after each test so other parts are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
