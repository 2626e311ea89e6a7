"""Which cell sizes can shard a model (cells.shard_shape): pure shape arithmetic."""
import pytest
import torch

from gyre_hpc.cells.shard_shape import check_shardable, narrowest, parameter_shapes
from gyre_hpc.models.decoder import LMConfig, CausalLM


def test_uneven_rows_shard_but_more_ranks_than_rows_do_not():
    shapes = {"embed": (101, 64), "norm": (64,), "kv": (32, 64)}
    assert narrowest(shapes) == ("kv", 32)
    check_shardable(shapes, 1)
    check_shardable(shapes, 3)        # 101 and 64 rows over 3 ranks: FSDP2 pads the last slice
    check_shardable(shapes, 32)
    with pytest.raises(ValueError, match=r"cells.ranks_per_cell=40: the model's kv has 32 rows .* 8 of the "
                                         r"cell's 40 ranks would hold none of it"):
        check_shardable(shapes, 40)
    with pytest.raises(ValueError, match=r"cells.ranks_per_cell=0 must be >= 1"):
        check_shardable(shapes, 0)


def test_a_scalar_parameter_counts_as_one_row_and_no_parameters_is_an_error():
    assert narrowest({"scale": (), "w": (4, 4)}) == ("scale", 1)
    with pytest.raises(ValueError, match="no parameters"):
        narrowest({})


def test_parameter_shapes_of_a_meta_model_cost_no_weights():
    with torch.device("meta"):
        model = CausalLM(LMConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24))
    shapes = parameter_shapes(model.named_parameters())
    assert shapes["model.embed_tokens.weight"] == (50, 16)
    assert narrowest(shapes)[1] == 8       # one kv head of 8
