import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Model tests are small; one thread keeps them from fighting the rest of the suite for 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
