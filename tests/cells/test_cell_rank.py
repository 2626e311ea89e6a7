"""The cell rank's own checks (its serve loop runs in the fleet tests, under MPI)."""
import pytest


def test_a_join_in_place_on_a_state_the_core_moved_past_is_refused():
    from gyre_hpc.cells.cell_rank import check_in_place

    check_in_place(cell=2, rank=3, held=4, expected=4)
    check_in_place(cell=2, rank=3, held=4, expected=-1)          # unchecked (a classic join sends the state)
    with pytest.raises(RuntimeError, match="cell 2 rank 3: .* after 5 optimizer updates, but it holds 4"):
        check_in_place(cell=2, rank=3, held=4, expected=5)
